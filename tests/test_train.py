"""The training loop on one worker: determinism, resume, evaluation, real-data accuracy."""

from __future__ import annotations

import pytest
import torch

from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.events import read_events
from partrain.runner import run_training

pytestmark = pytest.mark.alone  # trains on both cores in pytest's own process: never beside another test (make test)


def train(data_dir, **kw):
    base = dict(data_dir=str(data_dir), threads=2)
    return run_training(RunConfig(**{**base, **kw}), show_progress=False)


def test_same_seed_same_result_different_seed_different(data_dir):
    kw = dict(model="cnn", steps=15, limit=2000, eval_limit=500)
    a, b, c = train(data_dir, **kw), train(data_dir, **kw), train(data_dir, seed=1, **kw)
    assert a.step_losses == b.step_losses and a.test_accuracy == b.test_accuracy
    assert a.step_losses != c.step_losses


def test_resume_gives_the_same_result_as_not_stopping(data_dir, tmp_path):
    kw = dict(model="mlp", limit=640, batch_size=64, epochs=3, eval_limit=500)
    straight = train(data_dir, **kw)
    ckpt = tmp_path / "ckpt"
    train(data_dir, steps=14, checkpoint=str(ckpt), **kw)  # stops mid-epoch 2 (10 steps an epoch)
    newest = ckpt / (ckpt / "LATEST").read_text()
    assert (newest / "rank0.pt").exists() and (newest / "meta.json").exists()
    assert [d.name for d in ckpt.glob("step-*")] == [newest.name]  # older sets are gone once the new one is whole
    resumed = train(data_dir, resume=str(ckpt), **kw)
    assert resumed.step_losses == straight.step_losses
    assert resumed.test_accuracy == straight.test_accuracy
    # epoch 2, begun before the stop and ended after it, is one entry (it was two)
    assert [(e.epoch, e.steps) for e in resumed.epochs] == [(e.epoch, e.steps) for e in straight.epochs] == [(1, 10), (2, 10), (3, 10)]
    assert resumed.epochs[1].train_loss == pytest.approx(straight.epochs[1].train_loss)


def test_a_checkpoint_removes_only_the_sets_it_wrote(data_dir, tmp_path):
    """Older sets and a partial one a kill left are removed; a folder of the user's is kept,
    even one named like a set (an audit found both deleted)."""
    ckpt = tmp_path / "ckpt"
    for folder, name in (("step-notes", "readme.txt"), ("step-000099", "results.csv"), ("step-000098", ".rank0.pt.tmp")):
        (ckpt / folder).mkdir(parents=True)
        (ckpt / folder / name).write_text("x")
    train(data_dir, model="mlp", epochs=2, steps=12, limit=640, batch_size=64, checkpoint=str(ckpt), evaluate=False)
    assert (ckpt / "LATEST").read_text() == "step-000012"
    assert sorted(d.name for d in ckpt.iterdir()) == ["LATEST", "step-000012", "step-000099", "step-notes"]


def test_resume_refuses_another_configuration(data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    train(data_dir, model="mlp", steps=2, limit=256, checkpoint=str(ckpt), evaluate=False)
    with pytest.raises(PartrainError, match="written with model='mlp', this run has model='cnn'"):
        train(data_dir, model="cnn", steps=2, limit=256, resume=str(ckpt), evaluate=False)


def test_resume_tells_a_damaged_file_and_a_finished_run_from_a_mismatch(data_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    kw = dict(model="mlp", limit=640, batch_size=64, evaluate=False)
    train(data_dir, epochs=2, checkpoint=str(ckpt), **kw)
    again = train(data_dir, epochs=1, resume=str(ckpt), **kw)  # the checkpoint is past this run's end
    assert len(again.step_losses) == 20 and "nothing to train" in capsys.readouterr().err
    (ckpt / "step-000020" / "rank0.pt").write_text("junk")
    with pytest.raises(PartrainError, match="rank0.pt is unreadable .*the file is damaged"):
        train(data_dir, epochs=3, resume=str(ckpt), **kw)


def test_resume_refuses_another_pipeline_cut(data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    kw = dict(model="cnn", strategy="gpipe", workers=2, limit=256, batch_size=64, evaluate=False, threads=1)
    train(data_dir, steps=2, checkpoint=str(ckpt), split_points=[1], **kw)
    with pytest.raises(PartrainError, match="written with --split-points 1, this run asks for 2"):
        train(data_dir, steps=4, epochs=2, resume=str(ckpt), split_points=[2], **kw)


def _saved(ckpt) -> list[dict]:
    """Every rank's file of the newest set in ``ckpt``, rank 0 first."""
    newest = ckpt / (ckpt / "LATEST").read_text()
    return [torch.load(newest / f"rank{r}.pt", weights_only=True) for r in range(len(list(newest.glob("rank*.pt"))))]


def test_recompute_counts_batchnorm_once_and_keeps_the_blocks_keys():
    """checkpoint re-runs the block in backward, in training mode: BatchNorm's statistics
    moved twice a micro-batch, and the wrapper's ``block.`` was in every key (an audit found both)."""
    import copy

    import torch.nn as nn

    from partrain.strategies.pipeline import Recompute

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    wrapped = Recompute(copy.deepcopy(plain))
    x = torch.randn(8, 1, 8, 8)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    assert wrapped.block[1].num_batches_tracked.item() == 1
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(wrapped.state_dict()[key], value), key
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    plain.load_state_dict(wrapped.state_dict())  # and back: each loads the other's
    wrapped.load_state_dict(plain.state_dict())


BN_PIPE = dict(model="tests.gallery:batchnorm", strategy="gpipe", workers=2, microbatches=2, split_points=[2],
               limit=256, batch_size=64, evaluate=False, threads=1, timeout_s=60)  # 4 steps an epoch


@pytest.mark.multiproc
def test_recompute_leaves_a_pipelines_batchnorm_statistics_as_without_it(data_dir, tmp_path):
    plain, recomputed = tmp_path / "plain", tmp_path / "recomputed"
    a = train(data_dir, steps=3, checkpoint=str(plain), **BN_PIPE)
    b = train(data_dir, steps=3, checkpoint=str(recomputed), recompute=True, **BN_PIPE)
    assert b.step_losses == pytest.approx(a.step_losses, rel=1e-6)
    for mine, ref in zip(_saved(recomputed), _saved(plain), strict=True):  # a stage a rank
        assert mine["model"].keys() == ref["model"].keys()
        for key, value in ref["model"].items():
            torch.testing.assert_close(mine["model"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert _saved(recomputed)[0]["model"]["0.blocks.0.1.num_batches_tracked"].item() == 3 * 2  # steps x micro-batches


@pytest.mark.multiproc
def test_resume_may_turn_recompute_on_or_off(data_dir, tmp_path, capsys):
    kw = dict(BN_PIPE, epochs=2)
    straight = train(data_dir, **kw)
    for before in (False, True):
        ckpt = tmp_path / f"recompute-{before}"
        train(data_dir, steps=3, checkpoint=str(ckpt), recompute=before, **kw)
        resumed = train(data_dir, resume=str(ckpt), recompute=not before, **kw)
        assert resumed.step_losses == pytest.approx(straight.step_losses, rel=1e-6)
        assert f"recompute {before} -> {not before}" in capsys.readouterr().err


@pytest.mark.multiproc
def test_fsdp_resumes_parameters_whose_rows_do_not_split_evenly(data_dir, tmp_path):
    # FSDP2 cuts dim 0 as torch.chunk does: 255 rows on 2 workers are shards of 128 and 127
    kw = dict(model="mlp", model_options=dict(hidden=[255, 127]), strategy="fsdp", workers=2, limit=256,
              batch_size=64, evaluate=False, threads=1, timeout_s=60)
    straight = train(data_dir, epochs=2, **kw)
    ckpt = tmp_path / "ckpt"
    train(data_dir, epochs=1, checkpoint=str(ckpt), **kw)
    assert "momentum_buffer" in str(_saved(ckpt)[1]["optimizer"]["state"])  # sharded state to put back
    resumed = train(data_dir, epochs=2, resume=str(ckpt), **kw)
    assert resumed.step_losses == straight.step_losses


def test_a_cpu_run_saves_no_gpu_generator_and_resumes_a_gpu_runs_set(data_dir, tmp_path):
    """Dropout draws from the GPU's generator on a GPU (test_gpu.py resumes there); on the CPU
    the set holds the CPU's alone, and a set that also holds a GPU's resumes on the CPU."""
    kw = dict(model="tests.gallery:dropout", limit=640, batch_size=64, evaluate=False)
    straight = train(data_dir, epochs=2, **kw)
    ckpt = tmp_path / "ckpt"
    train(data_dir, epochs=1, checkpoint=str(ckpt), **kw)
    path = ckpt / (ckpt / "LATEST").read_text() / "rank0.pt"
    state = torch.load(path, weights_only=True)
    assert "rng" in state and "cuda_rng" not in state
    torch.save({**state, "cuda_rng": torch.zeros(16, dtype=torch.uint8)}, path)  # as a GPU run would have
    resumed = train(data_dir, epochs=2, resume=str(ckpt), **kw)
    assert resumed.step_losses == straight.step_losses


def test_cifar10_sample_lowers_its_loss(data_dir):
    r = train(data_dir, model="cnn", dataset="cifar10", epochs=2, batch_size=32, limit=1024, eval_limit=200)
    first, last = sum(r.step_losses[:8]) / 8, sum(r.step_losses[-8:]) / 8
    assert last < 0.9 * first
    assert r.epochs[-1].test_accuracy is not None


def test_steps_limit_and_batch_accounting(data_dir):
    r = train(data_dir, model="mlp", steps=7, limit=1000, batch_size=100, evaluate=False)
    assert len(r.step_losses) == len(r.step_seconds) == 7
    assert r.epochs[0].steps == 7 and r.epochs[0].test_accuracy is None
    s = r.summary()  # 7 of the epoch's 10 steps: the epoch is the median step times 10, and says so
    assert s["epoch_extrapolated"] and s["seconds_per_epoch"] == pytest.approx(10 * s["seconds_per_step"])
    assert r.parameters == 235_146


def test_steps_beyond_the_epochs_are_cut_and_said(data_dir, capsys):
    r = train(data_dir, model="mlp", steps=50, limit=640, batch_size=64, evaluate=False)  # --epochs 1: 10 steps
    assert len(r.step_losses) == 10
    assert "note: --steps 50 stops at the end of --epochs 1: 10 steps (10 an epoch)" in capsys.readouterr().err


def test_min_seconds_counts_the_steps_still_to_take_from_their_median():
    from types import SimpleNamespace

    from partrain.train import steps_to_fill

    rank0, rank1 = SimpleNamespace(rank=0, device=torch.device("cpu")), SimpleNamespace(rank=1, device=torch.device("cpu"))
    warm_and_steady = [1.0] * 5 + [0.01] * 20  # the first five left out, as the summary leaves them out
    assert steps_to_fill(warm_and_steady, 0.5, rank0) == 50 - 20
    assert steps_to_fill(warm_and_steady, 0.2, rank0) == 0  # 20 steps of 10 ms: enough
    assert steps_to_fill(warm_and_steady, 0.5, rank1) == 0  # rank 0 counts; the allreduce tells the others


def test_min_seconds_lengthens_a_run_of_steps_within_its_epoch(data_dir):
    short = train(data_dir, model="mlp", steps=8, limit=6400, batch_size=64, evaluate=False)
    longer = train(data_dir, model="mlp", steps=8, limit=6400, batch_size=64, evaluate=False, min_seconds=0.2)
    n = len(longer.step_losses)
    assert len(longer.step_seconds) == n and 8 < n <= 100 and longer.epochs[0].steps == n
    assert longer.step_losses[:8] == short.step_losses  # the same steps, then more of the same epoch
    steady = longer.step_seconds[min(5, n // 4):]
    # rank 0 sized the window from the median of its first steps: the whole window comes close
    assert n == 100 or len(steady) * sorted(steady)[len(steady) // 2] > 0.1
    capped = train(data_dir, model="mlp", steps=4, limit=640, batch_size=64, evaluate=False, min_seconds=60)
    assert len(capped.step_losses) == 10  # the epoch's end: no step of the next epoch


def test_min_seconds_needs_steps():
    with pytest.raises(PartrainError, match="--min-seconds lengthens a run of --steps"):
        RunConfig(min_seconds=1.0)
    with pytest.raises(PartrainError, match="--min-seconds"):
        RunConfig(steps=5, min_seconds=-1.0)


def test_batch_larger_than_the_data_is_refused(data_dir):
    with pytest.raises(PartrainError, match="exceeds the 100 training samples"):
        train(data_dir, limit=100, batch_size=128)


def test_check_finite_stops_a_loss_that_ends_as_no_number_and_names_since_when():
    from partrain.errors import Diverged
    from partrain.train import check_finite

    check_finite([2.3, float("inf"), 2.2], 0, 0.1)  # one overflowing step the fp16 scaler skipped: recovered
    check_finite([], 5, 0.1)
    with pytest.raises(Diverged, match=r"the loss is nan from step 14 on, .* lower --lr \(now 0.5\)$"):
        check_finite([2.3, float("nan"), 1.0, float("inf"), float("nan")], 10, 0.5)
    with pytest.raises(Diverged, match=r"lower --lr \(now 0.5\) or train in fp32 \(--precision fp32\)$"):
        check_finite([float("nan")], 0, 0.5, "fp16")
    assert Diverged("x").exit_status == 1  # the input was valid; the run failed


def test_a_diverging_run_stops_at_the_epochs_end_with_nothing_saved(data_dir, tmp_path):
    from partrain.errors import Diverged

    with pytest.raises(Diverged, match=r"the training diverged: the loss is nan from step \d+ on"):
        train(data_dir, model="mlp", lr=1e6, limit=640, batch_size=64, epochs=2, checkpoint=str(tmp_path / "ck"),
              save_model=str(tmp_path / "m.pt"))
    assert not (tmp_path / "m.pt").exists() and not list((tmp_path / "ck").glob("step-*"))


def test_events_record_forward_backward_optimizer(data_dir, tmp_path):
    train(data_dir, steps=3, limit=640, evaluate=False, events=str(tmp_path / "ev"))
    names = [e["name"] for e in read_events(tmp_path / "ev")]
    assert names.count("forward") == names.count("backward") == names.count("optimizer") == 3


def test_synthetic_data_trains_without_files(tmp_path):
    r = run_training(RunConfig(dataset="cifar10", synthetic=True, model="cnn", steps=20, batch_size=32, data_dir=str(tmp_path),
                               threads=2, eval_limit=64), show_progress=False)
    assert r.step_losses[-1] < r.step_losses[0]


@pytest.mark.slow
def test_mlp_mnist_reaches_97_5_percent_in_5_epochs(data_dir):
    r = train(data_dir, model="mlp", epochs=5)
    assert r.test_accuracy >= 0.975, r.epochs


@pytest.mark.slow
def test_cnn_mnist_reaches_97_5_percent_in_its_first_epoch(data_dir):
    """98.0% on the 2-vCPU VM; the reports' 98.8% takes three epochs (``benchmarks/accuracy.py``)."""
    r = train(data_dir, model="cnn", epochs=1)
    assert r.test_accuracy >= 0.975, r.epochs


@pytest.mark.slow
def test_mlp_ocr_letters_reaches_88_percent(data_dir):
    # the reports' Linear+Sigmoid network; validation accuracy wobbles by ~1% epoch to epoch
    r = train(data_dir, model="mlp", model_options={"activation": "sigmoid"}, dataset="ocr-letters",
              epochs=12, batch_size=32, lr=0.1)
    accuracies = [e.test_accuracy for e in r.epochs]
    assert max(accuracies) >= 0.88 and accuracies[-1] >= 0.86, accuracies


def _peak_mib(steps: int) -> int:
    """Peak RSS of a fresh `partrain train` of the zoo's gpt on generated tokens (batch 64)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "partrain", "train", "--model", "gpt", "--dataset", "tokens", "--synthetic",
         "--batch-size", "64", "--steps", str(steps), "--threads", "1", "--no-eval", "--json", "--quiet"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return json.loads(out.stdout)["peak_memory_bytes"] >> 20


def test_a_token_models_memory_does_not_grow_with_the_steps():
    """The losses the loop keeps for the epoch must not keep each step's memory: a token
    model's [n*T, V] step held about 2 MB a step at batch 64 (+180 MiB over 100 steps) when
    the loop kept the step's own loss tensor."""
    short, long = _peak_mib(4), _peak_mib(100)
    assert long - short < 80, f"peak RSS grew from {short} MiB (4 steps) to {long} MiB (100 steps)"


def test_an_error_inside_a_users_model_is_theirs_and_partrains_own_is_not():
    from partrain.models import build_model
    from partrain.models.registry import raised_by_model

    user = "tests.faulty:raises"
    model = build_model("tests.faulty:raises", (1, 28, 28), 10)
    try:
        model(torch.zeros(2, 1, 28, 28))
    except RuntimeError as err:
        line = str(raised_by_model(err, user, "training"))
    assert "'tests.faulty:raises' raised RuntimeError while training" in line and "faulty.py:" in line and "this model always fails" in line
    try:  # as the pipelining runtime wraps what a stage raised: "[Stage 1] failed to run forward", from it
        try:
            model(torch.zeros(2, 1, 28, 28))
        except RuntimeError as err:
            raise RuntimeError("\n   [Stage 1] failed to run forward:\n   args: ...") from err
    except RuntimeError as wrapped:
        assert str(raised_by_model(wrapped, user, "training")) == line  # told by its cause
    # the zoo's models are partrain's code: their errors keep the traceback
    assert raised_by_model(RuntimeError("x"), "mlp", "training") is None
    try:  # an error that never entered the user's code (partrain's, here) keeps its traceback too
        RunConfig(model="tests.faulty:raises", strategy="warp")
    except PartrainError as err:
        err.__traceback__ = err.__traceback__.tb_next  # from partrain's frame in: this test is in the user's package
        assert raised_by_model(err, user, "training") is None
    else:
        raise AssertionError("an unknown strategy was accepted")


def test_a_launched_worker_whose_peer_left_says_so_in_one_line():
    from partrain.distributed.launch import LaunchInfo
    from partrain.errors import PeerLeft
    from partrain.runner import left_behind

    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:14559")
    line = left_behind(gone, LaunchInfo("torchrun", rank=3, world_size=4, local_rank=1, local_world_size=2))
    assert isinstance(line, PeerLeft) and line.exit_status == 1
    assert str(line).startswith("worker rank 3 stopped: another worker left the job (Connection closed by peer)")
    # partrain's own workers: spawn names the worker that failed first, and a peer's traceback stays its own
    assert left_behind(gone, LaunchInfo("local", rank=1, world_size=2, local_rank=1, local_world_size=2)) is None
    assert left_behind(RuntimeError("a bug"), LaunchInfo("torchrun", rank=0, world_size=2, local_rank=0, local_world_size=2)) is None


def test_each_worker_draws_its_own_dropout_masks_after_the_shared_initial_weights():
    """Every worker seeds alike to build the same initial weights; then each draws from a stream
    of its own (a review: row j of every data-parallel replica's share got the same mask), none
    of them the initial weights' stream started again."""
    from partrain.train import worker_seed

    def masks(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return torch.nn.functional.dropout(torch.ones(64), 0.5)

    drawn = [masks(worker_seed(0, rank)) for rank in range(4)] + [masks(0)]
    assert len({tuple(m.tolist()) for m in drawn}) == 5
    assert worker_seed(0, 1) == worker_seed(0, 1) != worker_seed(1, 1)  # reproducible, and moved by --seed
    assert 0 <= worker_seed(2**62, 3) < 2**63

