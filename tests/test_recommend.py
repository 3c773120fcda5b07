"""The recommender: never a plan that does not fit or run; serial when parallelism cannot pay."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from partrain.cli import main
from partrain.predict.cluster import load_cluster
from partrain.profile.cache import load_or_profile
from partrain.recommend import needed_batch_sizes, parse_bytes, recommend, worker_counts
from partrain.validate_recommend import kendall_tau

pytestmark = pytest.mark.alone  # profiles models and this machine, and trains what it picks: never beside another test (make test)

REPO = Path(__file__).resolve().parents[1]
CLUSTER = """
[cluster]
name = "{name}"
nodes = 1
workers_per_node = 4
device_memory_gb = {memory_gb}
shared_memory = false
compute_speed = {speed}
cores_per_node = 64
backend = "nccl"

[intra]
bandwidth_gb_per_s = {bandwidth}
latency_us = {latency_us}
"""


def cluster(tmp_path, name="fake", memory_gb=16, bandwidth=10.0, latency_us=5, speed=1.0):
    path = tmp_path / f"{name}.toml"
    path.write_text(CLUSTER.format(name=name, memory_gb=memory_gb, bandwidth=bandwidth, latency_us=latency_us, speed=speed))
    return path


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def mlp_profile(profile_dir, data_dir):
    sizes = sorted({int(b) for b in needed_batch_sizes(4, 64)})
    return load_or_profile("mlp", "mnist", sizes, 1, profile_dir, data_dir)[0]


def test_parse_bytes_and_worker_counts():
    assert parse_bytes("2GB") == 2 * 2**30 and parse_bytes("512 MiB") == 2**29 and parse_bytes("1000") == 1000
    assert worker_counts(8) == [1, 2, 4, 8] and worker_counts(6) == [1, 2, 4, 6] and worker_counts(1) == [1]
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0 and kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0


def test_a_very_slow_link_and_a_tiny_model_recommend_serial(tmp_path, mlp_profile):
    hw = load_cluster(cluster(tmp_path, bandwidth=0.001, latency_us=20000))  # 1 MB/s, 20 ms
    rec = recommend(lambda t: mlp_profile, hw, workers=4, batch_size=64)
    assert rec.winner.plan.strategy == "serial" and rec.winner.plan.workers == 1
    assert "No parallel plan beats serial here" in rec.explanation()


@pytest.fixture(scope="module")
def mlp_profile_512(profile_dir, data_dir):
    return load_or_profile("mlp", "mnist", sorted({int(b) for b in needed_batch_sizes(4, 512)}), 1, profile_dir, data_dir)[0]


def test_what_a_10x_slower_or_faster_link_changes_is_the_pick_on_that_link(tmp_path, mlp_profile_512):
    """The what-if moves the link's bytes 10x slower or faster and predicts every plan again:
    its answer is what recommend picks on that hardware. Latencies stay as they are."""
    from partrain.predict.comm import collective_time, with_link_bytes_scaled

    # at batch 512, not 64: at 64 the tiny mlp's fixed costs per step (DDP's hooks, the loop) left four
    # workers on the fastest link only 4-17% ahead of serial, and one CI profile had serial win on every
    # link; at 512 four DDP workers are predicted 2.2x faster than one on a fast link (25 ms against 56)
    # the mlp is timed on this machine, and where the winner changes moves with its speed and with how
    # two of its runs share the cores (measured too): the cluster computes a serial step in about 50 ms
    # whatever this machine's speed, and the link is the first, from slow to fast, whose what-if names
    # a change. At 10 kB/s any plan that sends a byte loses to serial, at 1 TB/s four workers beat one,
    # so the pick changes somewhere between, and the first link past that point has serial 10x slower
    # (profiles of this machine have put that point anywhere from under 1 MB/s to 20 MB/s)
    speed = sum(blk.fwd_s[-1] + blk.bwd_s[-1] for blk in mlp_profile_512.blocks) / 0.05
    links = [10.0 ** (e / 3) for e in range(-15, 10)]  # 1e-5 .. 1e3 GB/s, three to a decade
    for bandwidth in links:
        hw = load_cluster(cluster(tmp_path, bandwidth=bandwidth, latency_us=50, speed=speed))
        rec = recommend(lambda t: mlp_profile_512, hw, workers=4, batch_size=512)
        if bandwidth == links[0]:
            assert rec.winner.plan.strategy == "serial", rec.winner.plan
        if any(n.startswith("With a 10x") for n in rec.what_if):
            break
    else:
        pytest.fail(f"no link from 10 kB/s to 1 TB/s is near a turning point: {rec.what_if}")
    slower = with_link_bytes_scaled(hw, 10.0)
    fit, slow_fit = hw.links["intra"].segments[0], slower.links["intra"].segments[0]
    assert slow_fit.seconds_per_byte == pytest.approx(10 * fit.seconds_per_byte) and slow_fit.latency_s == fit.latency_s
    n = 1e6  # a cluster file's collectives come from its links: an allreduce pays the slower bytes, not its latency
    assert collective_time(slower, "allreduce", n, [0, 1]) - collective_time(slower, "allreduce", 0.5, [0, 1]) == \
        pytest.approx(10 * (collective_time(hw, "allreduce", n, [0, 1]) - collective_time(hw, "allreduce", 0.5, [0, 1])))
    for scale, words in ((10.0, "a 10x slower link"), (0.1, "a 10x faster link")):
        there = recommend(lambda t: mlp_profile_512, with_link_bytes_scaled(hw, scale), workers=4, batch_size=512).winner.plan
        said = [n for n in rec.what_if if n.startswith(f"With {words},")]
        if there == rec.winner.plan:
            assert not said
        else:
            assert said == [f"With {words}, {there.label()} on {there.workers} worker{'s' if there.workers > 1 else ''} would win."]


def test_a_plan_that_does_not_fit_the_memory_limit_is_never_recommended(tmp_path, mlp_profile):
    hw = load_cluster(cluster(tmp_path))
    free = recommend(lambda t: mlp_profile, hw, workers=2, batch_size=64)
    memories = sorted({p.memory_bytes_per_worker for p in free.ranked})
    limit = memories[-2]  # the plans that need the most memory no longer fit, the others do
    too_big = {p.plan for p in free.ranked if p.memory_bytes_per_worker > limit}
    assert too_big
    rec = recommend(lambda t: mlp_profile, hw, workers=2, batch_size=64, memory_limit=limit)
    assert all(p.memory_bytes_per_worker <= limit for p in rec.ranked)
    assert {p.plan for p in rec.ranked} == {p.plan for p in free.ranked} - too_big
    assert rec.winner.plan not in too_big
    reasons = {p: r for p, r in rec.rejected}
    assert all(reasons[plan].startswith("out of memory: needs ") for plan in too_big)


def test_a_model_too_big_for_one_device_gets_a_sharded_or_pipelined_plan(tmp_path, mlp_profile):
    hw = load_cluster(cluster(tmp_path))
    free = recommend(lambda t: mlp_profile, hw, workers=2, batch_size=64)
    serial = free.serial_for(64)
    rec = recommend(lambda t: mlp_profile, hw, workers=2, batch_size=64, memory_limit=serial.memory_bytes_per_worker - 1)
    assert rec.winner.plan.strategy in {"fsdp", "model-parallel", "gpipe", "1f1b", "hybrid"}
    assert not any(p.plan.strategy in ("serial", "ddp") for p in rec.ranked)  # full replicas do not fit


def test_a_pipeline_is_recommended_at_the_cut_it_was_predicted_at(tmp_path, mlp_profile):
    """``train`` cuts a pipeline by block times it takes at start-up, and two runs of one plan
    may cut differently: the recommended command pins the cut its prediction was made for."""
    import dataclasses

    from partrain.predict.pipeline import stage_bounds
    from partrain.predict.predictor import predict_plan

    hw = load_cluster(cluster(tmp_path))
    rec = recommend(lambda t: mlp_profile, hw, workers=2, batch_size=64)
    piped = [p for p in rec.ranked if p.plan.spec.pipelined and p.plan.workers > 1]
    assert {p.plan.strategy for p in piped} >= {"gpipe", "1f1b", "model-parallel"}
    for p in piped:
        free = dataclasses.replace(p.plan, split_points=None)
        assert p.plan.split_points == tuple(lo for lo, _ in stage_bounds(mlp_profile, free)[1:])
        assert predict_plan(mlp_profile, hw, free).seconds_per_step == p.seconds_per_step  # the same prediction
    assert all(p.plan.split_points is None for p in rec.ranked if p not in piped)
    args = dataclasses.replace(rec, ranked=[piped[0]]).train_args()
    assert args[args.index("--split-points") + 1] == ",".join(map(str, piped[0].plan.split_points))


def test_nothing_fits_is_one_clear_error(tmp_path, mlp_profile):
    from partrain.errors import PartrainError

    with pytest.raises(PartrainError, match="fits the memory limit"):
        recommend(lambda t: mlp_profile, load_cluster(cluster(tmp_path)), workers=2, batch_size=64, memory_limit=1000)


def test_json_is_complete_and_the_printed_command_runs_as_printed(tmp_path, profile_dir, data_dir, capsys):
    path = cluster(tmp_path)
    argv = ["recommend", "--model", "mlp", "--dataset", "mnist", "--workers", "2", "--batch-size", "64",
            "--cluster", str(path), "--profile-dir", str(profile_dir), "--data-dir", str(data_dir), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("winner", "ranked", "rejected", "explanation", "command", "torchrun_command", "hardware",
                "profile_seconds", "memory_limit_bytes", "objective"):
        assert key in out, key
    winner = out["winner"]
    for key in ("seconds_per_step", "seconds_per_epoch", "compute_s", "comm_s", "bubble_s", "memory_bytes_per_worker", "cli_args"):
        assert key in winner, key
    assert out["ranked"][0]["label"] == winner["label"]
    assert out["command"].startswith("partrain train --model mlp --dataset mnist")
    # run it exactly as printed (a few steps), through the installed module
    command = shlex.split(out["command"])[1:] + ["--steps", "3", "--no-eval", "--quiet", "--backend", "gloo"]
    proc = subprocess.run([sys.executable, "-m", "partrain", *command], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"mlp on mnist, {winner['plan']['strategy']} x{winner['plan']['workers']}")


def test_the_printed_command_trains_the_model_as_it_was_profiled(tmp_path, profile_dir, capsys):
    """Its options and generated data: without them the command trained another model than the one predicted."""
    argv = ["recommend", "--model", "tests.userfactory:build", "--dataset", "mnist", "--synthetic", "--model-option", "width=24",
            "--workers", "2", "--batch-size", "64", "--cluster", str(cluster(tmp_path)), "--profile-dir", str(profile_dir), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for command in (out["command"], out["torchrun_command"]):
        args = shlex.split(command)
        assert "--synthetic" in args and args[args.index("--model-option") + 1] == "width=24", command


@pytest.mark.slow
def test_run_trains_the_plan_it_printed(tmp_path, profile_dir, data_dir, capsys, measured_hardware):
    _, measured = measured_hardware  # this machine's profile of 3 workers, found where recommend looks
    for path in measured.glob("hardware-*.json"):
        shutil.copy(path, profile_dir)
    argv = ["recommend", "--model", "mlp", "--dataset", "mnist", "--workers", "3", "--batch-size", "64",
            "--profile-dir", str(profile_dir), "--data-dir", str(data_dir), "--json", "--run", "--steps", "20"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    measured = out["measured"]
    assert measured["steps"] == 20 and measured["seconds_per_step"] > 0
    assert measured["predicted_seconds_per_step"] == pytest.approx(
        out["winner"]["median_step_s"]) and measured["test_accuracy"] > 0.5


def test_recommendation_outcomes_score_the_pick_against_the_measured_fastest(capsys):
    from partrain.validate import Case
    from partrain.validate_recommend import recommendation_outcomes, summarize_outcomes

    def case(label, strategy, workers, measured, predicted, repeats):
        return Case(label, ("cnn", "mnist", 32, workers, 1), strategy, measured, predicted, 0, 0, 1.0, repeats)

    cases = [
        case("serial", "serial", 1, 0.020, 0.018, (0.019, 0.021)),
        case("ddp x2", "ddp", 2, 0.013, 0.010, (0.012, 0.014)),  # predicted fastest
        case("local-sgd x2", "local-sgd", 2, 0.012, 0.011, (0.0125, 0.0115)),  # measured fastest, repeats overlap ddp's
        case("ddp x1", "ddp", 1, 0.001, 0.001, (0.001, 0.001)),  # not a candidate: one worker means serial
    ]
    # as recommend ranks by default: local SGD (not serial training) is no candidate
    [outcome] = recommendation_outcomes(cases, max_workers=(2,))
    assert (outcome.plans, outcome.picked, outcome.best, outcome.regret) == (2, "ddp x2", "ddp x2", 0.0)
    # as recommend --async ranks
    [outcome] = recommendation_outcomes(cases, max_workers=(2,), include_async=True)
    assert (outcome.plans, outcome.picked, outcome.best) == (3, "ddp x2", "local-sgd x2")
    assert outcome.regret == pytest.approx(0.013 / 0.012 - 1) and outcome.tie
    assert outcome.tau == pytest.approx(1 / 3)  # pairs: (serial, ddp) +, (serial, lsgd) +, (ddp, lsgd) -
    # (ddp, lsgd) repeats overlap: a tie in the measured order, tau-b = 2 / sqrt(2 * 3)
    assert outcome.tau_within_noise == pytest.approx(2 / 6**0.5)
    summary = summarize_outcomes([outcome])
    assert summary["hit_rate"] == 0.0 and summary["hit_rate_within_noise"] == 1.0
    apart = [*cases[:2], case("local-sgd x2", "local-sgd", 2, 0.010, 0.011, (0.0099, 0.0101))]
    [outcome] = recommendation_outcomes(apart, max_workers=(2,), include_async=True)
    assert not outcome.tie and summarize_outcomes([outcome])["hit_rate_within_noise"] == 0.0


    # validate --recommendations reports both ways recommend can rank
    from partrain.commands.validate import _report_recommendations
    from partrain.validate import Report

    assert _report_recommendations(Report(apart, 1.0, []), as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["picked"] for g in out["synchronous"]["groups"]] == ["ddp x2"]
    assert out["synchronous"]["summary"]["hit_rate"] == 1.0
    assert [g["best"] for g in out["with_async"]["groups"]] == ["local-sgd x2"]
    assert out["with_async"]["summary"]["hit_rate"] == 0.0
    assert out["with_async"]["summary"]["profile_cost"] == pytest.approx(1.0 / 3)  # wall_s 1.0 per case
    # nothing to rank: the error says so, with why cells were left out where some were
    from partrain.errors import PartrainError

    with pytest.raises(PartrainError, match=r"two or more plans: .* \(skipped: 3 cells on 2x1 nodes at 1 Mbit/s: no "):
        _report_recommendations(Report(cases[:1], 1.0, ["3 cells on 2x1 nodes at 1 Mbit/s: no hardware profile"]), True)
