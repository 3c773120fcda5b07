"""Multi-process gloo groups on 127.0.0.1: failure handling, multi-node launch, async strategies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from partrain.config import RunConfig
from partrain.distributed.launch import free_port
from partrain.distributed.spawn import WorkerFailed
from partrain.runner import run_training

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[1]


def test_a_dead_worker_fails_the_run_naming_its_rank(data_dir):
    cfg = RunConfig(model="tests.faulty:dies_on_rank1", strategy="ddp", workers=2, steps=10, data_dir=str(data_dir),
                    threads=1, evaluate=False, timeout_s=30)
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="worker rank 1 failed"):
        run_training(cfg, show_progress=False)
    assert time.monotonic() - start < 60  # the survivor is stopped, not left waiting on its peer


def test_a_worker_error_is_one_line_and_exit_status_2(data_dir, tmp_path):
    # bad input that only the workers can find (a batch larger than the training rows they load)
    proc = subprocess.run(
        [sys.executable, "-m", "partrain", "train", "--strategy", "ddp", "--workers", "2", "--limit", "100",
         "--batch-size", "128", "--data-dir", str(data_dir), "--steps", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()  # one line, whichever worker found it first
    assert line == "partrain: error: batch size 128 exceeds the 100 training samples: use a smaller --batch-size"


@pytest.mark.parametrize("strategy", ["ddp", "gpipe"])
def test_a_diverging_run_stops_every_worker_in_one_line_exit_status_1(data_dir, strategy):
    proc = subprocess.run(
        [sys.executable, "-m", "partrain", "train", "--strategy", strategy, "--workers", "2", "--model", "cnn",
         "--lr", "1e5", "--limit", "640", "--batch-size", "64", "--threads", "1", "--data-dir", str(data_dir), "--quiet"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("partrain: error: the training diverged: the loss is nan from step ")
    assert line.endswith("lower --lr (now 100000)")


@pytest.mark.parametrize("strategy", ["ddp", "1f1b"])
def test_min_seconds_lengthens_every_workers_run_alike(data_dir, strategy):
    # rank 0 counts the steps still to take and every rank learns its count: none is left
    # waiting on a collective of a step the others do not take (that would hang, then time out)
    cfg = RunConfig(strategy=strategy, workers=2, steps=6, min_seconds=0.3, limit=6400, batch_size=64, threads=1,
                    evaluate=False, data_dir=str(data_dir), timeout_s=60)
    r = run_training(cfg, show_progress=False)
    assert 6 < len(r.step_losses) <= 100 and len(r.step_seconds) == len(r.step_losses) == r.epochs[0].steps


def test_a_users_model_that_raises_in_a_pipeline_is_one_line_and_debug_shows_its_traceback(data_dir):
    # a micro-batch of one sample reaches BatchNorm1d on the first stage; the other stage, cut off
    # as it waits, fails too, and its "Connection closed by peer" would bury the line that matters
    train = ["train", "--model", "tests.userfactory:batchnorm", "--strategy", "gpipe", "--workers", "2",
             "--batch-size", "2", "--microbatches", "2", "--limit", "64", "--data-dir", str(data_dir), "--steps", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "partrain", *train], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("partrain: error: model 'tests.userfactory:batchnorm' raised ValueError while training "
                           "(in its BatchNorm1d): Expected more than 1 value per channel"), line
    proc = subprocess.run([sys.executable, "-m", "partrain", "--debug", *train], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "batchnorm.py" in proc.stderr  # the worker's, behind the line
    assert proc.stderr.strip().splitlines()[-1] == line


@pytest.mark.slow  # 15-25 s: torchrun starts its two workers
def test_under_torchrun_a_worker_left_behind_prints_one_line_not_a_traceback(data_dir):
    # the model raises on the first stage; the second, cut off in a collective, is a casualty
    train = ["train", "--model", "tests.userfactory:batchnorm", "--strategy", "gpipe", "--batch-size", "2",
             "--microbatches", "2", "--limit", "64", "--data-dir", str(data_dir), "--steps", "2", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "partrain", *train],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        timeout=180,
    )
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("partrain: error:")]
    assert lines[0].startswith("partrain: error: model 'tests.userfactory:batchnorm' raised ValueError"), proc.stderr[-3000:]
    # the casualty says so, unless torchrun stopped it first; its backend error is not printed
    assert lines[1:] in ([], ["partrain: error: worker rank 1 stopped: another worker left the job (Connection closed "
                              "by peer); the first worker to fail says why (--debug shows this one's traceback)"])
    assert "pair.cc" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr, proc.stderr[-3000:]


def _torchrun_nodes(data_dir, nproc: int, train_args: list[str]) -> list[subprocess.CompletedProcess]:
    """Two torchrun launchers, node ranks 0 and 1, meeting at a rendezvous on 127.0.0.1."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "partrain", "train", "--data-dir", str(data_dir), "--threads", "1", "--json", *train_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for node in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    for o in outs:
        assert o.returncode == 0, o.stderr[-2000:]
    return outs


def _serial_losses(data_dir, **kw):
    return run_training(RunConfig(data_dir=str(data_dir), threads=1, **kw), show_progress=False).step_losses


@pytest.mark.slow
@pytest.mark.parametrize("strategy,nproc,extra", [("ddp", 1, []), ("hybrid", 2, ["--pp", "2", "--dp", "2", "--microbatches", "2"])])
def test_two_nodes_under_torchrun(data_dir, strategy, nproc, extra):
    args = ["--strategy", strategy, "--steps", "10", "--no-eval", *extra]
    node0, node1 = _torchrun_nodes(data_dir, nproc, args)
    result = json.loads(node0.stdout.strip().splitlines()[-1])  # rank 0 lives on node 0 and reports
    assert result["world_size"] == 2 * nproc and node1.stdout.strip() == ""
    reference = _serial_losses(data_dir, steps=10, evaluate=False)
    assert result["step_losses"] == pytest.approx(reference, rel=1e-4)


@pytest.mark.slow
def test_local_sgd_averaged_once_an_epoch_reaches_97_percent(data_dir):
    r = run_training(RunConfig(strategy="local-sgd", workers=2, average_every="epoch", epochs=5, data_dir=str(data_dir)),
                     show_progress=False)
    assert r.test_accuracy >= 0.97, [e.test_accuracy for e in r.epochs]


@pytest.mark.slow
def test_hogwild_two_workers_reaches_97_percent(data_dir):
    r = run_training(RunConfig(strategy="hogwild", workers=2, epochs=5, data_dir=str(data_dir)), show_progress=False)
    # lock-free updates race, so an epoch's accuracy moves by tenths between runs: it reaches 97%
    # in some epoch and stays near it (clean-clone CI at f764b32: 96.26, 97.24, 97.13, 97.49, 96.99%)
    accuracies = [e.test_accuracy for e in r.epochs]
    assert max(accuracies) >= 0.97 and r.test_accuracy >= 0.965, accuracies


def test_events_trace_micro_batches_and_allreduce(data_dir, tmp_path):
    from partrain.events import read_events

    base = dict(model="mlp", steps=3, evaluate=False, data_dir=str(data_dir), threads=1)
    # with an evaluation after training, whose micro-batches are not training's (they were recorded as such)
    run_training(RunConfig(strategy="1f1b", workers=2, microbatches=4, events=str(tmp_path / "pp"),
                           **{**base, "evaluate": True, "eval_limit": 64}), show_progress=False)
    events = read_events(tmp_path / "pp")
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        assert sorted(e["mb"] for e in mine if e["name"] == "forward") == sorted(list(range(4)) * 3)
        assert sum(e["name"] == "backward" for e in mine) == 12 and sum(e["name"] == "optimizer" for e in mine) == 3
        assert all(e["end"] >= e["start"] for e in mine)
    run_training(RunConfig(strategy="ddp", workers=2, bucket_mb=0.25, events=str(tmp_path / "dp"), **base), show_progress=False)
    allreduces = [e for e in read_events(tmp_path / "dp") if e["name"] == "allreduce"]
    # every step, each rank allreduces all 235,146 float32 gradients, in one bucket or several
    assert sum(e["bytes"] for e in allreduces) == 3 * 2 * 235_146 * 4


def rank_states(ckpt: Path) -> list[dict]:
    """Each rank's model state in the newest set of checkpoint ``ckpt``, rank 0 first."""
    newest = ckpt / (ckpt / "LATEST").read_text()
    return [torch.load(newest / f"rank{r}.pt", weights_only=True)["model"] for r in range(len(list(newest.glob("rank*.pt"))))]


def assert_one_model(states: list[dict], only: tuple[str, ...] = ("",)) -> None:
    """Every rank's entries whose key holds one of ``only`` (all, by default: parameters and
    buffers, integers such as num_batches_tracked too) are equal."""
    first, *others = states
    for other in others:
        assert other.keys() == first.keys()
        for key, value in first.items():
            if any(part in key for part in only):
                assert torch.equal(other[key], value), f"{key} differs between the replicas"


def score_saved_model(cfg: RunConfig) -> tuple[float, float]:
    """Test loss and accuracy of ``cfg.save_model``'s file, scored here by that one model on
    the run's test rows: what the run's own evaluation must report if it scored one model."""
    from partrain.data import load_dataset
    from partrain.data.feed import Feed
    from partrain.events import EventLog
    from partrain.model_file import load
    from partrain.strategies import Stepper
    from partrain.train import evaluate

    net = load(cfg.save_model).build()
    test = load_dataset(cfg.dataset, "test", limit=cfg.eval_limit, data_dir=cfg.data_dir, synthetic=cfg.synthetic, seed=cfg.seed)
    stepper = Stepper(net, torch.optim.SGD(net.parameters()), slice(None), EventLog(None, 0))
    return evaluate(stepper, Feed(test, torch.device("cpu")), cfg.batch_size, torch.device("cpu"))


LOCAL_SGD = dict(model="mlp", strategy="local-sgd", workers=2, batch_size=64, threads=1, timeout_s=60)


@pytest.mark.parametrize("limit", [256, 320])  # 4 steps an epoch: a checkpoint on an averaging step; 5: off one
def test_resume_of_local_sgd_averages_at_the_straight_runs_steps(data_dir, tmp_path, limit):
    # K=3 averages after steps 1, 4, 7, ...: the averager counted from 0 again on resume, averaging
    # after steps 5 and 8 instead (losses of steps 6-8 differed, an audit found). Without an evaluation
    # the straight run writes no checkpoint: its epoch's end averages all the same
    kw = dict(LOCAL_SGD, average_every=3, limit=limit, evaluate=False, data_dir=str(data_dir))
    straight = run_training(RunConfig(epochs=2, **kw), show_progress=False)
    ckpt = tmp_path / "ckpt"
    run_training(RunConfig(epochs=1, checkpoint=str(ckpt), **kw), show_progress=False)
    resumed = run_training(RunConfig(epochs=2, resume=str(ckpt), **kw), show_progress=False)
    assert len(resumed.step_losses) == 2 * limit // 64
    assert resumed.step_losses == straight.step_losses


@pytest.mark.parametrize("every,steps", [("epoch", 3), (3, 2)])  # never averaged; the last step not an averaging one
def test_local_sgd_ending_between_averagings_evaluates_checkpoints_and_saves_one_model(data_dir, tmp_path, every, steps):
    cfg = RunConfig(**LOCAL_SGD, average_every=every, steps=steps, limit=640, eval_limit=256, data_dir=str(data_dir),
                    checkpoint=str(tmp_path / "ckpt"), save_model=str(tmp_path / "model.pt"))
    result = run_training(cfg, show_progress=False)
    replicas = rank_states(tmp_path / "ckpt")
    assert_one_model(replicas)  # each replica's own weights, before: they differed from step 2 on
    saved = torch.load(cfg.save_model, weights_only=True)["state_dict"]
    assert_one_model([saved, replicas[0]])
    loss, accuracy = score_saved_model(cfg)  # each rank scored its rows with its own replica, before
    assert result.epochs[-1].test_loss == pytest.approx(loss, rel=1e-6)
    assert result.epochs[-1].test_accuracy == accuracy
