"""Profiles: what the model profiler measures, JSON round trips, the cache, the hardware
profile's fits and the cluster file."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from partrain.cli import main
from partrain.errors import PartrainError
from partrain.predict.cluster import load_cluster
from partrain.predict.fits import COLLECTIVES, default_sizes
from partrain.predict.machine import fingerprint as machine
from partrain.predict.profiles import HardwareProfile, ModelProfile
from partrain.profile import cache as cache_module
from partrain.profile import model as model_module
from partrain.profile.cache import load_or_profile
from partrain.profile.collectives import interleaved, repeats_for, sweep
from partrain.profile.hardware import QUICK, fit_measurements, group_sizes
from partrain.profile.pipeline_fits import fit_message_cpu
from partrain.profile.step_probes import SYNC_BYTES, SYNC_COMPUTES_S
from partrain.profile.model import profile_model
from partrain.profile.step_probes import LOADS

pytestmark = pytest.mark.alone  # measures models and this machine: never beside another test (make test)


@pytest.fixture(scope="module")
def measured():
    return profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True)


@pytest.fixture
def mlp(measured):
    """The measured profile as if taken on a quiet machine (the cache keeps only those)."""
    import dataclasses

    return dataclasses.replace(measured, other_load=0.0)


def test_model_profile_measures_every_block(mlp):
    assert [b.name for b in mlp.blocks] == ["fc1", "fc2", "fc3"]
    assert sum(b.params for b in mlp.blocks) == 235_146
    fc2 = mlp.blocks[1]
    assert fc2.param_bytes == 4 * (256 * 128 + 128) and fc2.param_tensors == 2
    assert fc2.out_bytes == [4 * b * 128 for b in (4, 16)]
    # Linear forward 2*b*in*out, backward: input gradient and weight gradient, as much again each
    assert fc2.flops == [6 * b * 256 * 128 for b in (4, 16)]
    assert mlp.blocks[0].flops == [4 * b * 784 * 256 for b in (4, 16)]  # no gradient for the data
    assert all(t > 0 for b in mlp.blocks for t in b.fwd_s + b.bwd_s)
    # on a CPU, each block's forward and backward also from caches written over (as a stage of a
    # pipeline on more workers than cores starts them): one figure per batch size
    assert all(len(b.fwd_cold_s) == len(b.bwd_cold_s) == 2 and min(b.fwd_cold_s + b.bwd_cold_s) > 0 for b in mlp.blocks)
    assert fc2.saves_input and fc2.saved_bytes[1] > fc2.saved_bytes[0] > 0
    # the blocks run as one stage runs them (one chain, one backward call), per batch size, and
    # what summing into gradients already there adds to that backward
    assert len(mlp.chain_s) == 2 and all(len(c) == 2 and min(c) > 0 for c in mlp.chain_s)
    assert mlp.accumulate_s is not None and 0 <= mlp.accumulate_s < 0.01
    assert set(mlp.optimizer_s) == {"sgd", "sgd-momentum", "adam"}
    assert ModelProfile.from_dict({**mlp.to_dict(), "average_s": 1e-3}) == mlp  # earlier versions' keys are ignored
    # partrain's own loop on a world of one, per strategy, at the smallest batch size
    assert mlp.world_of_one_batch == 4
    assert set(mlp.world_of_one_s) == {"serial", "ddp", "local-sgd", "fsdp", "hybrid"}
    assert all(0 < t < 1 for t in mlp.world_of_one_s.values())
    # the probe's timings were brought to the machine's pace over the whole profile (profile.pace):
    # a factor near 1 on a steady machine, the figures already multiplied by it
    assert 0.25 < mlp.probe_pace < 4
    # the windows themselves, the profiler's and the probe's, kept for the pace after it (bench --profile)
    assert len(mlp.pace_s) >= 5 and all(0 < t < 0.1 for t in mlp.pace_s) and mlp.later_pace_s == []
    assert 0 <= mlp.replica_wrapper_s < 0.1  # fully_shard's DTensor parameters and hooks cost a small model ~1 ms
    older = {k: v for k, v in mlp.to_dict().items() if k != "replica_wrapper_s"}
    with pytest.raises(TypeError):  # a profile from before the wrapper was measured: load() says so, then it is redone
        ModelProfile.from_dict(older)
    assert mlp.train_samples == 60_000 and mlp.input_bytes == 4 * 784
    assert 0 < mlp.baseline_rss_bytes <= mlp.baseline_peak_rss_bytes
    assert len(mlp.train_peak_rss_bytes) == 2 and min(mlp.train_peak_rss_bytes) >= mlp.baseline_rss_bytes


def test_step_statistic_shrugs_off_one_slow_sample():
    from partrain.profile.timing import lower_half_median as lower
    assert lower([0.161, 0.329]) == 0.161  # two steps: one slow step does not count
    assert lower([0.20, 0.10, 0.30]) == 0.20  # three: the median
    # a burst of other work over the first half leaves the quiet half's median
    assert lower([5.0, 6.0, 7.0, 1.0, 2.0, 3.0]) == 2.0
    assert lower([1.0, 2.0, 3.0, 9.0, 9.0, 9.0]) == 2.0


def test_a_window_after_other_processes_waits_out_the_wake_up(monkeypatch):
    """A pace window after a benchmark's cell runs the step untimed for ``WAKE_S`` first (then a
    window of about ``WINDOW_S``); a window without ``warm`` starts at once. On a fake clock that
    each step moves by 1 ms, so nothing here depends on the machine's speed."""
    from types import SimpleNamespace

    from partrain.profile import pace as pace_module

    clock = {"t": 0.0, "steps": 0}
    monkeypatch.setattr(pace_module, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))

    def step():
        clock["t"] += 0.001
        clock["steps"] += 1

    p = pace_module.Pace(step)  # one step at construction
    clock["steps"] = 0
    p.sample()
    plain = clock["steps"]  # the window's steps alone: about WINDOW_S of them
    clock["steps"] = 0
    p.sample(warm=True)
    assert abs(clock["steps"] - plain - pace_module.WAKE_S / 0.001) <= 1  # WAKE_S of untimed steps first
    assert p.windows == pytest.approx([0.001, 0.001])  # each window times single steps


def test_world_of_one_strategies_take_turns_and_a_burst_spoils_one_round_only(monkeypatch):
    """The world-of-one loop per strategy: rounds in turn that share the steps, the median of
    each strategy's rounds kept; a strategy that cannot run drops out, serial cannot."""
    import types

    from partrain import train
    from partrain.profile import probe

    calls = []
    slow = {("ddp", 1)}  # DDP's second round ran beside a burst of other work

    def fake(cfg, info, show_progress=True):
        calls.append((cfg.strategy, cfg.steps))
        if cfg.strategy == "hybrid":
            raise PartrainError("no blocks to cut")
        turn = sum(1 for s, _ in calls if s == cfg.strategy) - 1
        step = {"serial": 0.010, "ddp": 0.012, "local-sgd": 0.011, "fsdp": 0.015}[cfg.strategy] * (3 if (cfg.strategy, turn) in slow else 1)
        return types.SimpleNamespace(step_seconds=[1.0] + [step] * (cfg.steps - 1))  # a slow warm-up step first

    monkeypatch.setattr(train, "train_worker", fake)
    args = {"batch_sizes": [16, 4], "world_of_one_steps": 30, "model": "mlp", "dataset": "mnist", "data_dir": None,
            "synthetic": True, "options": {}, "threads": 1, "run": {"precision": "fp32", "channels_last": False, "compile": False}}
    out = probe._time_world_of_one(args)
    assert out == pytest.approx({"serial": 0.010, "ddp": 0.012, "local-sgd": 0.011, "fsdp": 0.015})
    assert [s for s, _ in calls].count("hybrid") == 1  # refused once, not tried again
    assert [s for s, _ in calls[:5]] == list(probe.WORLD_OF_ONE)  # turns: every strategy once per round
    assert {steps for _, steps in calls} == {1 + 30 // 3}
    args["world_of_one_steps"] = 2  # a big model's two steps: one round
    calls.clear()
    probe._time_world_of_one(args)
    assert [s for s, _ in calls] == list(probe.WORLD_OF_ONE)
    monkeypatch.setattr(train, "train_worker", lambda cfg, info, show_progress=True: (_ for _ in ()).throw(PartrainError("x")))
    with pytest.raises(PartrainError):
        probe._time_world_of_one(args)


def test_world_of_one_rounds_count_in_multiples_of_the_pace_either_side_of_them(monkeypatch):
    """A spell of the host from the middle of the second of three rounds on (the windows after the
    last two read 1.9x) slowed every strategy's steps as it slowed the bare step: the rounds'
    median would read them 1.45x, the multiples of the windows either side of each round as they are."""
    import types

    from partrain import train
    from partrain.profile import probe

    windows = iter([1e-3, 1e-3, 1.9e-3, 1.9e-3])  # before round 1, after rounds 1, 2 and 3
    paces = iter([1e-3, 1e-3, 1e-3, 1e-3, 1.45e-3, 1.45e-3, 1.45e-3, 1.45e-3, 1.9e-3, 1.9e-3, 1.9e-3, 1.9e-3])
    base = {"serial": 2.0, "ddp": 2.5, "local-sgd": 2.4, "fsdp": 6.0}  # multiples of the bare step

    def fake(cfg, info, show_progress=True):
        if cfg.strategy == "hybrid":
            raise PartrainError("no blocks to cut")
        return types.SimpleNamespace(step_seconds=[1.0] + [base[cfg.strategy] * next(paces)] * (cfg.steps - 1))

    monkeypatch.setattr(train, "train_worker", fake)
    args = {"batch_sizes": [4, 16], "world_of_one_steps": 30, "model": "mlp", "dataset": "mnist", "data_dir": None,
            "synthetic": True, "options": {}, "threads": 1, "run": {"precision": "fp32", "channels_last": False, "compile": False}}
    assert probe._time_world_of_one(args, between_rounds=lambda: next(windows)) == pytest.approx(base)
    assert next(windows, None) is None  # one window before the rounds, one after each
    # a short spell in one window between two rounds that ran at the usual pace moves neither
    windows = iter([1e-3, 1e-3, 1.64e-3, 1e-3])
    paces = iter([1e-3] * 12)
    assert probe._time_world_of_one(args, between_rounds=lambda: next(windows)) == pytest.approx(base)


def test_model_profile_json_round_trip(mlp, tmp_path):
    path = mlp.save(tmp_path / "p.json")
    again = ModelProfile.load(path)
    assert again == mlp
    assert json.loads(path.read_text())["model"] == "mlp"


def test_unreadable_profile_is_a_clear_error(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(PartrainError, match="profile again"):
        ModelProfile.load(bad)


def test_cache_is_reused(tmp_path, monkeypatch, mlp):
    calls = []

    def fake_profile(*args, **kwargs):
        calls.append(args)
        return mlp

    monkeypatch.setattr(model_module, "profile_model", fake_profile)
    first, path, reused = load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    again, path2, reused2 = load_or_profile("mlp", "mnist", [16, 4], 1, tmp_path, synthetic=True)
    assert (reused, reused2) == (False, True) and path == path2 and len(calls) == 1
    assert again == first
    other = load_or_profile("mlp", "mnist", [4, 16], 2, tmp_path, synthetic=True)[1]
    assert other != path and len(calls) == 2  # threads are part of the key
    assert "t2" in other.name and cache_module.fingerprint() in other.name


@pytest.mark.parametrize("bad", [math.nan, -0.5, math.inf])
def test_a_profile_holding_a_number_no_measurement_gives_is_refused(mlp, tmp_path, bad):
    raw = mlp.to_dict()
    raw["blocks"][1]["fwd_s"][0] = bad
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PartrainError, match=r"holds .* at blocks\.1\.fwd_s\.0, which no measurement gives"):
        ModelProfile.load(path)


def test_an_edited_cached_profile_is_measured_again(tmp_path, monkeypatch, mlp, capsys):
    monkeypatch.setattr(model_module, "profile_model", lambda *a, **k: mlp)
    _, path, _ = load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    raw = json.loads(path.read_text())
    raw["loss_s"] = [math.nan for _ in raw["loss_s"]]
    path.write_text(json.dumps(raw))
    again, _, reused = load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    assert not reused and again == mlp and ModelProfile.load(path) == mlp
    assert "which no measurement gives: measuring it again" in capsys.readouterr().err


@pytest.mark.parametrize("edit, where", [
    (lambda raw: raw["blocks"][0].__setitem__("fwd_s", ["a"] * len(raw["batch_sizes"])), "blocks.0.fwd_s holds ['a'"),
    (lambda raw: raw["blocks"][1]["bwd_s"].pop(), "blocks.1.bwd_s holds 1 values for 2 batch sizes"),
    (lambda raw: raw.__setitem__("batch_sizes", "4,16"), "batch_sizes holds '4,16'"),
    (lambda raw: raw.__setitem__("optimizer_s", []), "optimizer_s holds []"),
    (lambda raw: raw.__setitem__("blocks", []), "no block measured"),
    (lambda raw: raw.__setitem__("batch_sizes", [16, 4]), "are not increasing sizes"),
    (lambda raw: raw.__setitem__("loss_s", []), "loss_s holds 0 values for 2 batch sizes"),
    (lambda raw: raw["blocks"].__setitem__(1, 7), "blocks.1 is not an object"),
    (lambda raw: raw["chain_s"].pop(), "chain_s holds 1 values for 2 batch sizes"),
    (lambda raw: raw["chain_s"][0].pop(), "chain_s holds an entry that is not [forward, backward]"),
    (lambda raw: raw.__setitem__("accumulate_s", "0.1"), "accumulate_s holds '0.1'"),
])
def test_a_cached_profile_of_the_wrong_shape_is_measured_again(tmp_path, monkeypatch, mlp, capsys, edit, where):
    """A string where a time is, a list one short: the predictor's arithmetic raised TypeError
    and IndexError on them (an audit), where the cache promises to measure again."""
    monkeypatch.setattr(model_module, "profile_model", lambda *a, **k: mlp)
    _, path, _ = load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    again, _, reused = load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    assert not reused and again == mlp
    err = capsys.readouterr().err
    assert where in err and "measuring it again" in err, err


def test_a_model_too_big_to_profile_here_says_so(tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 160000000000 bytes")

    monkeypatch.setattr(model_module, "profile_model", out_of_memory)
    with pytest.raises(PartrainError, match="mlp, profiled at batches up to 16, does not fit in this machine's memory, and partrain profiles"):
        load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)


def test_a_profile_taken_on_a_busy_machine_is_measured_again_and_never_cached(tmp_path, monkeypatch, mlp, capsys):
    import dataclasses

    busy = dataclasses.replace(mlp, other_load=0.6)
    calls = []
    monkeypatch.setattr(model_module, "profile_model", lambda *a, **k: calls.append(a) or busy)
    profile, path, reused = load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    assert profile.other_load == 0.6 and not reused
    assert len(calls) == cache_module.BUSY_ATTEMPTS and not path.exists()
    assert "used once and not cached" in capsys.readouterr().err
    quiet = iter([busy, mlp])  # busy, then quiet: the quiet one is kept
    monkeypatch.setattr(model_module, "profile_model", lambda *a, **k: next(quiet))
    assert load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)[0] == mlp and path.exists()


def test_profile_cli_prints_and_caches(tmp_path, capsys, monkeypatch):
    # a busy machine (other processes at 25% of the CPU or more) keeps no profile: its own tests have that
    monkeypatch.setattr(cache_module, "BUSY_SHARE", float("inf"))
    argv = ["profile", "--model", "tests.userfactory:build", "--synthetic", "--batch-sizes", "2,8", "--threads", "1",
            "--profile-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tests.userfactory:build" and [b["name"] for b in out["blocks"]] == ["body", "head"]
    assert main(argv) == 0
    assert "(cached)" in capsys.readouterr().err


def test_fit_measurements_per_tier_and_group_size():
    def points(latency, bandwidth):
        return [[n, latency + n / bandwidth] for n in default_sizes(2**22)]

    raw = {"tiers": {"intra": {2: {name: points(1e-5, 1e9) for name in COLLECTIVES},
                               4: {name: points(3e-5, 0.5e9) for name in COLLECTIVES}}}}
    links, collectives = fit_measurements(raw)
    assert set(collectives["intra"]) == {2, 4}
    assert links["intra"].segments[0].latency_s == pytest.approx(1e-5, rel=0.01)
    assert collectives["intra"][4]["allreduce"].segments[0].bandwidth == pytest.approx(0.5e9, rel=0.01)


def test_a_sweep_times_again_a_point_slower_than_a_larger_message():
    # a 1 Gbit/s link's ping-pong read inside a slow episode at 4 and 16 KiB (issue 18's run52)
    first = {1024: 7e-5, 4096: 8.0e-4, 16384: 6.5e-4, 65536: 3.9e-4, 2**20: 7.9e-3}
    again = {4096: [7.1e-4, 7.5e-5], 16384: [7.7e-5]}  # 4 KiB is still slow the first time again
    calls = []

    def time_of(n):
        calls.append(n)
        return again[n].pop(0) if calls.count(n) > 1 else first[n]

    swept = sweep(time_of, list(first))
    assert swept == [(1024, 7e-5), (4096, 7.5e-5), (16384, 7.7e-5), (65536, 3.9e-4), (2**20, 7.9e-3)]
    assert sorted(calls) == sorted([*first, 4096, 4096, 16384])  # the plausible points once each
    # a point that stays slow is kept, at the shortest of its tries, and a sweep tries it no more than that
    calls.clear()
    slow = lambda n: calls.append(n) or {1: 5e-4, 2: 1e-4}[n]  # noqa: E731
    assert sweep(slow, [1, 2], retries=2) == [(1, 5e-4), (2, 1e-4)] and sorted(calls) == [1, 1, 1, 2]
    assert sweep(lambda n: n * 1e-6, [4, 1, 2]) == [(4, 4e-6), (1, 1e-6), (2, 2e-6)]  # the order asked for


def test_a_sweep_times_again_a_point_far_above_the_line_through_its_neighbours():
    # a 100 Mbit/s link's ping-pong at 4 KiB, inside 1.5x of 16 KiB's but 2.3x the line through
    # 1 and 16 KiB (issue 18's run85n); its other profiles read 0.18-0.23 ms
    first = {1024: 1.0e-4, 4096: 5.0e-4, 16384: 7.1e-4, 65536: 4.67e-3, 2**18: 2.12e-2}
    again = {4096: [4.9e-4, 2.0e-4]}  # still slow the first time again
    calls = []

    def time_of(n):
        calls.append(n)
        return again[n].pop(0)

    timed_again: dict = {}
    assert sweep(time_of, list(first), first=first, timed_again=timed_again) == [
        (1024, 1.0e-4), (4096, 2.0e-4), (16384, 7.1e-4), (65536, 4.67e-3), (2**18, 2.12e-2)]
    assert calls == [4096, 4096]  # each of the others lies near its neighbours' line
    assert timed_again == {4096: [5.0e-4, 2.0e-4]}  # what the profile keeps: the first time and the one kept
    # a size the line does not hold (a collective switching algorithms) keeps its time after its tries
    step = {16: 1e-4, 64: 1e-4, 256: 6e-4, 1024: 7e-4}
    calls.clear()
    timed_again.clear()
    assert sweep(lambda n: calls.append(n) or step[n], list(step), first=step, timed_again=timed_again) == list(step.items())
    assert calls == [256, 256] and timed_again == {256: [6e-4, 6e-4]}


class _Call:
    """One collective call of a fake backend: knows its point, counts the warm-up calls."""

    warmed: list = []

    def __init__(self, key):
        self.key = key

    def __call__(self):
        _Call.warmed.append(self.key)


def test_collectives_are_timed_in_passes_so_an_episode_slows_one_trial_of_a_point():
    # a fake clock: each timing takes repeats x the point's time; an episode (issue 18's 4-node
    # link profile at 100 Mbit/s) makes all of it 1.6x slower for a stretch shorter than a pass
    sizes = [2**12, 2**16, 2**20]
    true = {(name, n): n * k for name, k in (("allreduce", 1e-8), ("broadcast", 2e-8)) for n in sizes}
    pass_s = sum(repeats_for(n) * t for (_, n), t in true.items())
    clock, order = [0.0], []

    def time_once(run, repeats):
        t = true[run.key] * (1.6 if 0.3 * pass_s <= clock[0] < 1.2 * pass_s else 1.0)
        clock[0] += repeats * t
        order.append(run.key)
        return t

    _Call.warmed.clear()
    makes = {name: (lambda n, name=name: _Call((name, n))) for name in ("allreduce", "broadcast")}
    times = interleaved(makes, sizes, time_once=time_once)
    assert times == pytest.approx(true)  # every point's median is outside the episode
    assert order == [*true] * 3  # a pass over every collective and size, three times
    assert _Call.warmed == [*true]  # each point warmed up once, before its first timing
    # back to back, as the sweep timed them before: the points inside the episode read it
    clock[0], slowed = 0.0, {}
    for key in true:
        slowed[key] = sorted(time_once(_Call(key), repeats_for(key[1])) for _ in range(3))[1]
    assert any(slowed[key] > 1.5 * true[key] for key in true)


def test_group_sizes():
    assert group_sizes(1) == [] and group_sizes(2) == [2] and group_sizes(6) == [2, 4, 6]


def test_tier_plans_measure_the_world_across_nodes_of_several_workers():
    """One rank per node across nodes, and the whole world where nodes hold several: the
    group DDP reduces over, whose ring mixes hops within and between nodes."""
    from partrain.profile.hardware import _tier_plans

    assert _tier_plans(2, 2) == [("intra", 2, [[0, 1]], (0, 1))]
    assert _tier_plans(4, 1) == [("inter", 4, [[0, 1, 2, 3]], (0, 1))]
    assert _tier_plans(4, 2) == [("intra", 2, [[0, 1], [2, 3]], (0, 1)), ("inter", 2, [[0, 2]], (0, 2)),
                                 ("inter", 4, [[0, 1, 2, 3]], None)]


def test_cluster_file(tmp_path):
    from pathlib import Path

    example = load_cluster(Path(__file__).resolve().parents[1] / "examples" / "cluster.toml")
    assert (example.nodes, example.workers_per_node, example.backend) == (4, 4, "nccl")
    assert example.links["inter"].segments[0].bandwidth == pytest.approx(12.5e9)
    assert example.memory_limit_per_worker(4) == 40e9
    again = HardwareProfile.from_dict(json.loads(json.dumps(example.to_dict())))
    assert again == example
    bad = tmp_path / "c.toml"
    bad.write_text("[cluster]\nnodes = 2\nworkers_per_node = 2\ndevice_memory_gb = 8\n[intra]\nbandwidth_gb_per_s = 1\nlatency_us = 1\n")
    with pytest.raises(PartrainError, match=r"\[inter\]"):
        load_cluster(bad)
    bad.write_text("[cluster]\nnodes = 1\nworkers_per_node = -2\n")
    with pytest.raises(PartrainError, match="workers_per_node must be a whole number from 1 to 4096"):
        load_cluster(bad)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.multiproc
def test_the_side_by_side_probe_runs_a_pipeline_on_every_pair_of_halves_at_once():
    """4 workers: ranks 0 and 2, 1 and 3 (stage s of replica d is rank s * dp + d), both pipelines
    at once, each rank with its own pair's step times of both schedules and its stages' costs."""
    from partrain.distributed.spawn import spawn
    from tests.probe_worker import side_by_side

    got = spawn(side_by_side, (3, 2), 4)
    assert [got[r]["ranks"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for probe in got.values():
        steps = probe["steps"]
        assert sorted((s["schedule"], s["microbatches"]) for s in steps) == [("1f1b", 4), ("1f1b", 8), ("gpipe", 4), ("gpipe", 8)]
        assert all(len(s["rounds_s"]) == 3 and s["step_s"] == statistics.median(s["rounds_s"]) > 0 for s in steps)
        assert len(probe["stage_s"]) == 2 and all(f > 0 and b > 0 for f, b in probe["stage_s"])
        assert len(probe["stage_cold_s"]) == 2 and all(f > 0 and b > 0 for f, b in probe["stage_cold_s"])
        # then over stages that compute: 8 micro-batches of 8 rows, one linear layer of 64 (the helper's load)
        (loaded,) = probe["loaded"]
        assert sorted((s["schedule"], s["microbatches"]) for s in loaded["steps"]) == [("1f1b", 8), ("gpipe", 8)]
        assert loaded["message_bytes"] == 8 * 64 * 4 and len(loaded["stage_s"]) == 2


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hardware_profile_of_3_workers_fits_the_pipeline_over_all_of_them(tmp_path, measured_hardware):
    """One 3-stage pipeline (the middle stage receives and sends both ways): its step times per
    schedule and every stage's own costs, fitted to a step cost and a hop that a plan with a
    stage on every worker takes."""
    hw, _ = measured_hardware
    probe = hw.points["pipeline_world"]
    steps = probe["steps"]
    assert sorted((s["schedule"], s["microbatches"]) for s in steps) == [("1f1b", 4), ("1f1b", 8), ("gpipe", 4), ("gpipe", 8)]
    rounds = QUICK["pipelines"]  # the fixture's profile is --quick's
    assert all(len(s["rounds_s"]) == rounds["rounds"] and s["step_s"] == statistics.median(s["rounds_s"]) > 0 for s in steps)
    assert len(probe["stage_s"]) == 3 and all(f > 0 and b > 0 for f, b in probe["stage_s"])
    assert len(probe["stage_cold_s"]) == 3 and all(f > 0 and b > 0 for f, b in probe["stage_cold_s"])
    step_s, hop_s = hw.pipeline_world
    assert step_s >= 0.0 and 0.0 <= hop_s <= max(s["step_s"] for s in steps)
    assert hw.runtime_of(1, 3) == (step_s, hop_s, (0, 1), True)
    # a step's synchronisation after computing, probed for every group of workers side by side,
    # more than the cores too (3 on 2 cores: the plan's 3 workers share them as the probe's did)
    assert set(hw.step_sync) == {2, 3} and all(len(points) == len(SYNC_COMPUTES_S)
                                               for by_size in hw.step_sync.values() for points in by_size.values())
    # beyond the cores (3 workers on 2): the cores' factor, the cores time-sliced (3 / 2)
    if machine().cpu_cores == 2:
        assert hw.compute_sharing[3] == pytest.approx(hw.compute_sharing[2] * 3 / 2)
    # then over stages that compute more: 8 micro-batches, fewer rounds, stages that take longer each time
    loaded = probe["loaded"]
    assert [p["message_bytes"] for p in loaded] == [rows * width * 4 for rows, width, _ in LOADS]
    for probe in loaded:
        assert sorted((s["schedule"], s["microbatches"]) for s in probe["steps"]) == [("1f1b", 8), ("gpipe", 8)]
        assert all(len(s["rounds_s"]) == rounds["loaded_rounds"] and s["step_s"] > 0 for s in probe["steps"])
    # in the order the probes ran, their stages' actions rising; a probe another job slowed out of
    # place would be dropped (``fits.longest_increasing``), so all of them but one at the least
    actions = [a for a, _ in hw.pipeline_world_loaded]
    assert len(actions) >= len(LOADS) and all(a < b for a, b in zip(actions, actions[1:]))
    if len(actions) == len(LOADS) + 1:
        assert hw.pipeline_world_loaded[0] == (pytest.approx(actions[0]), hop_s)
    assert all(h >= 0.0 for _, h in hw.pipeline_world_loaded)
    assert hw.runtime_of(1, 3, actions[-1] * 2).hop_s == hw.pipeline_world_loaded[-1][1]
    assert HardwareProfile.load(hw.save(tmp_path / "hw.json")) == hw


@pytest.mark.slow
@pytest.mark.multiproc
def test_hardware_profile_measures_every_collective(tmp_path, measured_hardware):
    hw, _ = measured_hardware
    for group in (2, 3):  # pairs of the 3 workers, and all of them
        fits = hw.collectives["intra"][group]
        assert set(fits) == set(COLLECTIVES) or hw.notes
        for fit in fits.values():
            assert all(fit.time(n) > 0 for n in (64, 2**20)) and not math.isnan(fit.time(1))
    assert set(hw.compute_sharing) == set(hw.sync_s) == {2, 3}
    assert hw.compute_sharing[2] >= 1.0 and hw.sync_s[2] >= 0.0
    # the workers' CPU is this process's own (its children's, or its fork server's), not another's
    assert hw.other_load < 0.5
    probe = hw.points["compute_sharing"]["2"]
    assert probe["alone_s"] > 0 and probe["together_s"] > 0 and probe["synced_s"] > 0
    # a step's synchronisation after each of three compute lengths, rising, for each message size
    # the link carries within the cap (the smallest always); the excess of a median step over its
    # compute may be negative
    sizes = sorted(hw.step_sync[2])
    assert sizes == list(SYNC_BYTES[:len(sizes)]) and sizes[0] == SYNC_BYTES[0]
    for n, points in hw.step_sync[2].items():
        assert len(points) == len(SYNC_COMPUTES_S) and all(c > 0 for c, _ in points)
        assert [c for c, _ in points] == sorted(c for c, _ in points) and points[-1][0] > 4 * points[0][0]
    assert [(size["message_bytes"], size["points"]) for size in hw.points["step_sync"]["2"]] == \
        [(n, [list(p) for p in points]) for n, points in hw.step_sync[2].items()]
    # the pipeline probe: each step time the median of its rounds, all kept; both schedules, 4 and 8 micro-batches
    steps = hw.points["pipeline"]["steps"]
    assert sorted((s["schedule"], s["microbatches"]) for s in steps) == [("1f1b", 4), ("1f1b", 8), ("gpipe", 4), ("gpipe", 8)]
    for s in steps:
        assert len(s["rounds_s"]) == QUICK["hops"]["rounds"] and s["step_s"] == statistics.median(s["rounds_s"]) > 0
        # each rank's CPU a step: its actions' and messages' at most, never more than the step's wall time by much
        assert len(s["cpu_s"]) == 2 and all(0 < c < 2 * s["step_s"] for c in s["cpu_s"])
    # a message's CPU, from the CPU that 8 micro-batches take over 4: fitted, and held by the profile
    assert hw.pipeline_message_cpu_s == fit_message_cpu(hw.points["pipeline"], hw.pipeline_action_s) >= 0
    # three workers: no replicas' pipelines to run side by side (an even number of workers from 4 has them)
    assert hw.pipeline_side_by_side is None and "pipeline_side_by_side" not in hw.points
    # the link alone: its two largest messages, and the rate between them
    assert [n for n, _ in hw.points["link_alone"]["intra"]] == [2**18, 2**20]
    assert all(t > 0 for _, t in hw.points["link_alone"]["intra"])
    rate = hw.link_rate("intra")  # on loopback the larger message may take no longer (CI read 0.318 then 0.305 ms): NaN
    assert rate > 0 or math.isnan(rate)
    assert HardwareProfile.load(hw.save(tmp_path / "hw.json")) == hw


def test_the_serial_loop_is_never_below_the_smallest_batch_s():
    """The bare loop timed slow at the smallest batch (another process on the core) made the larger
    sizes' loop negative, and recommend predicted serial at 0 s a step (an audit's ZeroDivisionError)."""
    from partrain.profile.model import _cpu_loop

    loop = _cpu_loop({"bare_loop": [0.004, 0.002, 0.009], "world_of_one": {"serial": 0.001}})
    assert loop == pytest.approx([0.001, 0.001, 0.006])


def test_the_probes_timings_are_brought_to_the_pace_of_the_whole_profile():
    """The probe's second of timings landed in a slow spell (its windows of the bare step twice
    those the profiler took before and after): its loop, every strategy's world-of-one step and
    the replica wrapper's cost are nearly halved; its memory figures stay as measured."""
    from partrain.profile.pace import at_pace, probe_pace

    profiler, probe = [1.0e-3, 1.1e-3, 0.9e-3, 1.0e-3, 1.05e-3], [2.0e-3, 2.1e-3, 1.9e-3]
    factor = probe_pace(profiler, probe)
    assert factor == pytest.approx(statistics.median(profiler + probe) / 2.0e-3) == pytest.approx(0.5375)
    memory = {"rss": 10, "peak": 12, "train_peaks": [20, 30], "bare_loop": [2e-3, 4e-3],
              "world_of_one": {"serial": 2e-3, "ddp": 3e-3}, "replica_wrapper": 1e-3, "pace": probe}
    paced = at_pace(memory, factor)
    assert paced["bare_loop"] == pytest.approx([1.075e-3, 2.15e-3])
    assert paced["world_of_one"] == pytest.approx({"serial": 1.075e-3, "ddp": 1.6125e-3})
    assert paced["replica_wrapper"] == pytest.approx(0.5375e-3)
    assert {k: paced[k] for k in ("rss", "peak", "train_peaks")} == {"rss": 10, "peak": 12, "train_peaks": [20, 30]}
    # a probe at the machine's usual pace is left as it was; without windows on either side, too
    assert probe_pace([1e-3, 1e-3, 1e-3], [1e-3, 1e-3]) == 1.0
    assert probe_pace([], probe) == probe_pace(profiler, []) == 1.0


def test_a_profile_is_read_at_the_pace_after_it_only_where_both_sides_took_windows(mlp):
    """``at_later_pace``: a profile no bench sampled after it, and a GPU profile (no windows of its
    own), are read as measured; with later windows at the same median, too."""
    import dataclasses

    from partrain.profile.pace import at_later_pace, later_pace

    assert at_later_pace(mlp) is mlp
    assert at_later_pace(dataclasses.replace(mlp, pace_s=[], later_pace_s=[1e-3])).loop_s == mlp.loop_s
    steady = dataclasses.replace(mlp, later_pace_s=[statistics.fmean(mlp.pace_s)] * 3)
    assert at_later_pace(steady).blocks[1].fwd_s == pytest.approx(mlp.blocks[1].fwd_s)
    later = dataclasses.replace(mlp, later_pace_s=[2 * statistics.fmean(mlp.pace_s)] * 20)
    factor, slower = later_pace(later), at_later_pace(later)
    n = len(mlp.pace_s)  # all windows at twice the profile's mean: (n + 40) / (n + 20)
    assert factor == pytest.approx((n + 40) / (n + 20)) and slower.blocks[1].fwd_s == pytest.approx([factor * t for t in mlp.blocks[1].fwd_s])
    assert [t for c in slower.chain_s for t in c] == pytest.approx([factor * t for c in mlp.chain_s for t in c])
    assert slower.accumulate_s == pytest.approx(factor * mlp.accumulate_s)


def test_the_pace_after_a_profile_moves_with_the_share_of_slow_windows_not_in_a_jump(mlp):
    """A machine of two speeds, 1.4x apart: the windows beside the cells at both levels. One
    window moved from the fast level to the slow moves the factor by a step of that window's
    weight, where a median would jump from one level to the other at a half."""
    import dataclasses

    from partrain.profile.pace import later_pace

    fast = statistics.fmean(mlp.pace_s)
    own = [fast] * 13

    def factor(slow: int) -> float:
        return later_pace(dataclasses.replace(mlp, pace_s=own, later_pace_s=[fast] * (21 - slow) + [1.4 * fast] * slow))

    assert factor(0) == pytest.approx(1.0) and factor(21) == pytest.approx((13 + 21 * 1.4) / 34)
    assert factor(11) - factor(10) == pytest.approx(0.4 / 34)  # one window's weight, not the 0.4 between levels
    assert all(factor(k) < factor(k + 1) for k in range(21))


def test_paired_ratios_see_through_a_spell_and_time_the_reference_warm(monkeypatch):
    """A fake clock: the larger step takes 4 units and the reference 1, both twice as long in a
    slow spell (pairs 2 and 3); the reference's first call after the larger step runs cold (3
    units) and is not the one timed. Every pair reads 4, and pairs go on until the larger step
    has taken the target (at least one pair)."""
    import partrain.profile.pace as pace_module

    clock = {"now": 0.0, "pair": 0, "warm": False}
    monkeypatch.setattr(pace_module.time, "perf_counter", lambda: clock["now"])

    def slow() -> float:
        return 2.0 if clock["pair"] in (2, 3) else 1.0

    def step() -> None:
        clock["pair"] += 1
        clock["now"] += 4.0 * slow()
        clock["warm"] = False

    def reference() -> None:
        clock["now"] += (1.0 if clock["warm"] else 3.0) * slow()
        clock["warm"] = True

    ratios = pace_module.paired_ratios(step, reference, target_s=21.0)
    assert ratios == pytest.approx([4.0] * 4)  # 4 + 8 + 8 + 4 units: the target of 21 passed at the fourth
    clock["pair"] = 10
    assert pace_module.paired_ratios(step, reference, target_s=0.0) == pytest.approx([4.0])


def test_a_pace_window_times_the_step_at_least_once_and_clears_after_it():
    from partrain.profile.pace import MIN_STEPS, Pace, window

    calls, cleared = [], []
    assert window(lambda: calls.append(1), window_s=0.0) >= 0 and len(calls) == MIN_STEPS
    pace = Pace(lambda: calls.append(1), after=lambda: cleared.append(1))
    pace.sample()
    pace.sample()
    assert len(pace.windows) == 2 and len(cleared) == 2 and all(w >= 0 for w in pace.windows)


def test_a_hardware_profile_taken_while_the_machine_was_busy_is_shown_not_cached(tmp_path, monkeypatch, capsys):
    import dataclasses

    import partrain.profile.hardware as hardware
    from partrain.profile.cache import BUSY_SHARE, local_hardware

    busy = dataclasses.replace(local_hardware(), other_load=BUSY_SHARE + 0.2)
    monkeypatch.setattr(hardware, "profile_hardware", lambda *a, **k: busy)
    assert main(["profile", "--hardware", "--workers", "2", "--profile-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "hardware profile: not cached" in err and "so it was not cached" in err
    assert list(tmp_path.iterdir()) == []
    quiet = dataclasses.replace(busy, other_load=0.0)
    monkeypatch.setattr(hardware, "profile_hardware", lambda *a, **k: quiet)
    assert main(["profile", "--hardware", "--workers", "2", "--profile-dir", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("hardware-*.json"))) == 1  # the quiet one is kept


@pytest.mark.parametrize("options", [["--max-mb", "0.01"], ["--threads", "2"]])
def test_a_hardware_profile_measured_unlike_predict_does_not_take_its_place(tmp_path, monkeypatch, capsys, options):
    """predict and recommend load this machine's cached entry as their own (1 thread a worker,
    messages up to 64 MiB): one measured with 4 KiB messages had the mlp's 0.9 MB allreduce
    extrapolated from them (a review found it kept under the same name)."""
    import dataclasses

    import partrain.profile.hardware as hardware
    from partrain.profile.cache import local_hardware

    quiet = dataclasses.replace(local_hardware(), other_load=0.0)
    monkeypatch.setattr(hardware, "profile_hardware", lambda *a, **k: quiet)
    assert main(["profile", "--hardware", "--workers", "2", *options, "--profile-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"hardware profile: not cached (measured with {' '.join(options)}" in err
    assert list(tmp_path.iterdir()) == []
    assert main(["profile", "--hardware", "--workers", "2", "--max-mb", "256", "--profile-dir", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("hardware-*.json"))) == 1  # larger messages than predict's: kept


def test_a_quick_hardware_profile_is_shown_and_not_cached(tmp_path, monkeypatch, capsys):
    import dataclasses

    import partrain.profile.hardware as hardware
    from partrain.profile.cache import local_hardware

    asked = []
    quiet = dataclasses.replace(local_hardware(), other_load=0.0)
    monkeypatch.setattr(hardware, "profile_hardware", lambda *a, quick=False, **k: asked.append(quick) or quiet)
    assert main(["profile", "--hardware", "--workers", "2", "--quick", "--profile-dir", str(tmp_path)]) == 0
    assert asked == [True] and list(tmp_path.iterdir()) == []
    assert "hardware profile: not cached (--quick: a first look, not what predict and recommend measure)" in \
        capsys.readouterr().err


def test_quick_takes_a_third_of_each_probes_rounds_two_at_least():
    import inspect

    from partrain.profile import step_probes

    full = {name: inspect.signature(fn).parameters for name, fn in (
        ("hops", step_probes.measure_pipeline_hops), ("pair_loaded", step_probes.measure_pair_loaded),
        ("pipelines", step_probes._with_loads), ("sharing", step_probes.measure_compute_sharing),
        ("step_sync", step_probes.measure_step_sync))}
    full["pipelines"] = {"rounds": full["hops"]["rounds"], "loaded_rounds": full["pipelines"]["loaded_rounds"]}
    assert set(QUICK) == set(full)
    for probe, rounds in QUICK.items():
        for name, n in rounds.items():
            assert n == max(2, round(full[probe][name].default / 3)), (probe, name)


def test_a_failed_probe_is_told_by_its_exception_line():
    """Not the last line of a message that runs on, nor a list's repr (an audit: DDP's error
    came out as "['[rank0]:  In addition, you can set the environment variable ...']")."""
    from partrain.profile.probe import _exception_line

    ddp = "Traceback (most recent call last):\n  File \"x.py\"\nRuntimeError: Expected to have finished reduction\n" \
          "[rank0]: In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG\n"
    assert _exception_line(ddp, 1) == "RuntimeError: Expected to have finished reduction"
    assert _exception_line("[rank0]: [rank0]: ValueError: no scalars\n", 1) == "ValueError: no scalars"
    assert _exception_line("killed\n", 9) == "killed" and _exception_line("", 9) == "exit status 9"


def test_the_replica_wrapper_is_timed_with_contiguous_weights_under_channels_last():
    """A hybrid's replica wrapper is ``fully_shard``, which takes contiguous parameters only:
    with --channels-last the probe timed it on NHWC weights, and every channels-last profile of
    a convolutional model failed (``FSDP does not support non-contiguous parameters``), on a
    CPU and on a GPU alike."""
    import torch

    from partrain.profile.probe import _time_replica_wrapper

    args = {"model": "cnn", "input_shape": [1, 28, 28], "num_classes": 10, "options": {},
            "run": {"device": "cpu", "precision": "fp32", "channels_last": True, "compile": False}}
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    assert _time_replica_wrapper(args, x, y, steps=2) >= 0.0
