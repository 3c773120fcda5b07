"""partrain sweep: the space, the train hook it prunes through, resuming a killed sweep, the plan."""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partrain.cli import build_parser, config_from_args, main
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict.cluster import load_cluster
from partrain.profile.cache import load_or_profile
from partrain.runner import run_training
from partrain.sweep.plan import plan_sweep, profile_sizes, sample_configs
from partrain.sweep.space import (
    check_divisible,
    parse_dimension,
    parse_space,
    train_command,
    trial_config,
)
from partrain.sweep.storage import open_study, storage_url
from partrain.sweep.study import EpochReporter, SweepSettings

optuna = pytest.importorskip("optuna")
REPO = Path(__file__).resolve().parents[1]
TINY = ["--limit", "256", "--eval-limit", "128"]


# ---- the space -------------------------------------------------------------------------------


def test_ranges_choices_and_grids():
    lr = parse_dimension("lr=1e-3..1e-1:log")
    assert (lr.low, lr.high, lr.log, lr.integer) == (1e-3, 1e-1, True, False)
    assert lr.grid(3) == pytest.approx([1e-3, 1e-2, 1e-1])
    depth = parse_dimension("depth")  # a bare name takes its default range
    assert depth.integer and depth.grid(3) == [1, 2, 3]
    batch = parse_dimension("batch-size=32,64")
    assert batch.name == "batch_size" and batch.choices == (32, 64) and batch.grid(5) == [32, 64]
    assert parse_dimension("optimizer=sgd,adam").choices == ("sgd", "adam")


@pytest.mark.parametrize("entry, message", [
    ("colour=red", "cannot search 'colour'"),
    ("lr=0.1..0.01", "LOW < HIGH"),
    ("lr=0..1:log", "LOW > 0"),
    ("momentum=0.5,1.2", "[0, 1)"),
    ("optimizer=sgd,rmsprop", "'rmsprop' is not one of"),
    ("batch_size=32,6.5", "positive integers"),
    ("lr=0,0.1", "a learning rate of 0 trains nothing"),  # failed trial by trial, before
    ("lr=nan,0.1", "is not a finite number"),
    ("lr=1e-3..inf:log", "is not a finite number"),  # a traceback from the sampler, and a study file left
])
def test_a_bad_space_is_one_clear_error(entry, message):
    with pytest.raises(PartrainError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_dimension(entry)


def test_shape_options_only_for_the_mlp_and_batches_must_split_over_k():
    assert [d.name for d in parse_space(None, "mlp")] == ["lr", "batch_size", "momentum", "epochs", "width", "depth"]
    assert "width" not in [d.name for d in parse_space(None, "cnn")]
    with pytest.raises(PartrainError, match="does not take them"):
        parse_space(["width"], "cnn")
    with pytest.raises(PartrainError, match="batch size 30 does not split over --per-trial 4"):
        check_divisible(parse_space(["batch_size=32,30"], "mlp"), RunConfig(), 4)


def test_the_printed_command_parses_back_to_the_trial_config():
    base = RunConfig(limit=256, eval_limit=128, threads=1, strategy="ddp", workers=2, data_dir="/d")
    cfg = trial_config(base, {"lr": 0.0123456789, "batch_size": 32, "epochs": 2, "width": 48, "depth": 3,
                              "optimizer": "adam", "momentum": 0.7})
    assert cfg.model_options["hidden"] == [48, 48, 48]
    argv = shlex.split(train_command(cfg))
    assert argv[:2] == ["partrain", "train"]
    parsed = config_from_args(build_parser().parse_args(argv[1:]))
    assert parsed == cfg  # every value, the float lr to the last digit


# ---- the hook the sweep prunes through ---------------------------------------------------------


class StopAfter:
    """An on_epoch hook (module level: spawned workers unpickle it)."""

    def __init__(self, epochs: int):
        self.epochs = epochs

    def __call__(self, ep) -> bool:
        return ep.epoch >= self.epochs


@pytest.mark.parametrize("strategy, workers", [("serial", 1), pytest.param("ddp", 2, marks=pytest.mark.multiproc)])
def test_on_epoch_hook_stops_every_rank_after_the_epoch_it_says(data_dir, strategy, workers):
    cfg = RunConfig(data_dir=str(data_dir), epochs=3, limit=128, eval_limit=64, batch_size=32, strategy=strategy,
                    workers=workers, threads=1, timeout_s=60)
    result = run_training(cfg, show_progress=False, on_epoch=StopAfter(2))
    assert result.stopped_early and [e.epoch for e in result.epochs] == [1, 2]
    assert len(result.step_losses) == 2 * 128 // 32 and result.epochs[-1].test_accuracy is not None
    full = run_training(cfg, show_progress=False, on_epoch=StopAfter(5))
    assert not full.stopped_early and len(full.epochs) == 3


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_the_reporter_prunes_a_trial_below_the_median_even_unpickled(tmp_path):
    settings = SweepSettings(storage_url(str(tmp_path / "s.db"), "s"), "s", 8, parse_space(["lr"], "mlp"), RunConfig())
    study = open_study(settings, create=True)
    for acc in (0.90, 0.91, 0.92, 0.93):  # four finished trials: the pruner's start-up
        trial = study.ask()
        trial.report(acc, 1)
        study.tell(trial, acc)
    good, bad = study.ask(), study.ask()
    from partrain.train import EpochResult

    epoch = lambda acc: EpochResult(1, 10, 0.5, 1.0, 100.0, 0.3, acc)  # noqa: E731
    assert pickle.loads(pickle.dumps(EpochReporter(settings, bad._trial_id, bad)))(epoch(0.10)) is True
    assert EpochReporter(settings, good._trial_id, good)(epoch(0.95)) is False
    assert study.trials[bad.number].intermediate_values == {1: 0.10}
    last = study.ask()  # at its last epoch a trial is complete, however it did
    assert EpochReporter(settings, last._trial_id, last, epochs=1)(epoch(0.10)) is False


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_trial_failed_by_ctrl_c_is_queued_again_once_and_an_error_is_a_verdict(tmp_path):
    from partrain.sweep.study import counts, reclaim_interrupted

    settings = SweepSettings(storage_url(str(tmp_path / "s.db"), "s"), "s", 8, parse_space(["lr"], "mlp"), RunConfig())
    study = open_study(settings, create=True)
    interrupted, broken = study.ask(), study.ask()
    for trial in (interrupted, broken):
        trial.suggest_float("lr", 1e-3, 0.3, log=True)
    broken.set_user_attr("error", "batch size 64 exceeds the 10 training samples")
    for trial in (interrupted, broken):
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert counts(study) == (1, 0)  # the error is a verdict, the interruption is not
    assert reclaim_interrupted(study, failed_too=True) == 1
    assert reclaim_interrupted(study, failed_too=True) == 0  # queued once, not at every start
    waiting = [t for t in study.trials if t.state.name == "WAITING"]
    assert len(waiting) == 1 and waiting[0].params == interrupted.params


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_trial_killed_before_it_named_its_slot_is_reclaimed_after_the_grace_period(tmp_path, monkeypatch):
    """Killed between Optuna's ask and the objective's first line, a trial has no pid and no
    heartbeat: without this the slots of the next run would wait on it for ever."""
    import socket

    from partrain.sweep import study as study_module

    settings = SweepSettings(storage_url(str(tmp_path / "s.db"), "s"), "s", 8, parse_space(["lr"], "mlp"), RunConfig())
    study = open_study(settings, create=True)
    orphan, live = study.ask(), study.ask()
    live.set_user_attr("host", socket.gethostname())
    live.set_user_attr("pid", os.getpid())  # this process: alive
    assert study_module.reclaim_interrupted(study) == 0  # young: its slot may be naming itself now
    monkeypatch.setattr(study_module, "GRACE_S", 0.05)
    time.sleep(0.1)
    assert study_module.reclaim_interrupted(study) == 1
    states = {t.number: t.state.name for t in study.trials}
    assert states[orphan.number] == "FAIL" and states[live.number] == "RUNNING"
    assert [t.state.name for t in study.trials[2:]] == ["WAITING"]  # queued again, once
    assert study_module.reclaim_interrupted(study) == 0


# ---- end to end --------------------------------------------------------------------------------


def _sweep(tmp_path, data_dir, *extra) -> list[str]:
    return ["sweep", "--data-dir", str(data_dir), "--storage", str(tmp_path / "sweep.db"), "--plot",
            str(tmp_path / "sweep.png"), *TINY, *extra]


def test_a_sweep_reports_its_trials_and_the_best_command_reproduces_the_best_accuracy(tmp_path, data_dir, capsys):
    argv = _sweep(tmp_path, data_dir, "--trials", "3", "--sampler", "random",
                  "--space", "lr=0.01..0.2:log", "batch_size=32,64", "epochs=1..2", "width=16,32", "depth=1")
    assert main(argv) == 0
    out = capsys.readouterr().out
    study = optuna.load_study(study_name="partrain-sweep", storage=storage_url(str(tmp_path / "sweep.db"), "x"))
    states = [t.state.name for t in study.trials]
    assert len(states) == 3 and set(states) <= {"COMPLETE", "PRUNED"}
    assert "3 complete" in out or "pruned" in out
    best = max((t for t in study.trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert f"best: trial {best.number}, test accuracy {best.value:.2%}" in out
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("partrain train"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    # the command, run as printed, trains to the same accuracy
    assert main([*shlex.split(command)[1:], "--json", "--quiet"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["summary"]["test_accuracy"] == pytest.approx(best.value, abs=1e-9)
    # run again: all 3 are finished, nothing more is trained
    assert main(argv) == 0
    assert len(optuna.load_study(study_name="partrain-sweep", storage=study._storage).trials) == 3


def test_grid_sweep_visits_each_point_once_and_refuses_more_trials_than_points(tmp_path, data_dir, capsys):
    base = _sweep(tmp_path, data_dir, "--sampler", "grid", "--no-prune", "--space", "lr=0.01,0.05", "batch_size=32,64")
    assert main([*base, "--trials", "5"]) == 2
    assert "the grid has 4 points, fewer than --trials 5" in capsys.readouterr().err
    assert main([*base, "--trials", "4", "--workers", "2"]) == 0
    study = optuna.load_study(study_name="partrain-sweep", storage=storage_url(str(tmp_path / "sweep.db"), "x"))
    points = sorted((t.params["lr"], t.params["batch_size"]) for t in study.trials if t.state.name == "COMPLETE")
    assert points == [(0.01, 32), (0.01, 64), (0.05, 32), (0.05, 64)]


def test_a_diverged_trial_fails_with_its_reason_and_a_sweep_with_none_complete_exits_1(tmp_path, data_dir, capsys):
    base = _sweep(tmp_path, data_dir, "--sampler", "grid", "--no-prune")
    assert main([*base, "--trials", "2", "--space", "lr=1e5,1e6"]) == 1
    captured = capsys.readouterr()
    assert "no trial of the 2 completed; the table gives each one's reason" in captured.err
    assert captured.out.count("the training diverged: the loss is nan from step") == 2
    study = optuna.load_study(study_name="partrain-sweep", storage=storage_url(str(tmp_path / "sweep.db"), "x"))
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]


def test_a_surplus_trial_is_bookkeeping_and_left_out_of_the_table():
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from partrain.sweep.report import trial_rows

    study = optuna.create_study(direction="maximize")
    lr = {"lr": FloatDistribution(0.01, 0.1)}
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.9, params={"lr": 0.05}, distributions=lr))
    study.add_trial(create_trial(state=TrialState.FAIL, params={"lr": 0.02}, distributions=lr, user_attrs={"surplus": True}))
    study.add_trial(create_trial(state=TrialState.FAIL, params={"lr": 0.03}, distributions=lr, user_attrs={"error": "bad"}))
    assert [(r["number"], r["state"], r["note"]) for r in trial_rows(study)] == [(0, "COMPLETE", ""), (2, "FAIL", "bad")]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--per-trial", "3"], "--per-trial 3 does not divide --workers 2"),
    (["--workers", "2", "--per-trial", "2", "--space", "batch_size=32,33"], "batch size 33 does not split"),
    (["--trials", "0"], "--trials must be at least 1"),
    (["--space", "lr", "--model", "nonesuch"], "unknown model 'nonesuch'"),
    (["--storage", "nosuchdb://host/x"], "cannot open the study storage nosuchdb://host/x"),
])
def test_bad_sweep_input_is_one_line_and_exit_2(tmp_path, data_dir, capsys, argv, message):
    assert main(_sweep(tmp_path, data_dir, *argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("partrain: error:") and message in err and len(err.splitlines()) == 1


def test_a_resumed_sweep_with_another_space_is_refused(tmp_path, data_dir, capsys):
    assert main(_sweep(tmp_path, data_dir, "--trials", "1", "--space", "lr=0.01..0.1")) == 0
    assert main(_sweep(tmp_path, data_dir, "--trials", "2", "--space", "lr=0.01..0.2")) == 2
    assert "resume it with the same --space" in capsys.readouterr().err


def test_a_resumed_sweep_with_other_fixed_options_is_refused_naming_them(tmp_path, data_dir, capsys):
    """Trials run with another --limit, --optimizer or --seed were pooled and ranked together."""
    argv = _sweep(tmp_path, data_dir, "--trials", "2", "--sampler", "grid", "--space", "lr=0.01,0.1")
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--limit", "512", "--optimizer", "adam", "--seed", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("partrain: error:") and len(err.splitlines()) == 1
    assert ("ran its trials with --limit 256, --optimizer sgd, --seed 0, not --limit 512, --optimizer adam, --seed 7: "
            "resume it with the stored options, or name a new --study") in err
    assert main([*argv, "--no-eval", "--hidden", "32"]) == 2
    assert "ran its trials with no --no-eval, no --hidden, not --no-eval, --hidden 32" in capsys.readouterr().err
    # what changes no trial's result may change: the threads, and --lr when lr is searched
    assert main([*argv, "--threads", "2", "--lr", "0.5"]) == 0


def test_reproduce_prints_the_command_the_best_trial_ran_not_one_from_this_run(tmp_path, data_dir, capsys):
    import json

    argv = _sweep(tmp_path, data_dir, "--trials", "1", "--sampler", "grid", "--space", "lr=0.01,0.1", "--threads", "1")
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--threads", "2", "--json", "--quiet"]) == 0  # a resume on another machine, say
    command = json.loads(capsys.readouterr().out)["best"]["command"]
    study = optuna.load_study(study_name="partrain-sweep", storage=storage_url(str(tmp_path / "sweep.db"), "x"))
    assert command == study.trials[0].user_attrs["command"]
    assert "--threads 1" in command and "--limit 256" in command


def test_a_study_made_before_the_fixed_options_were_stored_resumes_and_stores_them(tmp_path, data_dir, capsys):
    import sqlite3

    argv = _sweep(tmp_path, data_dir, "--trials", "1", "--sampler", "grid", "--space", "lr=0.01,0.1")
    assert main(argv) == 0
    with sqlite3.connect(tmp_path / "sweep.db") as db:  # as a study of the earlier partrain has it
        db.execute("DELETE FROM study_user_attributes WHERE key = 'partrain_fixed'")
    assert main([*argv, "--trials", "2", "--seed", "3"]) == 0
    study = optuna.load_study(study_name="partrain-sweep", storage=storage_url(str(tmp_path / "sweep.db"), "x"))
    assert study.user_attrs["partrain_fixed"]["seed"] == 3  # checked from now on
    capsys.readouterr()
    assert main([*argv, "--trials", "2"]) == 2
    assert "--seed 3, not --seed 0" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c", "slots-only"])
def test_an_interrupted_sweep_of_ddp_trials_leaves_nothing_in_tmpdir_and_exits_130(tmp_path, data_dir, how):
    """The slots were SIGKILLed, so each running trial's spawn left its partrain-* folder. And
    slots interrupted before the sweep itself (here: only they are told) are an interrupted
    sweep too, not "2 sweep slot(s) failed (exit 130)", exit 2 (clean-clone CI once)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "partrain", *_sweep(tmp_path, data_dir, "--trials", "2", "--workers", "4",
            "--per-trial", "2", "--sampler", "grid", "--no-prune", "--space", "lr=0.01,0.1", "--epochs", "30",
            "--limit", "12800", "--threads", "1", "--quiet")]  # trials of minutes: still running when interrupted
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TMPDIR": str(tmp)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp.glob("partrain-*"))) < 2:  # both slots' trials are starting their workers
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the two trials never started"
            time.sleep(0.2)
        time.sleep(1.0)  # past the workers' start: the trials run
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)  # the sweep only
        elif how == "slots-only":
            for slot in _slots_of(proc.pid):
                os.kill(slot, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "partrain: interrupted", err
    assert not list(tmp.glob("partrain-*"))


def _slots_of(pid: int) -> list[int]:
    """The sweep's slot processes: its children that multiprocessing spawned (not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children
            if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.multiproc
def test_a_killed_sweep_resumes_reruns_the_interrupted_and_counts_nothing_twice(tmp_path, data_dir):
    """SIGKILL the sweep while trials run; run it again: exactly N complete, each drawn set once."""
    trials = 6
    argv = [sys.executable, "-m", "partrain", *_sweep(tmp_path, data_dir, "--trials", str(trials), "--workers", "2",
            "--sampler", "random", "--no-prune", "--limit", "4096", "--space", "lr=0.01..0.1:log", "epochs=2..4")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = storage_url(str(tmp_path / "sweep.db"), "x")
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:  # wait until one trial finished and others are mid-way
            time.sleep(0.5)
            # the sweep and its slots stopped while the storage is read: what it says then is what
            # the kill leaves (a trial read running and killed a moment later had finished in
            # between under load, leaving none mid-way, in a run of two tests at a time)
            os.killpg(proc.pid, signal.SIGSTOP)
            try:
                states = [t.state.name for t in optuna.load_study(study_name="partrain-sweep", storage=url).trials]
            except Exception:  # noqa: BLE001 - the study may not exist yet, or a stopped slot holds its lock
                states = []
            if states.count("COMPLETE") >= 1 and states.count("RUNNING") >= 1:
                proc.send_signal(signal.SIGKILL)  # the sweep only: its slots die with it (PR_SET_PDEATHSIG)
                with contextlib.suppress(ProcessLookupError):  # what is left of the group acts on its signals
                    os.killpg(proc.pid, signal.SIGCONT)
                break
            os.killpg(proc.pid, signal.SIGCONT)
        else:
            pytest.fail("the sweep never had a finished and a running trial at once")
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1.0)
    killed = optuna.load_study(study_name="partrain-sweep", storage=url).trials
    interrupted = [t for t in killed if t.state.name == "RUNNING"]
    assert interrupted, "the kill left no trial mid-way"
    finished_before = {t.number: t.params for t in killed if t.state.name == "COMPLETE"}

    rerun = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    after = optuna.load_study(study_name="partrain-sweep", storage=url).trials
    complete = [t for t in after if t.state.name == "COMPLETE"]
    assert len(complete) == trials  # N finished in all, not N more
    params = [tuple(sorted(t.params.items())) for t in complete]
    assert len(set(params)) == len(params)  # no parameter set counted twice
    assert all(after[n].state.name == "COMPLETE" for n in finished_before)  # finished ones kept, not rerun
    for t in interrupted:  # each interrupted trial failed and its parameters ran again, once
        assert after[t.number].state.name == "FAIL"
        # a trial killed before it drew its values has none to run again; one killed between two
        # draws (lr drawn, epochs not: clean-clone CI once) runs again with the ones it drew
        if t.params:
            assert sum(set(t.params.items()) <= set(p) for p in params) == 1
    assert "interrupted; run again as #" in rerun.stdout


# ---- the plan ----------------------------------------------------------------------------------

CLUSTER = """
[cluster]
name = "fake"
nodes = 1
workers_per_node = 4
device_memory_gb = 16
shared_memory = true
compute_speed = 1.0
cores_per_node = 4
backend = "gloo"

[intra]
bandwidth_gb_per_s = {bandwidth}
latency_us = 5
"""


@pytest.fixture(scope="module")
def sweep_configs():
    base = RunConfig(threads=1)
    dims = parse_space(["lr", "batch_size=256,512", "epochs=1..2"], "mlp")  # big batches: a step worth splitting
    return base, sample_configs(dims, base, "grid", 3)


@pytest.fixture(scope="module")
def profile(tmp_path_factory, data_dir, sweep_configs):
    return load_or_profile("mlp", "mnist", profile_sizes(sweep_configs[1], 4), 1, tmp_path_factory.mktemp("p"), data_dir)[0]


def heavy(profile, factor: float = 1000.0):
    """The measured profile with forward and backward made ``factor`` times slower: a model whose
    steps are all compute, so splitting one over k workers nearly divides it by k. The timed
    training loop (``loop_s``, what serial and DDP steps are predicted from) slows by the same
    seconds, or the loop would absorb the change and only the evaluation would grow."""
    import dataclasses

    blocks = [dataclasses.replace(b, fwd_s=[t * factor for t in b.fwd_s], bwd_s=[t * factor for t in b.bwd_s])
              for b in profile.blocks]
    compute = [sum(b.fwd_s[i] + b.bwd_s[i] for b in profile.blocks) for i in range(len(profile.batch_sizes))]
    loop_s = [t + (factor - 1) * c for t, c in zip(profile.loop_s, compute)]
    return dataclasses.replace(profile, blocks=blocks, loop_s=loop_s)


@pytest.mark.alone  # its fixture profiles the mlp: never beside another test (make test)
@pytest.mark.parametrize("trials, bandwidth, best_k", [(24, 0.05, 1), (1, 1000.0, 4)])
def test_the_plan_picks_side_by_side_for_many_trials_and_splitting_for_too_few(tmp_path, profile, sweep_configs,
                                                                                trials, bandwidth, best_k):
    base, configs = sweep_configs
    assert len(configs) == 3 * 2 * 2  # the whole grid is averaged
    (tmp_path / "c.toml").write_text(CLUSTER.format(bandwidth=bandwidth))
    hw = load_cluster(tmp_path / "c.toml")
    if trials == 1:  # one trial cannot use 4 workers side by side: only splitting it helps, if compute dominates
        profile = heavy(profile)
    plans = plan_sweep(configs, base, trials, 4, lambda options: profile, lambda n: hw, lambda k: 0.5 * k)
    assert [p.k for p in sorted(plans, key=lambda p: p.k)] == [1, 2, 4]
    assert plans[0].k == best_k
    for p in plans:
        assert p.slots == 4 // p.k and p.waves == -(-trials // p.slots)
        assert p.sweep_s == pytest.approx(p.waves * p.trial_s)
        assert p.start_s == 0.5 * p.k and p.trial_s > p.start_s  # start, then the steps and the evaluation
        assert p.steps == pytest.approx(sum(c.epochs * (profile.train_samples // c.batch_size) for c in configs) / 12)


def test_a_searched_batch_stands_in_for_batch_size(tmp_path):
    """--batch-size 33 on 2-way trials was refused although every trial takes 32 or 64."""
    from partrain.cli import build_parser
    from partrain.sweep.command import _settings

    args = build_parser().parse_args(["sweep", "--workers", "2", "--per-trial", "2", "--batch-size", "33",
                                      "--space", "batch_size=32,64", "--storage", str(tmp_path / "s.db")])
    assert _settings(args).base.batch_size == 32
