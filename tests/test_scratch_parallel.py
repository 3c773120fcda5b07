"""partrain.scratch's hand-written parallelism against serial: the synchronous modes
reproduce serial's per-step losses to 1e-6 in float64; local SGD averages the weights."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from partrain.cli import main
from partrain.distributed.spawn import WorkerFailed
from partrain.scratch import ScratchConfig, run, run_many
from partrain.scratch.comm import run_workers

STEPS = 12


def _cfg(data_dir, **changes) -> ScratchConfig:
    base = dict(dataset="mnist", dtype="float64", steps=STEPS, limit=STEPS * 64, eval_limit=500,
                data_dir=str(data_dir), timeout_s=60)
    return ScratchConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def serial(data_dir):
    return run(_cfg(data_dir))


def _same_as_serial(result, serial) -> None:
    assert len(result.step_losses) == STEPS
    np.testing.assert_allclose(result.step_losses, serial.step_losses, rtol=0, atol=1e-6)
    assert result.test_accuracy == serial.test_accuracy
    assert result.epochs[-1].test_loss == pytest.approx(serial.epochs[-1].test_loss, rel=1e-9)


def test_serial_learns(serial):
    losses = serial.step_losses
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3])
    assert serial.test_accuracy > 0.5


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_reproduce_serial(data_dir, serial, threads):
    result = run(_cfg(data_dir, strategy="threads", threads=threads))
    _same_as_serial(result, serial)
    assert result.world_size == threads and set(result.phases_ms) >= {"compute", "reduce", "update"}


@pytest.mark.multiproc
@pytest.mark.timeout(240)  # a backstop: the workers give up on a silent peer before this
def test_two_processes_reproduce_serial_in_every_mode(data_dir, serial):
    """ddp, hybrid 2x2, model-parallel (2 stages, 4 micro-batches), local SGD averaging every
    step: all equal to serial; local SGD averaging every 4 steps learns but is not serial."""
    ddp, hybrid, pipeline, local1, local4 = run_many([
        _cfg(data_dir, strategy="ddp", workers=2),
        _cfg(data_dir, strategy="hybrid", workers=2, threads=2),
        _cfg(data_dir, strategy="model-parallel", workers=2, microbatches=4),
        _cfg(data_dir, strategy="local-sgd", workers=2, average_every=1),
        _cfg(data_dir, strategy="local-sgd", workers=2, average_every=4),
    ])
    for result in (ddp, hybrid, pipeline, local1):
        _same_as_serial(result, serial)
    assert ddp.processes == 2 and hybrid.world_size == 4 and pipeline.partition.startswith("stage 0: Linear(784, 256)")
    assert "comm" in ddp.phases_ms and len(ddp.phases_ms_per_rank) == 2
    assert np.abs(np.subtract(local4.step_losses, serial.step_losses)).max() > 1e-4  # independent between averages
    assert np.mean(local4.step_losses[-3:]) < 0.6 * np.mean(local4.step_losses[:3])
    assert local4.test_accuracy > 0.5


def _waits_for_a_dead_peer(comm):
    if comm.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    comm.allreduce_sum(np.zeros(3))  # rank 0 would wait here for ever, but spawn stops it


@pytest.mark.multiproc
@pytest.mark.timeout(240)  # a backstop: the workers give up on a silent peer before this
def test_a_dead_worker_stops_the_rest_at_once():
    start = time.monotonic()
    # whichever spawn sees first: rank 1's error, or rank 0's allreduce losing its peer; named by rank
    with pytest.raises(WorkerFailed, match=r"worker rank \d failed \(.*(rank 1 fails on purpose|[Cc]onnection|peer)"):
        run_workers(_waits_for_a_dead_peer, (), 2, timeout_s=120)
    assert time.monotonic() - start < 120  # stopped by spawn, not left waiting for gloo's timeout


def test_the_cli_runs_the_scratch_engine_and_prints_json(data_dir, capsys):
    code = main(["train", "--engine", "scratch", "--dataset", "ocr", "--strategy", "threads", "--workers", "2",
                 "--steps", "5", "--eval-limit", "200", "--data-dir", str(data_dir), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["engine"] == "scratch" and out["config"]["dataset"] == "ocr-letters"
    assert out["threads"] == 2 and len(out["step_losses"]) == 5 and out["parameters"] == 128 * 256 + 256 + 256 * 128 + 128 + 1290
    assert out["config"]["activation"] == "sigmoid"  # the OCR network is Linear + Sigmoid
    # the same report as the torch engine's: epochs from 1, the test loss beside the accuracy
    (epoch,) = out["epochs"]
    assert epoch["epoch"] == 1 and epoch["steps"] == 5 and 0 < epoch["test_loss"] < 10
    assert out["steps_per_epoch"] > 5  # an epoch's time is its steps times the median step (up to rounding)
    assert out["summary"]["seconds_per_epoch"] / out["summary"]["seconds_per_step"] == pytest.approx(out["steps_per_epoch"])
    assert out["summary"]["epoch_extrapolated"] is True  # 5 steps of an epoch
    main(["train", "--engine", "scratch", "--dataset", "ocr", "--steps", "3", "--no-eval", "--data-dir", str(data_dir)])
    line = capsys.readouterr().out
    assert line.startswith("mlp on ocr-letters, serial x1, final loss ") and "ms/step" in line and "compute" in line


@pytest.mark.parametrize("argv, message", [
    (["--model", "cnn"], "the scratch engine builds the mlp only"),
    (["--strategy", "fsdp"], "the scratch engine has no strategy 'fsdp'"),
    (["--strategy", "hybrid", "--workers", "2"], "hybrid is processes x threads"),
    (["--strategy", "ddp", "--workers", "2", "--microbatches", "100"], "--microbatches must be 1 to the batch size"),
    (["--checkpoint", "x"], "--checkpoint is an option of the torch engine"),
    (["--precision", "bf16"], "--precision is an option of the torch engine"),
])
def test_bad_options_are_one_line_and_exit_status_2(data_dir, capsys, argv, message):
    code = main(["train", "--engine", "scratch", "--data-dir", str(data_dir), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"partrain: error: {message}") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("parallel", [[], ["--strategy", "ddp", "--workers", "2"]])
def test_a_diverging_scratch_run_is_one_line_exit_status_1(data_dir, capsys, parallel):
    code = main(["train", "--engine", "scratch", "--lr", "1e5", "--steps", "10", *parallel,
                 "--data-dir", str(data_dir), "--quiet"])
    assert code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()  # NumPy's overflow warnings are not printed
    assert line.startswith("partrain: error: the training diverged: the loss is nan from step ")


def test_scratch_options_need_the_scratch_engine(capsys):
    assert main(["train", "--dtype", "float64"]) == 2
    assert "add --engine scratch" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "model-parallel"])
def test_events_cover_every_rank_and_draw_as_a_timeline(data_dir, tmp_path, strategy):
    from partrain.events import read_events, read_meta
    from partrain.scratch.local import breakdown

    events_dir = tmp_path / "events"
    run(_cfg(data_dir, strategy=strategy, workers=2, evaluate=False, events=str(events_dir)))
    events, meta = read_events(events_dir), read_meta(events_dir)
    assert sorted(meta) == [0, 1] and meta[0]["engine"] == "scratch" and meta[0]["scratch_config"]["strategy"] == strategy
    steps = {(e["rank"], e["step"]): e for e in events if e["name"] == "step"}
    assert sorted(steps) == [(rank, s) for rank in (0, 1) for s in range(STEPS)]
    for e in events:  # every phase inside its own step
        step = steps[e["rank"], e["step"]]
        assert step["start"] <= e["start"] <= e["end"] <= step["end"], e
    names = {e["name"] for e in events}
    if strategy == "ddp":
        assert {"data", "compute", "allreduce", "optimizer"} <= names
        assert {e["bytes"] for e in events if e["name"] == "allreduce"} == {(235_146 + 1) * 8}  # float64 + the loss
    else:  # each micro-batch's forward and backward on its stage
        assert {(e["rank"], e["stage"]) for e in events if e["name"] in ("forward", "backward")} == {(0, 0), (1, 1)}
        assert {"send", "recv", "reduce"} <= names
    parts = breakdown(events, skip=2)
    for rank in (0, 1):
        assert parts[rank]["compute"] > 0 and parts[rank]["communication"] > 0
        assert sum(v for k, v in parts[rank].items() if k != "step") <= parts[rank]["step"] * (1 + 1e-9)
    out = tmp_path / "trace.json"
    assert main(["trace", str(events_dir), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {"rank 0", "rank 1"}  # measured only: the predictor models the PyTorch engine
