"""Every gallery model (tests/gallery.py) and gpt, trained by every strategy on two workers.

Synchronous strategies must give serial's per-step losses within a relative 1e-4 where the
numerics allow it; where they do not, the difference is stated and tested:

- BatchNorm normalises over the rows one forward sees: each data-parallel replica's half
  batch, each pipeline micro-batch. So ddp, fsdp, local-sgd, hybrid 2x1 and gpipe with two
  micro-batches all normalise the same two half batches and equal one another (1e-4),
  model-parallel (one micro-batch) equals serial, and gpipe/1f1b with four micro-batches
  and hybrid 1x2 (two replicas of two micro-batches) normalise quarters. None of those equals serial; all stay within 5% of it here.
- Dropout masks come from each worker's own generator for the rows it holds, so no
  parallel run draws serial's masks: the losses differ by dropout noise (within 10% here,
  tested) and training still converges.
- hogwild races by design: tested to train (finite losses that fall), never equal.

All cells of the matrix run in ONE launch of two workers (tests/gallery_worker.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from partrain.config import RunConfig
from partrain.distributed.spawn import spawn
from partrain.errors import PartrainError
from partrain.runner import preflight
from tests.gallery_worker import run_cells

pytestmark = pytest.mark.multiproc

STEPS = 8
IMAGE = dict(dataset="mnist", synthetic=True, limit=512, lr=0.1)
TOKENS = dict(dataset="tokens@16", limit=512, lr=0.5)
MODELS = {
    "noncontig": IMAGE, "tokens3d": IMAGE, "batchnorm": IMAGE, "dropout": IMAGE,
    "tuple_out": TOKENS, "tied": TOKENS, "traced": IMAGE, "gpt": TOKENS,
}
STRATEGIES = {
    "serial": dict(strategy="serial", workers=1),
    "ddp": dict(strategy="ddp", workers=2),
    "local-sgd": dict(strategy="local-sgd", workers=2, average_every=1),  # K=1, plain SGD: the serial step
    "fsdp": dict(strategy="fsdp", workers=2),
    "model-parallel": dict(strategy="model-parallel", workers=2),
    "gpipe": dict(strategy="gpipe", workers=2, microbatches=4),
    "gpipe-m2": dict(strategy="gpipe", workers=2, microbatches=2),
    "1f1b": dict(strategy="1f1b", workers=2, microbatches=4),
    "hybrid-2x1": dict(strategy="hybrid", workers=2, pp=2, dp=1, microbatches=2),
    "hybrid-1x2": dict(strategy="hybrid", workers=2, pp=1, dp=2, microbatches=2),
    "hogwild": dict(strategy="hogwild", workers=2),
}
SYNCHRONOUS = [s for s in STRATEGIES if s not in ("serial", "hogwild")]
EVALUATED = ["tuple_out", "traced", "gpt"]


def _config(model: str, strategy: str) -> RunConfig:
    name = "gpt" if model == "gpt" else f"tests.gallery:{model}"
    options = dict(layers=2, d_model=32, heads=4) if model == "gpt" else {}
    scored = model in EVALUATED  # evaluation runs the schedules' eval path and scores token logits per token
    return RunConfig(model=name, model_options=options, steps=STEPS, batch_size=32, momentum=0.0, evaluate=scored,
                     eval_limit=64, threads=1, timeout_s=60, **MODELS[model], **STRATEGIES[strategy])


@pytest.fixture(scope="module")
def matrix() -> dict[str, list[float] | str]:
    cells = [(f"{m}/{s}", _config(m, s)) for m in MODELS for s in STRATEGIES]
    for _, cfg in cells:
        if cfg.workers > 1:
            preflight(cfg)  # every cell passes the checks the CLI makes before spawning
    return spawn(run_cells, (cells,), 2)[0]


def _result(matrix, model: str, strategy: str) -> dict:
    got = matrix[f"{model}/{strategy}"]
    assert not isinstance(got, str), f"{model} with {strategy} failed: {got}"
    return got


def _losses(matrix, model: str, strategy: str) -> torch.Tensor:
    got = _result(matrix, model, strategy)["losses"]
    assert len(got) == STEPS and all(math.isfinite(v) for v in got)
    return torch.tensor(got)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().div(b.abs()).max().item()


EXACT = ["noncontig", "tokens3d", "tuple_out", "tied", "traced", "gpt"]


@pytest.mark.parametrize("model", EXACT)
@pytest.mark.parametrize("strategy", SYNCHRONOUS)
def test_synchronous_equals_serial(matrix, model, strategy):
    serial = _losses(matrix, model, "serial")
    assert serial[-2:].mean() < serial[:2].mean(), f"{model} did not learn serially"
    assert _rel(_losses(matrix, model, strategy), serial) <= 1e-4


@pytest.mark.parametrize("model", EVALUATED)
def test_evaluation_equals_serial(matrix, model):
    # the same final weights score the same test rows alike, through every schedule's eval path
    serial = _result(matrix, model, "serial")["accuracy"]
    assert serial is not None and 0 < serial < 1
    for strategy in SYNCHRONOUS:
        assert abs(_result(matrix, model, strategy)["accuracy"] - serial) <= 1e-3, strategy


@pytest.mark.parametrize("model", list(MODELS))
def test_hogwild_trains(matrix, model):
    losses = _losses(matrix, model, "hogwild")  # racing updates: the mean of the last half against the first
    assert losses[STEPS // 2:].mean() < losses[:STEPS // 2].mean()


def test_batchnorm_statistics_per_replica_and_micro_batch(matrix):
    serial = _losses(matrix, "batchnorm", "serial")
    halves = _losses(matrix, "batchnorm", "ddp")
    assert _rel(_losses(matrix, "batchnorm", "model-parallel"), serial) <= 1e-4  # one micro-batch: serial's statistics
    for strategy in ("fsdp", "local-sgd", "gpipe-m2", "hybrid-2x1"):
        assert _rel(_losses(matrix, "batchnorm", strategy), halves) <= 1e-4, strategy  # the same two half batches
    quarters = _losses(matrix, "batchnorm", "gpipe")  # 4 micro-batches; hybrid 1x2: 2 replicas x 2 micro-batches
    for strategy in ("1f1b", "hybrid-1x2"):
        assert _rel(_losses(matrix, "batchnorm", strategy), quarters) <= 1e-4, strategy
    for strategy in ("ddp", "gpipe"):
        diff = _rel(_losses(matrix, "batchnorm", strategy), serial)
        assert 1e-6 < diff <= 0.05, f"{strategy}: {diff:.2e}"  # different statistics, a small difference


BN_REPLICAS = {  # two replicas whose buffers no wrapper communicates (DDP broadcasts rank 0's each forward)
    "fsdp": STRATEGIES["fsdp"],
    "hybrid-1x2": {**STRATEGIES["hybrid-1x2"], "microbatches": 1},  # one forward a step, as serial's
    "local-sgd": STRATEGIES["local-sgd"],  # averaged after the step
    "local-sgd-epoch": dict(strategy="local-sgd", workers=2, average_every="epoch"),  # averaged at the run's end
}


def _bn_run(folder, **strategy) -> tuple[RunConfig, object]:
    from partrain.runner import run_training

    cfg = RunConfig(model="tests.gallery:batchnorm", steps=1, batch_size=32, momentum=0.0, eval_limit=64, threads=1,
                    timeout_s=60, checkpoint=str(folder / "ckpt"), save_model=str(folder / "model.pt"), **IMAGE, **strategy)
    return cfg, run_training(cfg, show_progress=False)


@pytest.fixture(scope="module")
def bn_serial(tmp_path_factory) -> dict:
    cfg, _ = _bn_run(tmp_path_factory.mktemp("bn_serial"), **STRATEGIES["serial"])
    return torch.load(cfg.save_model, weights_only=True)["state_dict"]


@pytest.mark.parametrize("strategy", list(BN_REPLICAS))
def test_batchnorm_buffers_are_averaged_over_the_replicas_and_scored_as_one_model(tmp_path, bn_serial, strategy):
    from tests.test_multiproc import assert_one_model, rank_states, score_saved_model

    cfg, result = _bn_run(tmp_path, **BN_REPLICAS[strategy])
    # each replica kept its own running statistics, before (fsdp's files hold parameter shards: buffers only)
    assert_one_model(rank_states(tmp_path / "ckpt"), only=("running_", "num_batches_tracked"))
    # one step from the same weights: each replica's running mean is a tenth of its half batch's channel
    # means, so their mean is a tenth of the whole batch's, as serial's is (an unbiased variance per half is not)
    mine = torch.load(cfg.save_model, weights_only=True)["state_dict"]
    torch.testing.assert_close(mine["0.1.running_mean"], bn_serial["0.1.running_mean"], rtol=1e-5, atol=1e-7)
    loss, accuracy = score_saved_model(cfg)  # evaluation scored every row with that one model
    assert result.epochs[-1].test_loss == pytest.approx(loss, rel=1e-6)
    assert result.epochs[-1].test_accuracy == accuracy


def test_dropout_differs_by_its_noise_only(matrix):
    serial = _losses(matrix, "dropout", "serial")
    for strategy in SYNCHRONOUS:
        losses = _losses(matrix, "dropout", strategy)
        assert _rel(losses, serial) <= 0.10, strategy
        assert losses[-2:].mean() < losses[:2].mean(), strategy


@pytest.mark.parametrize("model,message", [
    ("dict_out", "block 0 (ReturnsDict) returns a dict of Tensor, str, which cannot cross a pipeline stage"),
    ("untraceable", "Untraceable is a plain nn.Module and torch.export cannot trace it whole"),
])
@pytest.mark.parametrize("strategy", ["gpipe", "1f1b", "hybrid-2x1", "model-parallel"])
def test_refused_before_any_worker_starts(model, message, strategy):
    with pytest.raises(PartrainError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preflight(RunConfig(model=f"tests.gallery:{model}", **IMAGE, **STRATEGIES[strategy]))


@pytest.mark.parametrize("strategy", ["fsdp", "hybrid-1x2"])
def test_a_scalar_parameter_is_refused_where_fully_shard_would_shard_it(strategy):
    # fully_shard shards along dim 0, which a scalar lacks: a worker's ValueError, before
    with pytest.raises(PartrainError, match="parameter gain is a scalar, which fully_shard .* cannot shard: give it shape"):
        preflight(RunConfig(model="tests.gallery:scalar_gain", **IMAGE, **STRATEGIES[strategy]))
    preflight(RunConfig(model="tests.gallery:scalar_gain", **IMAGE, **STRATEGIES["ddp"]))  # DDP takes it


def test_cli_refuses_in_one_line_with_status_2(capsys):
    from partrain.cli import main

    status = main(["train", "--model", "tests.gallery:dict_out", "--synthetic", "--strategy", "1f1b", "--workers", "2"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert err.startswith("partrain: error: block 0 (ReturnsDict) returns a dict")


def test_refusals_name_the_fix():
    with pytest.raises(PartrainError, match="or use a data-parallel strategy"):
        preflight(RunConfig(model="tests.gallery:dict_out", **IMAGE, **STRATEGIES["gpipe"]))
    with pytest.raises(PartrainError, match=r"return \(model, blocks\) from the factory"):
        preflight(RunConfig(model="tests.gallery:untraceable", **IMAGE, **STRATEGIES["gpipe"]))
    preflight(RunConfig(model="tests.gallery:dict_out", **IMAGE, **STRATEGIES["ddp"]))  # data parallel: no boundary


def _run(**overrides) -> list[float]:
    from partrain.runner import run_training

    base = dict(steps=6, batch_size=32, momentum=0.0, evaluate=False, threads=1, timeout_s=60)
    return torch.tensor(run_training(RunConfig(**{**base, **overrides}), show_progress=False).step_losses)


@pytest.mark.slow
def test_tied_gpt_on_a_2x2_hybrid_equals_serial():
    # the tie's copies live on both stages of each replica; replicas average, stages sum
    gpt = dict(model="gpt", model_options=dict(layers=2, d_model=32, heads=4, tie=True), **TOKENS)
    serial = _run(**gpt)
    assert _rel(_run(**gpt, strategy="hybrid", workers=4, pp=2, dp=2, microbatches=2), serial) <= 1e-4


@pytest.mark.slow
def test_traced_module_on_a_2x2_hybrid_equals_serial():
    # the tracer's pieces are blocks: each stage replicated over its dp group like any other
    traced = dict(model="tests.gallery:traced", **IMAGE)
    serial = _run(**traced)
    assert _rel(_run(**traced, strategy="hybrid", workers=4, pp=2, dp=2, microbatches=2), serial) <= 1e-4


def test_a_weight_tied_in_a_traced_module_trains_as_serially():
    # Pipe copies a weight two pieces use; tied again, its stages' gradients are summed (tied.py)
    tied = dict(model="tests.gallery:traced_tied", **IMAGE)
    split = _run(**tied, strategy="gpipe", workers=2, microbatches=2, split_points=[2])  # first | last: a stage each
    assert _rel(split, _run(**tied)) <= 1e-4


def test_ddp_of_a_model_with_a_parameter_its_forward_never_uses_trains_as_serially():
    # DDP would wait for that gradient forever (a worker traceback, before): the meta pass finds it
    from partrain.models.check import unused_parameters
    from tests.gallery import unused

    assert unused_parameters(unused((1, 28, 28), 10), torch.zeros(2, 1, 28, 28)) == ["spare.weight", "spare.bias"]
    assert unused_parameters(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)), torch.zeros(2, 1, 28, 28)) == []
    spare = dict(model="tests.gallery:unused", **IMAGE)
    assert _rel(_run(**spare, strategy="ddp", workers=2), _run(**spare)) <= 1e-4


def test_a_module_dict_is_cut_between_its_entries_and_trains_as_serially():
    # the tracer's split candidates are the children of ModuleList, Sequential and ModuleDict
    # (a ModuleDict was one block: "has only 1 blocks", before)
    parts = dict(model="tests.gallery:module_dict", **IMAGE)
    assert _rel(_run(**parts, strategy="gpipe", workers=2, microbatches=2), _run(**parts)) <= 1e-4


def test_a_model_in_bfloat16_of_its_own_crosses_stages_in_bfloat16():
    # its activations are bf16 because its weights are: the stages' examples keep them so
    # (widened to float32 they met the next stage's bf16 weights: a dtype error, before)
    bf16 = dict(model="tests.gallery:bf16_weights", **IMAGE)
    serial = _run(**bf16)
    assert _rel(_run(**bf16, strategy="1f1b", workers=2, microbatches=2), serial) <= 1e-2  # bf16 sums, split otherwise
    low = _run(**bf16, precision="bf16")  # --precision bf16 too: its stages send bf16 to bf16 weights
    assert _rel(_run(**bf16, precision="bf16", strategy="1f1b", workers=2, microbatches=2), low) <= 1e-2


def test_a_pipeline_worker_without_parameters_trains_as_serially():
    # the last block is a fixed projection in buffers: its worker steps an empty optimizer
    fixed = dict(model="tests.gallery:fixed_tail", **IMAGE)
    assert _rel(_run(**fixed, strategy="1f1b", workers=2, microbatches=2, split_points=[2]), _run(**fixed)) <= 1e-4


@pytest.mark.slow
def test_traced_module_interleaved_equals_serial():
    traced = dict(model="tests.gallery:traced", **IMAGE)
    serial = _run(**traced)
    interleaved = _run(**traced, strategy="1f1b", schedule="interleaved-1f1b", stages_per_worker=2, workers=2, microbatches=4)
    assert _rel(interleaved, serial) <= 1e-4
