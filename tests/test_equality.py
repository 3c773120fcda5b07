"""The reports' correctness check: synchronous strategies reproduce the serial run.

Same seed, same global batch, a model without BatchNorm: every per-step loss of 20 steps
within a relative 1e-4 of serial, and the final parameters close. Each case spawns a real
multi-process gloo group on 127.0.0.1 (through ``run_training``, as the CLI does).
"""

from __future__ import annotations

import pytest
import torch

from partrain.config import RunConfig
from partrain.runner import run_training

pytestmark = pytest.mark.multiproc

STEPS = 20


def _run(tmp_path, data_dir, name: str, **overrides) -> tuple[list[float], dict]:
    model_file = tmp_path / f"{name}.pt"
    base = dict(dataset="mnist", data_dir=str(data_dir) if data_dir else None, steps=STEPS, batch_size=64, evaluate=False,
                threads=1, timeout_s=60, save_model=str(model_file))
    result = run_training(RunConfig(**{**base, **overrides}), show_progress=False)
    return result.step_losses, torch.load(model_file, weights_only=True)["state_dict"]


def _assert_same(run, reference):
    (losses, state), (ref_losses, ref_state) = run, reference
    assert len(losses) == len(ref_losses) == STEPS
    rel = torch.tensor(losses).sub(torch.tensor(ref_losses)).abs().div(torch.tensor(ref_losses).abs())
    assert rel.max().item() <= 1e-4, f"per-step losses differ from serial: max relative difference {rel.max().item():.2e}"
    assert ref_losses[-1] < ref_losses[0]  # and the run did learn something
    assert state.keys() == ref_state.keys()
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key], ref, rtol=1e-4, atol=1e-5, msg=f"final parameter {key} differs")


CASES = [
    ("ddp", dict(strategy="ddp", workers=2)),
    ("fsdp", dict(strategy="fsdp", workers=2)),
    ("model-parallel", dict(strategy="model-parallel", workers=2)),
    ("gpipe", dict(strategy="gpipe", workers=2, microbatches=4)),
    ("1f1b", dict(strategy="1f1b", workers=2, microbatches=4)),
    ("hybrid-2x1", dict(strategy="hybrid", workers=2, pp=2, dp=1)),
    ("hybrid-1x2", dict(strategy="hybrid", workers=2, pp=1, dp=2)),
]


@pytest.fixture(scope="module")
def serial_mlp(tmp_path_factory, data_dir):
    return _run(tmp_path_factory.mktemp("serial"), data_dir, "serial", model="mlp")


@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_mlp_equals_serial(tmp_path, data_dir, serial_mlp, name, overrides):
    _assert_same(_run(tmp_path, data_dir, name, model="mlp", **overrides), serial_mlp)


def test_local_sgd_k1_plain_sgd_equals_serial(tmp_path, data_dir):
    # averaging replicas after every plain-SGD step is the serial step (momentum is per replica)
    serial = _run(tmp_path, data_dir, "serial", model="mlp", momentum=0.0)
    local = _run(tmp_path, data_dir, "local", model="mlp", momentum=0.0, strategy="local-sgd", workers=2, average_every=1)
    _assert_same(local, serial)


@pytest.mark.slow
def test_hybrid_2x2_four_processes_equals_serial(tmp_path, data_dir, serial_mlp):
    _assert_same(_run(tmp_path, data_dir, "hybrid22", model="mlp", strategy="hybrid", workers=4, pp=2, dp=2, microbatches=2), serial_mlp)


@pytest.fixture(scope="module")
def serial_cnn(tmp_path_factory, data_dir):
    return _run(tmp_path_factory.mktemp("serial_cnn"), data_dir, "serial", model="cnn")


CNN_ONLY = [  # cases that need more blocks than the mlp's three
    ("interleaved-1f1b", dict(strategy="1f1b", workers=2, schedule="interleaved-1f1b", stages_per_worker=2, microbatches=4)),
    ("gpipe-recompute", dict(strategy="gpipe", workers=2, microbatches=4, recompute=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", CASES + CNN_ONLY, ids=[c[0] for c in CASES + CNN_ONLY])
def test_cnn_equals_serial(tmp_path, data_dir, serial_cnn, name, overrides):
    _assert_same(_run(tmp_path, data_dir, name, model="cnn", **overrides), serial_cnn)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "local-sgd", "model-parallel", "gpipe", "1f1b", "hybrid", "hogwild"])
def test_every_strategy_on_one_worker_equals_serial(tmp_path, data_dir, serial_mlp, strategy):
    # a world of one still builds its process group and mesh: the 1-worker point of a scaling study
    _assert_same(_run(tmp_path, data_dir, strategy, model="mlp", strategy=strategy, workers=1), serial_mlp)


@pytest.fixture(scope="module")
def serial_gpt(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("serial_gpt"), None, "serial", **GPT)


GPT = dict(model="gpt", dataset="tokens@16", model_options=dict(layers=2, d_model=32, heads=4), lr=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_gpt_equals_serial(tmp_path, serial_gpt, name, overrides):
    # token ids in, [n, T, vocab] logits out, per-token cross-entropy; generated tokens, no files
    _assert_same(_run(tmp_path, None, name, **GPT, **overrides), serial_gpt)


def test_a_module_that_draws_random_numbers_as_it_is_imported_still_equals_serial(tmp_path, data_dir):
    """Serial imports the module in the launcher's check, ddp's workers first in the loop: the
    draw must come before the seed in both, or the two start from different weights."""
    model = "tests.import_draws:build"
    serial = _run(tmp_path, data_dir, "serial", model=model)
    _assert_same(_run(tmp_path, data_dir, "ddp", model=model, strategy="ddp", workers=2), serial)
