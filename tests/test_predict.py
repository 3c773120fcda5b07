"""The predictor: collective fits, the pipeline simulation, the memory model, per-strategy
predictions on a user factory and a cluster file, and validation against stored cells."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    _ComputationType,
)

from partrain.cli import build_parser, config_from_args, main
from partrain.config import RunConfig
from partrain.models import build_model
from partrain.predict import Plan, check_plan, compute, enumerate_plans, predict_plan
from partrain.predict.cluster import load_cluster
from partrain.predict.comm import collective_time, tier_of, transfer_time, with_link_bytes_scaled
from partrain.predict.compute import interpolate
from partrain.predict.data_parallel import ddp_buckets, overlapped_allreduce
from partrain.predict.fits import CostFit, Segment, fit_cost, longest_increasing
from partrain.predict.memory import (
    activation_bytes,
    block_input_bytes,
    optimizer_state_bytes,
    stage_state,
    transient_bytes,
)
from partrain.predict.pipeline import stage_bounds
from partrain.predict.pipeline_sim import PipelineCosts, StepWork, simulate
from partrain.predict.plan import profile_batch_sizes
from partrain.predict.prediction import environment
from partrain.predict.profiles import HardwareProfile
from partrain.predict.schedules import schedule_order
from partrain.profile.hardware import fit_compute_sharing
from partrain.profile.model import profile_model
from partrain.report.plots import plot_scatter
from partrain.validate import Report, row_config, spearman, validate

pytestmark = pytest.mark.alone  # profiles models and holds predictions against runs: never beside another test (make test)

EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


# ---- collective fits ----------------------------------------------------------------------


def test_fit_recovers_latency_and_bandwidth():
    rng = random.Random(0)
    latency, bandwidth = 40e-6, 2.5e9
    sizes = [16 * 4**k for k in range(12)]
    times = [(latency + n / bandwidth) * rng.uniform(0.98, 1.02) for n in sizes]
    fit = fit_cost(sizes, times)
    assert len(fit.segments) == 1
    seg = fit.segments[0]
    assert seg.latency_s == pytest.approx(latency, rel=0.03)
    assert seg.bandwidth == pytest.approx(bandwidth, rel=0.03)


def test_fit_goes_piecewise_where_one_line_does_not_fit():
    # a latency-bound protocol up to 64 KiB, another (slower start, faster links) beyond
    small, large = (5e-6, 0.5e9), (200e-6, 5e9)
    sizes = [16 * 4**k for k in range(12)]
    times = [(small[0] + n / small[1]) if n <= 65536 else (large[0] + n / large[1]) for n in sizes]
    fit = fit_cost(sizes, times)
    assert len(fit.segments) >= 2
    for n, t in zip(sizes, times):
        assert fit.time(n) == pytest.approx(t, rel=0.15)
    assert fit.segments[-1].bandwidth == pytest.approx(large[1], rel=0.05)


def test_the_large_messages_of_a_slow_link_get_their_own_segment():
    """A ping-pong over a 100 Mbit/s emulated link (profile --hardware, seconds): latency-bound
    below 4 KiB, the rate above. Cut one point at a time, 16 KiB-4 MiB shared one line whose
    slope the 16 KiB point held down, and 4 MiB came out at 220 ms."""
    points = [(16, 7.58e-05), (64, 1.317e-04), (256, 8.08e-05), (1024, 6.066e-04), (4096, 4.647e-04),
              (16384, 6.903e-04), (65536, 2.7722e-03), (262144, 1.69742e-02), (1048576, 8.28897e-02),
              (4194304, 3.460142e-01)]
    fit = fit_cost([n for n, _ in points], [t for _, t in points])
    for n, t in points[-3:]:  # (256 KiB still partly fits in the token bucket's burst)
        assert fit.time(n) == pytest.approx(t, rel=0.15)
    assert fit.segments[-1].bandwidth == pytest.approx(12.5e6, rel=0.1)  # 100 Mbit/s


def test_timings_are_made_monotone_before_the_fit():
    from partrain.predict.fits import monotone

    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    sizes = [16 * 4**k for k in range(8)]
    times = [1e-4 + n / 1e9 for n in sizes]
    times[-1] = 0.0  # a failed difference of two timings
    fit = fit_cost(sizes, times)
    assert fit.time(sizes[-1]) >= times[-2] * 0.5  # pooled with its neighbour, not fitted as free


@pytest.mark.parametrize("xs, kept", [
    ([0.05, 0.19, 0.49, 1.45], [0.05, 0.19, 0.49, 1.45]),  # as measured: every point, in order
    ([1.6, 0.19, 0.49, 1.45], [0.19, 0.49, 1.45]),  # the idle probe slowed by another job: dropped, not sorted in
    ([0.05, 0.19, 2.0, 1.45], [0.05, 0.19, 1.45]),  # one of two equally long runs: the one ending lower
    ([0.05, 0.05, 0.3], [0.05, 0.3]),  # x must rise
    ([], []),
])
def test_a_measured_curve_keeps_its_points_in_the_order_they_rise(xs, kept):
    points = [(x, 10.0 * i) for i, x in enumerate(xs)]  # y tells the points apart
    got = longest_increasing(points)
    assert [x for x, _ in got] == kept
    assert all(p in points for p in got) and [points.index(p) for p in got] == sorted(points.index(p) for p in got)


def test_costfit_dict_round_trip():
    fit = fit_cost([16, 1024, 65536, 2**22], [1e-5, 1.2e-5, 5e-5, 2e-3])
    assert CostFit.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit


def test_ring_allreduce_on_a_cluster_file():
    hw = load_cluster(EXAMPLE_CLUSTER)
    n, p = 100e6, 4
    alpha, beta = 5e-6, 150e9  # the example's intra-node link
    expected = 2 * (p - 1) / p * n / beta + 2 * (p - 1) * alpha  # Patarasuk & Yuan 2009
    assert collective_time(hw, "allreduce", n, [0, 1, 2, 3]) == pytest.approx(expected)
    across = collective_time(hw, "allreduce", n, [0, 4, 8, 12])  # one worker per node: the slower link
    assert across == pytest.approx(2 * 3 / 4 * n / 12.5e9 + 2 * 3 * 15e-6)
    assert transfer_time(hw, n, 3, 4) > transfer_time(hw, n, 2, 3) > 0 == transfer_time(hw, n, 1, 1)


def test_a_ring_across_nodes_is_paced_by_the_slower_link_it_crosses():
    """All 16 ranks of 4x4 cross both links; where the link within a node is the slower (an
    audit gave it 1 MB/s and DDP's prediction did not move), it paces the ring."""
    hw = load_cluster(EXAMPLE_CLUSTER)
    n, ranks = 100e6, list(range(16))
    fast_within = collective_time(hw, "allreduce", n, ranks)
    assert fast_within == pytest.approx(2 * 15 / 16 * n / 12.5e9 + 2 * 15 * 15e-6)  # the inter link, as before
    slow = dataclasses.replace(hw, links={**hw.links, "intra": CostFit.line(5e-6, 1e6)})
    assert collective_time(slow, "allreduce", n, ranks) == pytest.approx(2 * 15 / 16 * n / 1e6 + 2 * 15 * 5e-6)
    one_a_node = collective_time(slow, "allreduce", n, [0, 4, 8, 12])  # no hop within a node
    assert one_a_node == pytest.approx(2 * 3 / 4 * n / 12.5e9 + 2 * 3 * 15e-6)


def test_a_10x_slower_link_scales_the_wire_share_of_a_measured_collective_not_the_cpus():
    """What a 4-node allreduce costs per byte beyond its ring's 1.5 bytes per link at the
    link's own cost per byte is copying on the CPU: a link 10x slower leaves it as it was."""
    from partrain.predict.comm import with_link_bytes_scaled
    from partrain.predict.fits import Segment

    wire, copy = 0.8e-9, 1.0e-9  # issue 18's 10 Gbit/s veth: 0.81 ns a byte on the link, 2.35 for the allreduce
    link = CostFit((Segment(1024, 2.5e-4, 0.0), Segment(math.inf, 3.5e-4, wire)))
    allreduce = CostFit((Segment(256, 2.9e-3, 9e-6), Segment(math.inf, 2.9e-3, copy + 1.5 * wire)))
    hw = dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), nodes=4, workers_per_node=1, links={"inter": link},
                             collectives={"inter": {4: {"allreduce": allreduce, "sendrecv": link}}})
    slower, faster = with_link_bytes_scaled(hw, 10.0), with_link_bytes_scaled(hw, 0.1)
    big = slower.collectives["inter"][4]["allreduce"].segments[-1]
    assert big.seconds_per_byte == pytest.approx(copy + 15 * wire) and big.latency_s == 2.9e-3
    assert faster.collectives["inter"][4]["allreduce"].segments[-1].seconds_per_byte == pytest.approx(copy + 0.15 * wire)
    # a small-message segment whose slope is latency in disguise moves by its wire bytes at most
    assert slower.collectives["inter"][4]["allreduce"].segments[0].seconds_per_byte == pytest.approx(9e-6 + 9 * 1.5 * wire)
    assert slower.links["inter"].segments[-1].seconds_per_byte == pytest.approx(10 * wire)  # point to point: all wire
    assert slower.links["inter"].segments[0] == link.segments[0]  # latencies as measured
    n = 10e6
    assert collective_time(slower, "allreduce", n, [0, 1, 2, 3]) == pytest.approx(2.9e-3 + n * (copy + 15 * wire))


def test_a_stage_hop_pays_the_runtimes_measured_cost_on_any_link():
    """The two-stage probe's hop less its own link's point-to-point time is the pipelining
    runtime's cost per message; a hop between nodes pays it too, on its own link."""
    from partrain.predict.comm import stage_transfer_time

    hw = dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), pipeline_hop_s=3e-4, points={"pipeline": {"message_bytes": 512}})
    runtime = 3e-4 - transfer_time(hw, 512, 0, 1)  # ranks 0 and 1: the probe's pair, within a node
    n = 1e6
    assert stage_transfer_time(hw, 512, 0, 1) == pytest.approx(3e-4)  # the probe itself, given back
    assert stage_transfer_time(hw, n, 2, 3) == pytest.approx(runtime + transfer_time(hw, n, 2, 3))
    assert stage_transfer_time(hw, n, 3, 4) == pytest.approx(runtime + transfer_time(hw, n, 3, 4))  # across nodes
    assert stage_transfer_time(hw, n, 3, 4) > stage_transfer_time(hw, n, 2, 3)
    bare = dataclasses.replace(hw, pipeline_hop_s=None)  # a cluster file: no probe, the link alone
    assert stage_transfer_time(bare, n, 3, 4) == transfer_time(hw, n, 3, 4)
    assert stage_transfer_time(hw, n, 3, 3) == 0.0
    # a tuple of tensors is as many point-to-point sends: each one after the first pays the latency again
    latency = transfer_time(hw, 1, 3, 4)
    assert stage_transfer_time(hw, n, 3, 4, tensors=3) == pytest.approx(stage_transfer_time(hw, n, 3, 4) + 2 * latency)


def test_a_stage_hop_is_the_probes_hop_even_where_the_ping_pong_reads_slower():
    """Where the pair's ping-pong (timed beside busy workers) reads slower than the probe's
    whole hop, a message of the probe's size costs the hop, and a bigger one the hop plus its
    extra bytes on the link: the ping-pong's latency is not paid on top."""
    from partrain.predict.comm import stage_transfer_time

    slow = CostFit((Segment(math.inf, 1.4e-3, 1e-9),))  # 1.4 ms one way: waits for a core
    hw = dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), pipeline_hop_s=5e-4, links={"intra": slow},
                             collectives={"intra": {2: {"sendrecv": slow}}}, points={"pipeline": {"message_bytes": 512}})
    assert transfer_time(hw, 512, 0, 1) > 5e-4
    assert stage_transfer_time(hw, 512, 0, 1) == pytest.approx(5e-4)
    assert stage_transfer_time(hw, 1e6 + 512, 2, 3) == pytest.approx(5e-4 + 1e6 * 1e-9)
    assert stage_transfer_time(hw, 16, 2, 3) == pytest.approx(5e-4 - 496 * 1e-9)


def test_a_hardware_profile_measured_by_an_earlier_method_is_measured_again(tmp_path, monkeypatch):
    from partrain.predict.profiles import MEASUREMENT, HardwareProfile
    from partrain.profile import cache

    hw = dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), source="measured", nodes=2, workers_per_node=1)
    assert HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict()))).method == MEASUREMENT
    old = {k: v for k, v in hw.to_dict().items() if k != "method"}  # written before methods were numbered
    assert HardwareProfile.from_dict(old).stale
    assert not dataclasses.replace(hw, source="examples/cluster.toml", method=1).stale  # a description, not a measurement
    assert dataclasses.replace(hw, source="measured across 2 emulated nodes sharing 2 cores", method=1).stale
    path = cache.hardware_path(tmp_path, 2, 2, link_mbit=100)
    path.write_text(json.dumps(old))
    assert cache.hardware_across(2, 2, 100, tmp_path) is None  # bench measures that link again
    path.write_text(json.dumps(hw.to_dict()))
    assert cache.hardware_across(2, 2, 100, tmp_path) == hw
    local = cache.hardware_path(tmp_path, 2)
    local.write_text(json.dumps(old))
    monkeypatch.setattr("partrain.profile.hardware.profile_hardware", lambda workers, backend=None: hw)
    _, _, reused = cache.hardware_for(2, tmp_path)
    assert not reused and HardwareProfile.load(local).method == MEASUREMENT


def test_a_model_profile_measured_by_an_earlier_method_is_measured_again(tmp_path, monkeypatch, capsys, mlp_profile):
    """A model profile from before FSDP's loop was timed on a world of one would predict FSDP
    without its bookkeeping: the cache measures it again, as it does an old hardware profile."""
    from partrain.predict.profiles import MODEL_MEASUREMENT, ModelProfile
    from partrain.profile import cache

    assert "fsdp" in mlp_profile.world_of_one_s and mlp_profile.method == MODEL_MEASUREMENT
    old = {k: v for k, v in mlp_profile.to_dict().items() if k != "method"}
    assert ModelProfile.from_dict(old).stale and not ModelProfile.from_dict(mlp_profile.to_dict()).stale
    path = cache.profile_path(tmp_path, "mlp", "mnist", [4, 16], 1, synthetic=True)
    path.write_text(json.dumps(old))
    fresh = dataclasses.replace(mlp_profile, other_load=0.0)  # quiet, so kept, however busy the fixture's machine was
    monkeypatch.setattr("partrain.profile.model.profile_model", lambda *a, **k: fresh)
    profile, _, reused = cache.load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)
    assert not reused and profile is fresh and not ModelProfile.load(path).stale
    assert "measured by an earlier partrain" in capsys.readouterr().err
    assert cache.load_or_profile("mlp", "mnist", [4, 16], 1, tmp_path, synthetic=True)[2]  # now reused


def test_a_user_models_profile_is_keyed_by_its_source_and_its_whole_name(tmp_path, monkeypatch):
    """An edited factory is a new model to profile, not the cached one (a review: the cache reused
    the old profile); and ``pkg.mod:build_x`` and ``pkg.mod_build:x`` are two files, not one."""
    from partrain.profile import cache

    (tmp_path / "nets.py").write_text("def build(input_shape, num_classes):\n    return None\n")
    (tmp_path / "nets_build.py").write_text("x = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = lambda model: cache.profile_path(tmp_path, model, "mnist", [4], 1).name  # noqa: E731
    before = name("nets:build")
    assert before.startswith("model-nets+build-src") and name("nets:build") == before
    assert name("nets:build_x") != name("nets_build:x")
    (tmp_path / "nets.py").write_text("def build(input_shape, num_classes):\n    return 1\n")
    assert name("nets:build") != before
    # a module it imports is the model too: a sibling, or a package beside it ...
    edited = name("nets:build")
    (tmp_path / "nets_build.py").write_text("x = 1\n")
    assert name("nets:build") != edited
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / "__init__.py").write_text("")
    edited = name("nets:build")
    (tmp_path / "layers" / "conv.py").write_text("WIDTH = 8\n")
    assert name("nets:build") != edited
    # ... and in a package, any of its modules; a file elsewhere is not
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for init in ("pkg/__init__.py", "pkg/sub/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "pkg" / "sub" / "nets.py").write_text("def build(input_shape, num_classes):\n    return None\n")
    (tmp_path / "pkg" / "blocks.py").write_text("DEPTH = 2\n")
    in_package = name("pkg.sub.nets:build")
    (tmp_path / "pkg" / "blocks.py").write_text("DEPTH = 3\n")
    assert name("pkg.sub.nets:build") != in_package
    in_package = name("pkg.sub.nets:build")
    (tmp_path / "notes.py").write_text("y = 2\n")  # beside the package, not in it
    assert name("pkg.sub.nets:build") == in_package
    assert name("mlp") == f"model-mlp-mnist-b4-t1-{cache.fingerprint()}.json"  # the zoo's names as they were
    assert name("nosuchmodule:f").startswith("model-nosuchmodule+f-mnist")  # building it says what is wrong


def test_a_hardware_profile_timed_on_a_busy_machine_is_measured_again_and_not_kept(tmp_path, monkeypatch, capsys):
    from partrain.profile import cache

    hw = dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), source="measured")
    loads = iter([0.6, 0.05])
    monkeypatch.setattr("partrain.profile.hardware.profile_hardware",
                        lambda workers, backend=None: dataclasses.replace(hw, other_load=next(loads)))
    profile, path, reused = cache.hardware_for(2, tmp_path)
    assert (profile.other_load, reused, path) == (0.05, False, cache.hardware_path(tmp_path, 2))
    assert "measuring again" in capsys.readouterr().err
    path.unlink()
    loads = iter([0.7, 0.6])  # busy both times: the quieter is used, and not kept
    profile, path, _ = cache.hardware_for(2, tmp_path)
    assert profile.other_load == 0.6 and path is None and not list(tmp_path.glob("hardware-*"))
    assert "used once and not cached" in capsys.readouterr().err
    # a tenth of the CPU taken is measured again once; the quieter of the two is kept
    for first, second, kept in ((0.12, 0.03, 0.03), (0.11, 0.15, 0.11)):
        loads = iter([first, second])
        profile, path, reused = cache.hardware_for(2, tmp_path, refresh=True)
        assert (profile.other_load, reused, path) == (kept, False, cache.hardware_path(tmp_path, 2))
        assert "measuring again" in capsys.readouterr().err
    loads = iter([0.05])  # quiet at once: measured once
    assert cache.hardware_for(2, tmp_path, refresh=True)[0].other_load == 0.05


# ---- the pipeline simulation --------------------------------------------------------------


def _equal_stages(p: int, fwd: float = 1.0, bwd: float = 2.0) -> PipelineCosts:
    return PipelineCosts((fwd,) * p, (bwd,) * p, (0.0,) * p, (0.0,) * p)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 16)])
def test_textbook_bubble(schedule, p, m):
    sim = simulate(schedule_order(schedule, p, m), _equal_stages(p))
    assert sim.step_s == pytest.approx((m + p - 1) * 3.0)
    assert sim.bubble_fraction(0) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4)])
def test_interleaving_divides_the_bubble(p, v, m):
    sim = simulate(schedule_order("interleaved-1f1b", p, m, v), _equal_stages(p * v, 1.0 / v, 2.0 / v))
    assert sim.bubble_fraction(0) == pytest.approx((p - 1) / (v * m + p - 1))  # Narayanan et al. 2021


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 12)])
def test_activations_in_flight(p, m):
    gpipe = simulate(schedule_order("gpipe", p, m), _equal_stages(p))
    one_f_one_b = simulate(schedule_order("1f1b", p, m), _equal_stages(p))
    assert gpipe.max_in_flight == [m] * p
    assert one_f_one_b.max_in_flight == [min(m, p - s) for s in range(p)]
    assert max(one_f_one_b.max_in_flight) <= p


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 2, 12)])
def test_interleaved_order_is_torchs(p, v, m):
    rounds = max(1, m // p)
    for rank, ours in enumerate(schedule_order("interleaved-1f1b", p, m, v)):
        fake = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m)
        theirs = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
        kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
        theirs = [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in theirs if a is not None]
        assert [(a.kind, a.stage, a.mb) for a in ours] == theirs


def test_transfers_and_segments_lengthen_the_step():
    p, m = 2, 4
    base = simulate(schedule_order("1f1b", p, m), _equal_stages(p))
    slow_link = PipelineCosts((1.0,) * p, (2.0,) * p, (0.5, 0.0), (0.0, 0.5))
    assert simulate(schedule_order("1f1b", p, m), slow_link).step_s > base.step_s
    around = PipelineCosts((1.0,) * p, (2.0,) * p, (0.0,) * p, (0.0,) * p,
                           before=((StepWork("data", 1.0),), ()), after=((StepWork("optimizer", 0.5),), (StepWork("optimizer", 0.5),)))
    sim = simulate(schedule_order("1f1b", p, m), around)
    assert sim.busy[0]["data"] == pytest.approx(1.0)
    assert sim.busy[0]["optimizer"] == pytest.approx(0.5)
    assert sim.step_s >= base.step_s + 1.5


def test_messages_are_rendezvous():
    # the message moves once the receiver has posted its receive: a busy receiver pays the
    # latency after it gets there, not in parallel with its own work
    costs = PipelineCosts((1.0, 3.0), (1.0, 1.0), (0.5, 0.0), (0.0, 0.5))
    sim = simulate(schedule_order("gpipe", 2, 2), costs, steps=4)
    starts = {(r, k, mb): start for r, k, _, mb, start, _ in sim.spans}
    f0 = min(start for r, k, _, mb, start, _ in sim.spans if r == 1 and k == "F" and mb == 0)
    assert starts[(1, "F", 1)] == pytest.approx(f0 + 3.0 + 0.5)


def test_a_connection_carries_one_message_at_a_time_and_the_receive_notice_waits_behind_it():
    # 2 stages, 1F1B, a link-bound boundary (10 s on the wire, 1 s of compute an action). The
    # last stage sends micro-batch 0's gradient and then posts the receive of micro-batch 1's
    # activation (Schedule1F1B fuses them): the notice crosses behind the gradient, so the
    # activation arrives two wire times after that backward, not one. The measured cnn over
    # 100 Mbit/s (issue 18) did this: 1F1B stepped as slowly as GPipe, 263 against 273 ms.
    def spans(schedule: str, wire: float) -> tuple[float, dict]:
        costs = PipelineCosts((1.0, 1.0), (1.0, 1.0), (10.0, 0.0), (0.0, 10.0), wire_fwd=(wire, 0.0), wire_bwd=(0.0, wire))
        sim = simulate(schedule_order(schedule, 2, 4), costs)
        t0 = min(start for *_, start, _ in sim.spans)
        return sim.step_s, {(r, k, mb): (start - t0, end - t0) for r, k, _, mb, start, end in sim.spans if k in "FB"}

    free_step, free = spans("1f1b", 0.0)  # messages that never queue: both directions overlap
    step, queued = spans("1f1b", 10.0)
    assert free[1, "F", 1][0] == pytest.approx(free[1, "B", 0][1] + 10.0)
    assert queued[1, "F", 1][0] == pytest.approx(queued[1, "B", 0][1] + 20.0)
    assert (free_step, step) == (pytest.approx(60.0), pytest.approx(90.0))
    # GPipe's messages never cross a notice in flight: the wire changes nothing
    assert spans("gpipe", 10.0)[0] == pytest.approx(spans("gpipe", 0.0)[0]) == pytest.approx(step)


def _two_stage_spans(schedule: str, busy: float) -> tuple[float, dict]:
    """2 stages, 2 micro-batches: forwards 1 s, backwards 2 s, messages 0.1 s. Spans from the
    first forward of a steady-state step."""
    costs = PipelineCosts((1.0, 1.0), (2.0, 2.0), (0.1, 0.0), (0.0, 0.1))
    sim = simulate(schedule_order(schedule, 2, 2), costs, busy_sender_s=busy)
    t0 = min(start for *_, start, _ in sim.spans)
    return sim.step_s, {(r, k, mb): (start - t0, end - t0) for r, k, _, mb, start, end in sim.spans if k in "FB"}


def test_a_stage_woken_while_its_sender_computes_on_starts_late_until_the_sender_waits():
    """GPipe: stage 0 sends micro-batch 0 and computes its next forward at once, so stage 1,
    waiting, starts 0.5 s after the message is in; micro-batch 1's message moves once stage 1
    posts its receive, after its first forward, and stage 0 waits then (no delay); backwards
    alike, the other way. A delay longer than the
    sender's computing ends when the sender waits for anything (stage 0 at its first backward's
    receive, stage 1 at the step's end)."""
    step, spans = _two_stage_spans("gpipe", 0.0)
    assert step == pytest.approx(9.4)
    assert spans[1, "F", 0][0] == pytest.approx(1.1) and spans[0, "B", 0][0] == pytest.approx(5.3)
    step, spans = _two_stage_spans("gpipe", 0.5)
    assert spans[1, "F", 0][0] == pytest.approx(1.1 + 0.5)
    assert spans[1, "F", 1][0] == pytest.approx(spans[1, "F", 0][1] + 0.1)  # posted when F0 ends, no wake
    assert spans[0, "B", 0][0] == pytest.approx(spans[1, "B", 0][1] + 0.1 + 0.5)
    assert spans[0, "B", 1][0] == pytest.approx(spans[0, "B", 0][1] + 0.1)  # posted when B0 ends, no wake
    assert step == pytest.approx(9.4 + 2 * 0.5)
    step, spans = _two_stage_spans("gpipe", 100.0)
    assert spans[1, "F", 0][0] == pytest.approx(spans[0, "F", 1][1])  # stage 0 waits after its last forward
    assert spans[0, "B", 0][0] == pytest.approx(spans[1, "B", 1][1])  # stage 1 waits at the step's end
    assert step == pytest.approx(12.2)


def test_a_stage_that_receives_right_after_sending_lets_its_receiver_run():
    """1F1B: only the warm-up forward is sent by a stage that computes on (its second
    forward); every later message's sender posts a receive next and waits in gloo's
    rendezvous, so its receiver is not delayed."""
    free_step, free = _two_stage_spans("1f1b", 0.0)
    step, spans = _two_stage_spans("1f1b", 0.5)
    assert spans[1, "F", 0][0] == pytest.approx(free[1, "F", 0][0] + 0.5)
    assert spans[0, "B", 0][0] == pytest.approx(spans[1, "B", 0][1] + 0.1)
    assert spans[0, "B", 1][0] == pytest.approx(spans[1, "B", 1][1] + 0.1)
    assert (free_step, step) == (pytest.approx(9.3), pytest.approx(9.3 + 0.5))
    assert _two_stage_spans("1f1b", 100.0)[0] == pytest.approx(9.3 + 0.9)  # until stage 0's second forward ends


def test_the_busy_sender_delay_is_fitted_to_the_pair_probe_over_loaded_stages(cluster):
    """``fit_busy_sender`` finds the delay the simulation of the probe's GPipe and 1F1B runs
    (4 and 8 micro-batches, two loads) was given; a cost both schedules paid beyond their
    simulation (a per-step overhead, a slower spell of the machine over the probe's runs) does
    not move it, since it is fitted to GPipe's excess over 1F1B; 0 where the pair was not
    probed over loaded stages (a GPU, a profile before MEASUREMENT 16)."""
    from partrain.profile.pipeline_fits import fit_busy_sender

    action, step, hop, busy = 4e-5, 1.2e-3, 3e-4, 2.1e-3
    hw = dataclasses.replace(cluster, nodes=1, workers_per_node=2, cores_per_node=2, compute_sharing={}, sync_s={},
                             compute_speed=1.0, pipeline_action_s=action, pipeline_step_s=step, pipeline_hop_s=hop)

    def probed(extra: float):
        loaded = []
        for stage_s in ([(3e-4, 6e-4), (2e-4, 5e-4)], [(2e-3, 3.5e-3), (1e-3, 2.5e-3)]):
            costs = PipelineCosts(*(tuple(s[i] + action for s in stage_s) for i in (0, 1)), (hop, 0.0), (0.0, hop))
            loaded.append({"stage_s": stage_s, "message_bytes": 512, "steps": [
                {"schedule": s, "microbatches": m,
                 "step_s": step + extra + simulate(schedule_order(s, 2, m), costs, busy_sender_s=busy).step_s}
                for s in ("gpipe", "1f1b") for m in (4, 8)]})
        return dataclasses.replace(hw, points={"pipeline": {"stage_s": [(1e-5, 2e-5)] * 2, "steps": [],
                                                            "message_bytes": 512, "loaded": loaded}})

    assert fit_busy_sender(probed(0.0)) == pytest.approx(busy, abs=1e-4)
    assert fit_busy_sender(probed(3e-3)) == pytest.approx(busy, abs=1e-4)  # every run 3 ms longer
    assert fit_busy_sender(probed(-1e-3)) == pytest.approx(busy, abs=1e-4)
    assert fit_busy_sender(dataclasses.replace(hw, points={"pipeline": {"steps": []}})) == 0.0


@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_runtime_fit_recovers_its_constants(n):
    """The probe of 2 stages, and the one over every worker (4 here): the fit finds the step cost
    and the hop the simulation of its schedules was given."""
    from partrain.profile.pipeline_fits import fit_pipeline_runtime

    stage_s, action, step, hop = [(1e-4, 2e-4), (1e-4, 3e-4), (2e-4, 2e-4), (1e-4, 1e-4)][:n], 4e-5, 4e-4, 3e-4
    fwd = tuple(f + action for f, _ in stage_s)
    bwd = tuple(b + action for _, b in stage_s)
    runtime = ((StepWork("runtime", step),),) * n
    costs = PipelineCosts(fwd, bwd, (hop,) * (n - 1) + (0.0,), (0.0,) + (hop,) * (n - 1), after=runtime)
    probe = {"stage_s": stage_s, "steps": [
        {"schedule": s, "microbatches": m, "step_s": simulate(schedule_order(s, n, m), costs).step_s}
        for s in ("gpipe", "1f1b") for m in (4, 8)]}
    fitted_step, fitted_hop = fit_pipeline_runtime(probe, action)
    assert fitted_hop == pytest.approx(hop, rel=0.05)
    assert fitted_step == pytest.approx(step, rel=0.2)  # added to every step alike: close, not exact (it can overlap idle time)


@pytest.mark.parametrize("key, pp, nodes, ranks", [("pipeline_world", 4, 1, (0, 1, 2, 3)), ("pipeline_world", 4, 2, (0, 1, 2, 3)),
                                                   ("pipeline_side_by_side", 2, 1, (0, 2))])
def test_a_pipeline_probed_over_loaded_stages_gives_each_load_its_own_hop(cluster, key, pp, nodes, ranks):
    """A probe over stages that compute more (one pipeline over 4 workers, on one node or two,
    or a 2-stage one per pair of them at once): each fitted, with the probe's step cost and the
    cores shared as the predictor shares them (4 workers on 2 cores a node), to the hop its
    simulation was given, each message paying besides its own link's time for its bytes less
    the first probe's (over two nodes the middle one crosses the slower link); and paired with
    its stages' mean action time."""
    from partrain.predict.comm import wire_time
    from partrain.profile.pipeline_fits import fit_loaded
    from tests.probe_worker import simulated_world_probe

    action, step, dp = 4e-5, 3e-4, 4 // pp
    hw = dataclasses.replace(cluster, nodes=nodes, workers_per_node=4 // nodes, cores_per_node=2, compute_sharing={},
                             sync_s={}, compute_speed=1.0, pipeline_action_s=action, **{key: (step, 4e-4)})
    slowdown = lambda k: compute.contention(k * dp / nodes, cores=2)  # noqa: E731  (the other pipelines compute alike)

    def links(nbytes):  # per stage, ahead and back: the link's time beyond the first probe's, and on the wire
        hops = [[(nbytes, ranks[s], ranks[s + d]) if 0 <= s + d < pp else None for s in range(pp)] for d in (1, -1)]
        first = transfer_time(hw, 512, ranks[0], ranks[1])
        return (*([transfer_time(hw, *m) - first if m else 0.0 for m in msgs] for msgs in hops),
                *([wire_time(hw, *m) if m else 0.0 for m in msgs] for msgs in hops))

    loads = [(1e-5, 4e-4, 512), (2e-4, 9e-4, 2**14), (1e-3, 2.4e-3, 2**17)]  # (stage compute, hop, message bytes)
    shapes = [(1.0, 2.0), (1.2, 2.0), (1.0, 2.4), (0.8, 1.0)][:pp]
    probes = [simulated_world_probe([(t * f, t * b) for f, b in shapes], hop, step, action, slowdown, nbytes, links(nbytes))
              for t, hop, nbytes in loads]
    if nodes == 2:  # the middle message crosses the inter-node link, slower than the others'
        assert links(2**17)[0][1] > 10 * links(2**17)[0][0] > 0
    named = {"ranks": list(ranks)} if key == "pipeline_side_by_side" else {}  # the pair's; the world's are its stages'
    hw = dataclasses.replace(hw, points={key: {**probes[0], **named, "loaded": probes[1:]}})
    fitted = fit_loaded(hw, key)
    mean_action = lambda probe: sum(f + b for f, b in probe["stage_s"]) / (2 * pp) + action  # noqa: E731
    assert fitted[0] == (pytest.approx(mean_action(probes[0])), 4e-4)
    for (got_action, got_hop), probe, (_, hop, _) in zip(fitted[1:], probes[1:], loads[1:]):
        assert got_action == pytest.approx(mean_action(probe))
        assert got_hop == pytest.approx(hop, rel=0.05)
    assert fit_loaded(dataclasses.replace(hw, **{key: None}), key) == ()  # not probed


def test_processor_sharing_slows_concurrent_compute():
    # GPipe with one micro-batch per stage and no dependencies between ranks' steady work:
    # two ranks computing at once on one core take twice as long as on two cores
    p, m = 2, 8
    free = simulate(schedule_order("gpipe", p, m), _equal_stages(p), lambda k: compute.contention(k, cores=2))
    shared = simulate(schedule_order("gpipe", p, m), _equal_stages(p), lambda k: compute.contention(k, cores=1))
    assert shared.step_s > free.step_s * 1.5
    assert shared.step_s <= 2 * free.step_s + 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_sharing_slows_only_concurrent_compute(schedule):
    p, m = 2, 4
    alone = simulate(schedule_order(schedule, p, m), _equal_stages(p))
    # every action slowed by 1.5 whatever computes beside it: the whole timeline stretches by 1.5
    assert simulate(schedule_order(schedule, p, m), _equal_stages(p), lambda k: 1.5).step_s == pytest.approx(1.5 * alone.step_s)
    # slowed only while both ranks compute: the fill and drain, where one rank computes, stay at full speed
    pair = simulate(schedule_order(schedule, p, m), _equal_stages(p), lambda k: 1.5 if k > 1 else 1.0)
    assert alone.step_s < pair.step_s < 1.5 * alone.step_s


def test_measured_sharing_enters_pipeline_plans(mlp_profile, cluster):
    two_cores = dataclasses.replace(cluster, cores_per_node=2, workers_per_node=2, nodes=1, compute_speed=1.0)
    plan = Plan("1f1b", workers=2, batch_size=64, microbatches=4, schedule="1f1b", pp=2, threads=1)
    free = predict_plan(mlp_profile, dataclasses.replace(two_cores, compute_sharing={2: 1.0}), plan)
    shared = predict_plan(mlp_profile, dataclasses.replace(two_cores, compute_sharing={2: 1.5}), plan)
    assert free.seconds_per_step < shared.seconds_per_step < 1.5 * free.seconds_per_step



def test_nodes_that_share_a_machine_contend_for_its_cores_machine_wide(mlp_profile, cluster):
    """Emulated nodes on one machine: the busy workers of every node against the cores they all
    share, and the measured factor of as many workers side by side there. 4 nodes on 2 cores
    run 2 busy workers (a pipeline's other stages idle) at the measured 1.1, 4 at half a core
    each; 2 nodes on 2 cores pay the machine's factor for 2, where a core per node paid none."""
    four = dataclasses.replace(cluster, nodes=4, workers_per_node=1, cores_per_node=1, compute_speed=1.0,
                               shared_cores=2, compute_sharing={2: 1.1})
    plan = Plan("gpipe", workers=4, batch_size=64, microbatches=8, schedule="gpipe", pp=4, threads=1)
    env = environment(four, plan)
    busy_per_node = lambda k: k / env.nodes_used  # noqa: E731  (what the pipeline simulation passes)
    assert [env.sharing_slowdown(busy_per_node(k)) for k in (1, 2, 3, 4)] == pytest.approx([1.0, 1.1, 1.5, 2.0])
    own = environment(dataclasses.replace(four, shared_cores=0), plan)  # a core per node of its own
    assert [own.sharing_slowdown(busy_per_node(k)) for k in (1, 2, 3, 4)] == pytest.approx([1.0] * 4)
    # a pipeline of 2 nodes on 1 core: faster than each stage at half a core (its fill and drain
    # compute alone), slower than a core each
    two = dataclasses.replace(four, nodes=2)
    pipe = Plan("gpipe", workers=2, batch_size=64, microbatches=4, schedule="gpipe", pp=2, threads=1)
    one_core = dataclasses.replace(two, shared_cores=1, compute_sharing={})
    # (its blocks' back-to-back times alone: that two workers on one core also start their actions
    # from cold caches is tests/test_cold.py's)
    hot = dataclasses.replace(mlp_profile, blocks=[dataclasses.replace(b, fwd_cold_s=[], bwd_cold_s=[])
                                                   for b in mlp_profile.blocks])
    half_speed = predict_plan(hot, dataclasses.replace(one_core, shared_cores=0, compute_speed=0.5), pipe)
    shared = predict_plan(hot, one_core, pipe)
    alone = predict_plan(hot, dataclasses.replace(one_core, shared_cores=0), pipe)
    assert alone.seconds_per_step < shared.seconds_per_step < half_speed.seconds_per_step
    # data parallel on 2 nodes of 1 worker: the measured factor for the machine's 2 busy workers
    ddp = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    assert predict_plan(mlp_profile, two, ddp).compute_s == pytest.approx(
        1.1 * predict_plan(mlp_profile, dataclasses.replace(two, shared_cores=0), ddp).compute_s)


# ---- data parallel ------------------------------------------------------------------------


def test_ddp_buckets_fill_in_reverse():
    mib = 2**20
    buckets = ddp_buckets([3 * mib, 1 * mib, 2 * mib], cap_bytes=2 * mib)
    assert [n for n, _ in buckets] == [2 * mib, 2 * mib, 2 * mib]
    assert [first for _, first in buckets] == [2, 0, 0]  # the second bucket waits for block 0
    assert ddp_buckets([100, 200], cap_bytes=25 * mib) == [(300, 0)]


def test_overlapped_allreduce_hides_what_backward_covers():
    assert overlapped_allreduce([1.0, 3.0], [0.5, 0.5], backward_s=3.0) == pytest.approx(0.5)
    assert overlapped_allreduce([1.0, 1.5], [2.0, 2.0], backward_s=3.0) == pytest.approx(2.0)


def test_compute_sharing_fit_from_the_probe():
    probes = {"2": {"alone_s": 0.004, "together_s": 0.005, "synced_s": 0.0085},
              "3": {"alone_s": 0.004, "together_s": 0.0038, "synced_s": 0.0036}}
    sharing, sync, computed = fit_compute_sharing(probes, cores=1)
    assert sharing == pytest.approx({2: 1.25, 3: 1.0})  # side by side never counts as faster than alone
    assert computed == {2: 0.005, 3: 0.0038}  # what each worker computed side by side before the sync
    # more workers than cores: the whole difference, a tight loop's collective latency not taken off
    assert sync[2] == pytest.approx(0.0085 - 0.005)
    assert sync[3] == 0.0  # a window read faster with the sync than without: noise, no cost
    # with a core each, what the probe reads beyond computing is not a cost of its own
    # (and 3 workers on 2 cores time-slice them: the cores' 1.25 times 3 / 2)
    sharing2, sync2, _ = fit_compute_sharing(probes, cores=2)
    assert sharing2 == pytest.approx({2: 1.25, 3: 1.875}) and sync2 == {2: 0.0, 3: 0.0}


def test_compute_sharing_beyond_the_cores_is_the_cores_own_time_sliced():
    """4 workers on 2 cores: the cores' factor (1.1) times 4 / 2, whatever either window beyond the
    cores read: free-running workers against rank 0 alone (4.0), or synchronised ones against the
    cores' (12 ms / 5 ms, each call's allreduce in it)."""
    probes = {"4": {"alone_s": 0.004, "together_s": 0.016, "synced_s": 0.012},
              "2": {"alone_s": 0.004, "together_s": 0.0044, "synced_s": 0.005}}
    sharing, sync, computed = fit_compute_sharing(probes, cores=2)
    assert sharing == pytest.approx({2: 1.1, 4: 1.1 * 2})
    assert sync == {2: 0.0, 4: 0.0} and computed == {2: 0.0044, 4: 0.016}  # as before: the free-running window
    probes["4"]["synced_s"] = 0.004
    assert fit_compute_sharing(probes, cores=2)[0][4] == pytest.approx(2.2)
    assert fit_compute_sharing(probes, cores=4)[0][4] == pytest.approx(4.0)  # within the cores, against alone
    assert fit_compute_sharing(probes, cores=3)[0][4] == pytest.approx(4.0)  # beyond, but the cores' count not probed


def test_measured_sharing_never_beats_processor_sharing(mlp_profile, cluster):
    """A probe can catch whole short bursts between time slices; four busy single-threaded
    workers on two cores still get half a core each."""
    mlp_profile = dataclasses.replace(mlp_profile, world_of_one_s={})
    two_cores = dataclasses.replace(cluster, cores_per_node=2, workers_per_node=4, nodes=1, compute_speed=1.0)
    plan = Plan("ddp", workers=4, batch_size=64, dp=4, threads=1)
    fair = predict_plan(mlp_profile, dataclasses.replace(two_cores, compute_sharing={4: 2.0}), plan)
    lucky = predict_plan(mlp_profile, dataclasses.replace(two_cores, compute_sharing={4: 1.3}), plan)
    slower = predict_plan(mlp_profile, dataclasses.replace(two_cores, compute_sharing={4: 2.5}), plan)
    assert lucky.compute_s == pytest.approx(fair.compute_s)
    assert slower.compute_s == pytest.approx(fair.compute_s * 2.5 / 2.0)


def test_ddp_buckets_and_a_hybrids_replicas_cost_the_measured_plain_allreduce(mlp_profile, cluster):
    """DDP's buckets (and a hybrid's replica reduction) cost the profile's plain allreduce, with
    DDP's own work from the model profile's world of one; a profile measured before session 56
    may still hold ``ddp_allreduce``, DDP's allreduce timed apart, and it is not read."""
    mlp_profile = dataclasses.replace(mlp_profile, world_of_one_s={})  # comm is the collectives alone
    allreduce = CostFit.line(3e-4, 1e8)
    measured = dataclasses.replace(cluster, nodes=1, workers_per_node=2, collectives={"intra": {2: {
        "allreduce": allreduce, "broadcast": CostFit.line(1e-4, 1e9)}}})
    old = measured.to_dict()  # as a profile measured before session 56 was saved
    old["collectives"]["intra"]["2"]["ddp_allreduce"] = CostFit.line(5e-3, 1e7).to_dict()
    stale = type(measured).from_dict(json.loads(json.dumps(old)))
    assert set(stale.collectives["intra"][2]) == {"allreduce", "broadcast"}
    assert with_link_bytes_scaled(stale, 10.0).collectives  # the recommender's "10x slower link" reads it too
    ddp = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1, bucket_mb=1000)
    pred = predict_plan(mlp_profile, measured, ddp)
    # one bucket, ready only when backward ends: its whole allreduce is exposed
    assert pred.comm_s == pytest.approx(allreduce.time(mlp_profile.param_bytes), rel=1e-6)
    for plan in (ddp, Plan("hybrid", workers=2, batch_size=32, dp=2, pp=1, microbatches=2, threads=1)):
        assert predict_plan(mlp_profile, stale, plan).seconds_per_step == predict_plan(mlp_profile, measured, plan).seconds_per_step


def test_measured_sharing_and_sync_enter_data_parallel_steps(mlp_profile, cluster):
    """Compute side by side costs the measured sharing; every synchronisation after it (DDP's
    allreduce, local SGD's averaging, FSDP's collectives, a hybrid's replicas) the measured
    sync, which the collective probes, timing idle workers, do not hold."""
    mlp_profile = dataclasses.replace(mlp_profile, world_of_one_s={})  # no measured overheads: comm is the collectives
    plan = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    base = predict_plan(mlp_profile, cluster, plan)
    measured = dataclasses.replace(cluster, compute_sharing={2: 1.5}, sync_s={2: 0.002})
    pred = predict_plan(mlp_profile, measured, plan)
    assert pred.compute_s == pytest.approx(base.compute_s * 1.5)
    assert pred.comm_s - base.comm_s == pytest.approx(0.002)
    serial = Plan("serial", workers=1, batch_size=32, threads=1)
    assert predict_plan(mlp_profile, measured, serial).seconds_per_step == predict_plan(mlp_profile, cluster, serial).seconds_per_step
    unsynced = dataclasses.replace(measured, sync_s={})
    for other, paid in ((dataclasses.replace(plan, strategy="fsdp"), 0.002),
                        (dataclasses.replace(plan, strategy="local-sgd", average_every=1), 0.002),
                        (dataclasses.replace(plan, strategy="local-sgd", average_every=4), 0.002 / 4)):
        assert predict_plan(mlp_profile, measured, other).comm_s - predict_plan(mlp_profile, unsynced, other).comm_s \
            == pytest.approx(paid)
    hybrid = Plan("hybrid", workers=2, batch_size=32, pp=1, dp=2, microbatches=2, schedule="1f1b", threads=1)
    assert predict_plan(mlp_profile, measured, hybrid).seconds_per_step - \
        predict_plan(mlp_profile, unsynced, hybrid).seconds_per_step == pytest.approx(0.002)


def test_a_synchronisation_costs_the_share_of_the_probes_compute_that_a_step_computed(mlp_profile, cluster):
    """The probe timed its sync after ``sync_compute_s`` of compute side by side: a step that
    computes a quarter of that pays a quarter of it, one that computes more pays all of it,
    and one with no compute recorded (a cluster file, an older profile) all of it."""
    from partrain.predict.prediction import environment

    mlp_profile = dataclasses.replace(mlp_profile, world_of_one_s={})
    plan = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    whole = dataclasses.replace(cluster, compute_sharing={2: 1.0}, sync_s={2: 0.002})
    env = environment(dataclasses.replace(whole, sync_compute_s={2: 0.008}), plan)
    assert env.sync_after(0.002, 65536) == pytest.approx(0.0005)
    assert env.sync_after(0.02, 65536) == pytest.approx(0.002)
    assert environment(whole, plan).sync_after(1e-6, 65536) == pytest.approx(0.002)
    step = predict_plan(mlp_profile, whole, plan)
    computed = step.data_s + step.compute_s + step.optimizer_s  # each worker's step, side by side
    for long_ago in (computed * 4, computed / 2):
        scaled = predict_plan(mlp_profile, dataclasses.replace(whole, sync_compute_s={2: long_ago}), plan)
        assert step.comm_s - scaled.comm_s == pytest.approx(0.002 * (1 - min(1.0, computed / long_ago)))
    # local SGD averaging every 4 steps synchronises after 4 steps of compute
    local = dataclasses.replace(plan, strategy="local-sgd", average_every=4)
    quarter = dataclasses.replace(whole, sync_compute_s={2: computed * 4})
    assert predict_plan(mlp_profile, quarter, local).comm_s == pytest.approx(predict_plan(mlp_profile, whole, local).comm_s)


def test_with_a_core_each_a_step_pays_the_step_probes_sync_at_its_compute(mlp_profile, cluster):
    """With no more workers than cores, a synchronisation costs what the step probe measured
    after as much compute side by side (interpolated, held at its ends), less the sweep's
    allreduce of the probe's message, which the collective costs already hold: negative where
    a step pays less than the sweep's mean. Communication never goes below nothing."""
    mlp_profile = dataclasses.replace(mlp_profile, world_of_one_s={})
    plan = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    bare = dataclasses.replace(cluster, compute_sharing={2: 1.0}, sync_s={2: 0.0})
    probed = dataclasses.replace(bare, step_sync={2: {65536: ((0.002, 0.004), (0.0005, 0.001))}})
    fit = collective_time(probed, "allreduce", 65536, [0, 1])
    env = environment(probed, plan)
    assert env.sync_points == ((65536, ((0.0005, 0.001), (0.002, 0.004))),)  # sorted by compute
    assert env.sync_after(0.0001, 65536) == pytest.approx(0.001 - fit)  # held below the shortest compute
    assert env.sync_after(0.00125, 65536) == pytest.approx(0.0025 - fit)
    assert env.sync_after(1.0, 65536) == pytest.approx(0.004 - fit)  # and above the longest
    assert env.sync_after(0.00125, 2**30) == env.sync_after(0.00125, 16) == env.sync_after(0.00125, 65536)  # one size
    step = predict_plan(mlp_profile, bare, plan)
    computed = step.data_s + step.compute_s + step.optimizer_s
    paid = predict_plan(mlp_profile, probed, plan).comm_s - step.comm_s
    assert paid == pytest.approx(max(-step.comm_s, env.sync_after(computed, mlp_profile.param_bytes)))
    # a step probe that read far less than the sweep: the collectives cost nothing, never less
    cheap = dataclasses.replace(probed, step_sync={2: {65536: ((0.001, 0.0),)}})
    assert environment(cheap, plan).sync_after(0.001, 65536) == pytest.approx(-fit)
    for strategy in ("ddp", "local-sgd", "fsdp"):
        assert predict_plan(mlp_profile, dataclasses.replace(cheap, collectives={}), dataclasses.replace(plan, strategy=strategy)).comm_s >= 0.0
    # one worker, or a profile without the probe (a cluster file, a GPU): sync_s as before; nor nodes
    # that share one machine's cores, more busy workers than it has (emulated 2 x 2 nodes on 2 cores)
    assert environment(probed, Plan("serial", workers=1, batch_size=32, threads=1)).sync_points == ()
    emulated = dataclasses.replace(probed, nodes=2, workers_per_node=2, shared_cores=2)
    assert environment(emulated, Plan("ddp", workers=4, batch_size=32, dp=4, threads=1)).sync_points == ()
    assert environment(dataclasses.replace(emulated, shared_cores=4), Plan("ddp", workers=4, batch_size=32, dp=4, threads=1)).sync_points
    assert environment(bare, plan).sync_points == ()
    assert HardwareProfile.from_dict(json.loads(json.dumps(probed.to_dict()))).step_sync == probed.step_sync


def test_more_workers_than_cores_pay_the_step_probe_of_as_many_workers(cluster):
    """On one machine whose workers outnumber its cores (4 on 2) a synchronisation costs what
    the step probe of 4 workers paid after as much compute side by side (MEASUREMENT 25), less
    the sweep's allreduce over them; a profile without that probe (measured before it, a
    cluster file) pays ``sync_s`` in proportion to the compute, as before."""
    n = 65536
    plan = Plan("ddp", workers=4, batch_size=32, dp=4, threads=1)
    old = dataclasses.replace(cluster, nodes=1, workers_per_node=4, cores_per_node=2, shared_cores=0,
                              compute_sharing={2: 1.0, 4: 2.3}, sync_s={4: 0.002}, sync_compute_s={4: 0.008},
                              step_sync={2: {n: ((0.001, 0.0005),)}})
    assert environment(old, plan).sync_points == ()
    # half the compute the probe timed its cost after: half that cost
    assert environment(old, plan).sync_after(0.004, n) == pytest.approx(0.001)
    probed = dataclasses.replace(old, step_sync={**old.step_sync, 4: {n: ((0.001, 0.004), (0.004, 0.006))}})
    env = environment(probed, plan)
    fit = collective_time(probed, "allreduce", n, [0, 1, 2, 3])
    assert env.sync_after(0.0025, n) == pytest.approx(0.005 - fit)
    assert env.sync_after(0.1, n) == pytest.approx(0.006 - fit)  # held beyond the longest compute
    # two of those workers: the probe of two, not of four
    assert environment(probed, Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)).sync_after(0.001, n) == \
        pytest.approx(0.0005 - collective_time(probed, "allreduce", n, [0, 1]))


def test_a_step_probe_point_below_the_one_before_it_is_held_at_that_one(cluster):
    """What a step pays after computing rises with the compute: a probe's point below the
    point of less compute before it reads as that point (run92u's 2-worker probe: 1.39 ms
    after 0.7 ms of compute, 0.98 after 2.1, 1.83 after 7.7); the profile keeps what it measured."""
    n = 65536
    plan = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    dipped = ((0.0007, 0.00139), (0.0021, 0.00098), (0.0077, 0.00183))
    probed = dataclasses.replace(cluster, compute_sharing={2: 1.0}, sync_s={2: 0.0}, step_sync={2: {n: dipped}})
    env = environment(probed, plan)
    fit = collective_time(probed, "allreduce", n, [0, 1])
    assert env.sync_points == ((n, ((0.0007, 0.00139), (0.0021, 0.00139), (0.0077, 0.00183))),)
    assert env.sync_after(0.0021, n) == pytest.approx(0.00139 - fit)
    assert env.sync_after(0.0049, n) == pytest.approx(0.00161 - fit)  # halfway up to the last point
    assert probed.step_sync[2][n] == dipped


def test_a_synchronisation_pays_the_step_probe_at_its_own_bytes(mlp_profile, cluster):
    """The step probe reduces several message sizes: a synchronisation of n bytes between two
    probed sizes pays what the probe paid there, linear in the bytes, less the sweep's fit at n
    (the caller adds the fit back); beyond them the nearest size's excess over its fit. DDP's
    step waits on its last bucket, local SGD's on all the parameters at once, a hybrid's
    replicas on their stage's. A profile written before sizes were probed (one size beside
    ``step_sync_bytes``) reads as that one size."""
    mlp_profile = dataclasses.replace(mlp_profile, world_of_one_s={})
    plan = Plan("local-sgd", workers=2, batch_size=32, dp=2, threads=1)
    small, large = 2**16, 2**22
    probed = dataclasses.replace(cluster, compute_sharing={2: 1.0}, sync_s={2: 0.0},
                                 step_sync={2: {small: ((0.001, 0.002),), large: ((0.001, 0.010),)}})
    fit = {n: collective_time(probed, "allreduce", n, [0, 1]) for n in (small, large)}
    env = environment(probed, plan)
    assert env.sync_after(0.001, small) == pytest.approx(0.002 - fit[small])
    assert env.sync_after(0.001, large) == pytest.approx(0.010 - fit[large])
    middle = (small + large) // 2
    assert env.sync_after(0.001, middle) == pytest.approx(0.006 - collective_time(probed, "allreduce", middle, [0, 1]))
    assert env.sync_after(0.001, 16) == env.sync_after(0.001, small)  # the smallest size's excess over its fit
    assert env.sync_after(0.001, 2**30) == env.sync_after(0.001, large)
    # local SGD averages every parameter in one allreduce: what it pays moves with the bytes
    one = dataclasses.replace(probed, step_sync={2: {small: ((0.001, 0.002),)}})
    base = predict_plan(mlp_profile, one, plan)
    at_bytes = predict_plan(mlp_profile, probed, plan)
    assert at_bytes.comm_s - base.comm_s == pytest.approx(env.sync_after(base.data_s + base.compute_s + base.optimizer_s, mlp_profile.param_bytes)
                                                           - environment(one, plan).sync_after(0.0, small), rel=1e-6)
    # a profile of MEASUREMENT 19-22: one size for every group
    old = {**probed.to_dict(), "step_sync": {"2": [[0.001, 0.002]]}, "step_sync_bytes": small}
    assert HardwareProfile.from_dict(old).step_sync == {2: {small: ((0.001, 0.002),)}}


def test_a_plan_over_nodes_pays_the_step_probe_taken_across_them(cluster):
    """A profile across nodes keys its step probe over the whole world by the world's size, more
    workers than a node's: a plan over the nodes pays that one, less the sweep's allreduce over
    the same ranks (the link between nodes); a plan within one node its node's probe; a plan over
    nodes of a profile without the world's probe, its node's as before."""
    plan = Plan("ddp", workers=4, batch_size=32, dp=4, threads=1)
    n = 65536
    across = dataclasses.replace(cluster, nodes=2, workers_per_node=2, compute_sharing={2: 1.0}, sync_s={},
                                 step_sync={2: {n: ((0.001, 0.0005),)}, 4: {n: ((0.001, 0.003),)}})
    assert tier_of(across, [0, 1, 2, 3]) == "inter" and tier_of(across, [0, 1]) == "intra"
    world = collective_time(across, "allreduce", n, [0, 1, 2, 3])
    assert environment(across, plan).sync_after(0.001, n) == pytest.approx(0.003 - world)
    node = collective_time(across, "allreduce", n, [0, 1])
    two = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    assert environment(across, two).sync_after(0.001, n) == pytest.approx(0.0005 - node)
    without = dataclasses.replace(across, step_sync={2: {n: ((0.001, 0.0005),)}})
    assert environment(without, plan).sync_after(0.001, n) == pytest.approx(0.0005 - node)
    # one worker per node: the node has no probe of its own, the world's is the only one; it ran the
    # workers as the plan runs them, so it holds where 4 emulated nodes share 2 cores too
    single = dataclasses.replace(across, workers_per_node=1, nodes=4, step_sync={4: {n: ((0.001, 0.003),)}})
    paid = pytest.approx(0.003 - collective_time(single, "allreduce", n, [0, 1, 2, 3]))
    assert environment(single, plan).sync_after(0.001, n) == paid
    assert environment(dataclasses.replace(single, shared_cores=2), plan).sync_after(0.001, n) == paid


def test_fsdp_on_cpu_waits_for_every_units_collectives(mlp_profile, cluster):
    """On gloo nothing hides FSDP's collectives (no CUDA streams): each block with parameters
    costs one ``fsdp_unit`` as measured, plus FSDP's world-of-one bookkeeping once. On NCCL
    backward's gathers and reduce-scatters hide behind backward, its forward gathers do not."""
    unit, per_byte = 0.004, 2e-9
    fsdp_unit = CostFit((Segment(math.inf, unit, per_byte),))
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={}, nodes=1, workers_per_node=2,
                             collectives={"intra": {2: {**cluster.collectives.get("intra", {}).get(2, {}),
                                                        "fsdp_unit": fsdp_unit}}})
    profile = dataclasses.replace(mlp_profile, world_of_one_s={"serial": 0.010, "fsdp": 0.013})
    plan = Plan("fsdp", workers=2, dp=2, batch_size=32, threads=1)
    on_cpu = predict_plan(profile, dataclasses.replace(hw, backend="gloo"), plan)
    units = [blk.param_bytes for blk in profile.blocks if blk.param_bytes]
    assert len(units) >= 2
    assert on_cpu.comm_s == pytest.approx(sum(unit + n * per_byte for n in units) + 0.003)
    bare = predict_plan(dataclasses.replace(profile, world_of_one_s={}), dataclasses.replace(hw, backend="gloo"), plan)
    assert on_cpu.comm_s - bare.comm_s == pytest.approx(0.003)  # the bookkeeping, paid once
    on_gpu = predict_plan(profile, dataclasses.replace(hw, backend="nccl"), plan)
    forward_gathers = sum(collective_time(hw, "all_gather", n, [0, 1]) for n in units)
    assert on_gpu.comm_s == pytest.approx(forward_gathers + 0.003)  # the cluster's fast links: backward hides the rest
    assert on_gpu.comm_s < on_cpu.comm_s


def test_a_stage_of_several_blocks_costs_their_chain_not_their_sum(mlp_profile):
    """A stage runs its blocks as one chain with one backward call; each block timed alone paid
    its own. ``chain_s`` (every block as one chain) sets what a join saves: the whole model as
    one stage is the chain itself, value by value at the profiled sizes, a stage of k blocks
    saves k - 1 joins, and a profile without it sums the blocks."""
    blocks = [dataclasses.replace(b, fwd_s=[f, 2 * f], bwd_s=[2 * f, 4 * f], fwd_cold_s=[], bwd_cold_s=[])
              for b, f in zip(mlp_profile.blocks, (1e-4, 2e-4, 3e-4))]
    summed = dataclasses.replace(mlp_profile, blocks=blocks, loss_s=[0.0, 0.0], chain_s=[])
    # forward: 6e-4 summed, 5e-4 as a chain (5e-5 a join); backward 1.2e-3 and 0.8e-3 (2e-4 a join)
    chained = dataclasses.replace(summed, chain_s=[[5e-4, 8e-4], [1.1e-3, 2e-3]])
    whole = [(0, 3)]
    assert compute.stage_times(chained, whole, 4) == ([pytest.approx(5e-4)], [pytest.approx(8e-4)])
    assert compute.stage_times(chained, whole, 16) == ([pytest.approx(1.1e-3)], [pytest.approx(2e-3)])
    fwd, bwd = compute.stage_times(chained, [(0, 2), (2, 3)], 4)
    assert fwd == pytest.approx([3e-4 - 5e-5, 3e-4]) and bwd == pytest.approx([6e-4 - 2e-4, 6e-4])
    assert compute.stage_times(chained, whole, 10)[1] == pytest.approx([(8e-4 + 2e-3) / 2])  # interpolated
    assert compute.stage_times(summed, whole, 4) == ([pytest.approx(6e-4)], [pytest.approx(1.2e-3)])
    # a join never takes a stage below its dearest block (a chain timed in a slow spell)
    assert compute.stage_times(dataclasses.replace(summed, chain_s=[[1e-5, 1e-5], [1e-5, 1e-5]]), whole, 4)[1] \
        == [pytest.approx(6e-4)]
    # a serial step counts the blocks as the chain too: its parts are what the loop runs
    assert compute.parts_step(chained, 4, "sgd") - compute.parts_step(summed, 4, "sgd") == pytest.approx(-5e-4)


@pytest.mark.parametrize("measured", [True, False])
def test_pipeline_micro_batches_pay_gradient_accumulation_and_scaling(mlp_profile, cluster, measured):
    """Micro-batches after the first add their gradients into .grad, and the schedule divides
    them by M once a step: passes over the gradients costed as the profile's measured
    accumulation (``accumulate_s``), or, in a profile without it, as the plain SGD step."""
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={})
    base = dataclasses.replace(mlp_profile, world_of_one_s={},  # no loop overhead (one replica: no wrapper)
                               accumulate_s=0.0002 if measured else None)
    dearer = (dataclasses.replace(base, accumulate_s=0.0012) if measured else
              dataclasses.replace(base, optimizer_s={**base.optimizer_s, "sgd": base.optimizer_s["sgd"] + 0.001}))

    def extra(microbatches: int) -> float:  # one rank runs every action in turn: the step is their sum
        plan = Plan("hybrid", workers=1, batch_size=16, microbatches=microbatches, schedule="1f1b", threads=1)
        return predict_plan(dearer, hw, plan).seconds_per_step - predict_plan(base, hw, plan).seconds_per_step

    assert extra(4) == pytest.approx(0.001 * (3 + 2 / 3))  # 3 accumulations, one scaling (2/3 of a pass)
    assert extra(1) == pytest.approx(0.0, abs=1e-12)  # one micro-batch: nothing to add up or scale


def test_world_of_one_timings_are_reproduced_value_by_value(mlp_profile, cluster):
    """The profile's own training-loop timings on one worker are oracles: the predictions of
    those very plans must give them back, and the overheads they show carry to bigger worlds."""
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={})
    parts = compute.parts_step(mlp_profile, 4, "sgd-momentum")
    ran = {"serial": parts + 0.0005, "ddp": parts + 0.0015, "local-sgd": parts + 0.0025}
    prof = dataclasses.replace(mlp_profile, world_of_one_s=ran, world_of_one_batch=4, loop_s=[])  # the loop at b=4 only
    one = dict(workers=1, batch_size=4, threads=1)
    assert compute.loop_time(prof) == pytest.approx(0.0005)
    assert predict_plan(prof, hw, Plan("serial", **one)).seconds_per_step == pytest.approx(ran["serial"])
    assert predict_plan(prof, hw, Plan("ddp", dp=1, **one)).seconds_per_step == pytest.approx(ran["ddp"])
    assert predict_plan(prof, hw, Plan("local-sgd", dp=1, **one)).seconds_per_step == pytest.approx(ran["local-sgd"])
    # on two workers DDP's and the averager's own work is still there
    two = dict(workers=2, batch_size=32, dp=2, threads=1)
    bare = dataclasses.replace(mlp_profile, world_of_one_s={}, loop_s=[])
    for strategy, extra in (("ddp", 0.001), ("local-sgd", 0.002)):
        with_it = predict_plan(prof, hw, Plan(strategy, **two)).seconds_per_step
        without = predict_plan(bare, hw, Plan(strategy, **two)).seconds_per_step
        assert with_it - without == pytest.approx(0.0005 + extra)


def test_the_cpu_loop_grows_as_the_bare_loop_and_serial_steps_reproduce_it(mlp_profile, cluster):
    """The measured profile's loop on a CPU: partrain's loop at the smallest batch, then as the
    probe's bare loop (a new batch loaded each step) grows; a serial step at any profiled size is it."""
    from partrain.profile.model import _cpu_loop

    assert len(mlp_profile.loop_s) == len(mlp_profile.batch_sizes) and min(mlp_profile.loop_s) > 0
    assert mlp_profile.loop_s[0] == pytest.approx(mlp_profile.world_of_one_s["serial"])
    memory = {"world_of_one": {"serial": 0.010}, "bare_loop": [0.004, 0.009, 0.030]}
    assert _cpu_loop(memory) == pytest.approx([0.010, 0.015, 0.036])
    assert _cpu_loop({"world_of_one": {}, "bare_loop": [0.004]}) == []  # no anchor: not measured
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={})
    for b, loop in zip(mlp_profile.batch_sizes, mlp_profile.loop_s):
        serial = predict_plan(mlp_profile, hw, Plan("serial", workers=1, batch_size=b, threads=1))
        assert serial.seconds_per_step == pytest.approx(loop, rel=1e-9)


def test_each_micro_batch_pays_what_the_loop_pays_over_its_parts_at_that_size(mlp_profile, cluster):
    """Where the serial loop ran longer than its parts at a batch size by more than it did at the
    smallest (the whole step's activations outgrow the cache its blocks ran in alone), a
    pipeline's micro-batch of that size pays the difference, every pass: a one-worker pipeline of
    two micro-batches of 16 pays twice the loop's extra at 16. A loop faster than its parts adds
    nothing, and the smallest batch's excess (once a step) is not paid again per micro-batch."""
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={})
    parts = [compute.parts_step(mlp_profile, b, "sgd-momentum") for b in mlp_profile.batch_sizes]
    assert mlp_profile.batch_sizes == [4, 16]

    def with_loop(extra_at_16: float):
        return dataclasses.replace(mlp_profile, loop_s=[parts[0] + 0.0004, parts[1] + 0.0004 + extra_at_16])

    plan = Plan("hybrid", workers=1, batch_size=32, microbatches=2, schedule="1f1b", threads=1)
    flat = predict_plan(with_loop(0.0), hw, plan).seconds_per_step
    assert compute.in_step_factor(with_loop(0.0), 16) == pytest.approx(1.0)
    assert predict_plan(with_loop(0.0015), hw, plan).seconds_per_step - flat == pytest.approx(2 * 0.0015)
    assert predict_plan(with_loop(-0.0015), hw, plan).seconds_per_step == pytest.approx(flat)
    assert compute.in_step_factor(with_loop(0.0015), 4) == pytest.approx(1.0)
    on_gpu = dataclasses.replace(with_loop(0.0015), device="NVIDIA H100 80GB HBM3")  # its loop overlaps launches
    assert compute.in_step_factor(on_gpu, 16) == 1.0


def test_a_one_worker_pipeline_pays_the_runtime_measured_on_a_world_of_one(mlp_profile, cluster):
    """All stages on one worker: no hop, no other rank; what the pipelining runtime adds is the
    profile's hybrid loop on a world of one over its serial loop, less what the prediction
    counts apart: the gradient passes (accumulating the second micro-batch, scaling by 2) and
    the blocks (as one chain) and loss run as two micro-batches of half the rows instead of one batch."""
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={})
    passes = compute.gradient_pass_time(mlp_profile, range(len(mlp_profile.blocks))) * (1 + 2 / 3)

    def blocks_and_loss(b: int) -> float:
        fwd, bwd = compute.stage_times(mlp_profile, [(0, len(mlp_profile.blocks))], b)
        return fwd[0] + bwd[0]

    split = 2 * blocks_and_loss(2) - blocks_and_loss(4)  # each call's fixed cost paid twice
    assert split > 0
    ran = {"serial": 0.002, "hybrid": 0.002 + passes + split + 0.0007}
    prof = dataclasses.replace(mlp_profile, world_of_one_s=ran, world_of_one_batch=4)
    bare = dataclasses.replace(mlp_profile, world_of_one_s={"serial": 0.002})
    assert compute.world_of_one_pipeline_time(prof) == pytest.approx(0.0007)
    for m in (2, 4):
        plan = Plan("hybrid", workers=1, batch_size=16, microbatches=m, schedule="1f1b", threads=1)
        assert predict_plan(prof, hw, plan).seconds_per_step - predict_plan(bare, hw, plan).seconds_per_step \
            == pytest.approx(0.0007)
    two = Plan("gpipe", workers=2, batch_size=16, pp=2, microbatches=2, schedule="gpipe", threads=1)
    assert predict_plan(prof, hw, two).seconds_per_step == predict_plan(bare, hw, two).seconds_per_step  # the probe's


def test_hybrid_replicas_pay_the_measured_wrapper_shared_by_parameter_bytes(mlp_profile, cluster):
    """Stages replicated over dp > 1 run inside fully_shard: each rank pays the profile's
    whole-model wrapper cost times its stages' share of the parameter bytes; one replica is
    not wrapped and pays nothing."""
    hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={})
    bare = dataclasses.replace(mlp_profile, world_of_one_s={}, replica_wrapper_s=0.0)
    wrapped = dataclasses.replace(bare, replica_wrapper_s=0.004)

    def extra(**plan) -> float:
        plan = Plan("hybrid", batch_size=32, schedule="1f1b", threads=1, **plan)
        return predict_plan(wrapped, hw, plan).seconds_per_step - predict_plan(bare, hw, plan).seconds_per_step

    assert extra(workers=2, pp=1, dp=2, microbatches=2) == pytest.approx(0.004)  # one stage: the whole model
    assert extra(workers=2, pp=2, dp=1, microbatches=4) == 0.0
    # two stages: the step waits for both ranks' share; the first stage holds fc1, most of the bytes
    fc1 = mlp_profile.blocks[0].param_bytes / mlp_profile.param_bytes
    assert 0.004 * fc1 - 1e-9 <= extra(workers=4, pp=2, dp=2, microbatches=4) <= 0.004 + 1e-9


def test_replicas_pipelines_pay_the_probe_timed_on_every_worker_at_once(mlp_profile, cluster):
    """A hybrid's replicas run their pipelines side by side: where the hardware profile timed
    2-stage pipelines on every worker at once, their per-step cost and per-hop latency replace
    the one-pipeline probe's, and the step cost waits, once, rather than sharing the cores a
    second time. One replica, and a profile without that probe, keep the one-pipeline probe."""
    from partrain.predict.comm import stage_transfer_time
    from partrain.predict.pipeline import _pipeline_costs, stage_bounds
    from partrain.predict.profiles import HardwareProfile

    one = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={}, cores_per_node=1,
                              nodes=2, workers_per_node=2, pipeline_step_s=0.001, pipeline_hop_s=3e-4,
                              points={"pipeline": {"message_bytes": 512}})
    side = dataclasses.replace(one, pipeline_side_by_side=(0.010, 2e-3),
                               points={"pipeline": {"message_bytes": 512}, "pipeline_side_by_side": {"ranks": [0, 2]}})
    assert side.runtime_of(1) == one.runtime_of(1) == (0.001, 3e-4, (0, 1), False)
    assert side.runtime_of(2) == (0.010, 2e-3, (0, 2), True)
    assert one.runtime_of(2) == one.runtime_of(1)  # not measured: the one-pipeline probe
    assert HardwareProfile.from_dict(json.loads(json.dumps(side.to_dict()))) == side
    # one pipeline with a stage on each of the 4 workers takes the probe run that way, where it was
    world = dataclasses.replace(side, pipeline_world=(0.004, 5e-4))
    assert world.runtime_of(1, 4) == (0.004, 5e-4, (0, 1), True)
    assert world.runtime_of(1, 2) == one.runtime_of(1) and world.runtime_of(2, 2) == side.runtime_of(2)
    assert side.runtime_of(1, 4) == one.runtime_of(1)  # not measured: the one-pipeline probe
    assert HardwareProfile.from_dict(json.loads(json.dumps(world.to_dict()))) == world
    # probed over stages that compute more: the hop of stages that take as long as the plan's, held
    # at the ends of what was probed; no action time, or another plan, keeps what it had
    loaded = dataclasses.replace(world, pipeline_world_loaded=((1e-4, 5e-4), (1e-3, 2.3e-3)),
                                 pipeline_side_by_side_loaded=((1e-4, 2e-3), (2e-4, 3e-3)))
    assert loaded.runtime_of(1, 4, 5.5e-4) == (0.004, pytest.approx(1.4e-3), (0, 1), True)
    assert loaded.runtime_of(1, 4, 1e-5).hop_s == 5e-4 and loaded.runtime_of(1, 4, 0.1).hop_s == 2.3e-3
    assert loaded.runtime_of(2, 2, 1.5e-4) == (0.010, pytest.approx(2.5e-3), (0, 2), True)
    assert loaded.runtime_of(1, 4) == world.runtime_of(1, 4) and loaded.runtime_of(2, 2) == side.runtime_of(2)
    assert loaded.runtime_of(1, 2, 1e-3) == one.runtime_of(1)  # the two-stage probe: no loaded runs
    assert stage_transfer_time(loaded, 1e5, 1, 2, 1, 4, 5.5e-4) == pytest.approx(
        1.4e-3 - transfer_time(loaded, 512, 0, 1) + transfer_time(loaded, 1e5, 1, 2))
    assert HardwareProfile.from_dict(json.loads(json.dumps(loaded.to_dict()))) == loaded
    # a hop of the replicas: the side-by-side probe's latency less its own ranks' link (0 and 2: across nodes)
    n = 1e5
    assert stage_transfer_time(side, n, 1, 3, replicas=2) == pytest.approx(
        2e-3 - transfer_time(side, 512, 0, 2) + transfer_time(side, n, 1, 3))
    assert stage_transfer_time(side, n, 1, 3) == stage_transfer_time(one, n, 1, 3, replicas=2)

    hybrid = Plan("hybrid", workers=4, batch_size=64, pp=2, dp=2, microbatches=4, schedule="1f1b", threads=1)

    # rank 0 loads its batch in a fixed 0.5 ms, under the probes' 1 ms (the measured loading of the
    # fixture's 32 rows is near 1 ms itself, above it when the machine is slow)
    profile = dataclasses.replace(mlp_profile, data_s=[5e-4] * len(mlp_profile.batch_sizes))

    def runtime(hw, cpu: bool) -> float:  # rank 0's runtime work after its schedule, computing or waiting
        costs = _pipeline_costs(profile, hw, hybrid, stage_bounds(profile, hybrid), environment(hw, hybrid))
        return sum(w.seconds for w in costs.after[0] if w.name == "runtime" and w.cpu == cpu)

    # the side-by-side probe's 10 ms waits: computed, it would share the cores a second time; the
    # one-pipeline probe's 1 ms is the runtime's compute, shared with the busy workers in the simulation;
    # both less the loading of rank 0's 32 rows, which fills the wait (below)
    data = interpolate(profile.batch_sizes, profile.data_s, 32)
    assert runtime(side, cpu=False) == pytest.approx(0.010 - data) and runtime(one, cpu=False) == 0.0
    assert runtime(one, cpu=True) == pytest.approx(runtime(side, cpu=True) + 0.001 - data)
    assert predict_plan(profile, side, hybrid).seconds_per_step > predict_plan(profile, one, hybrid).seconds_per_step
    pipe = Plan("1f1b", workers=2, batch_size=64, pp=2, microbatches=4, schedule="1f1b", threads=1)
    assert predict_plan(profile, side, pipe) == predict_plan(profile, one, pipe)


def test_a_pipelines_data_loading_fills_the_runtimes_per_step_wait(mlp_profile, cluster):
    """The probe times the runtime's per-step cost over stages with their inputs in memory, where it
    is mostly one stage waiting on the other; in training, both end stages first load their batch,
    which fills that wait: each pays the cost less its loading, never below nothing."""
    from partrain.predict.pipeline import _pipeline_costs, stage_bounds

    plan = Plan("1f1b", workers=2, batch_size=64, pp=2, microbatches=4, schedule="1f1b", threads=1)

    def runtime(loading: float, cost: float) -> list[float]:  # each rank's runtime work after its schedule
        profile = dataclasses.replace(mlp_profile, data_s=[loading] * len(mlp_profile.batch_sizes))
        hw = dataclasses.replace(cluster, compute_speed=1.0, compute_sharing={}, sync_s={}, pipeline_step_s=cost,
                                 pipeline_hop_s=3e-4, points={"pipeline": {"message_bytes": 512}})
        costs = _pipeline_costs(profile, hw, plan, stage_bounds(profile, plan), environment(hw, plan))
        assert [sum(w.seconds for w in costs.before[r] if w.name == "data") for r in (0, 1)] == pytest.approx(
            [loading] * 2)  # both end stages load the batch
        return [sum(w.seconds for w in costs.after[r] if w.name == "runtime") for r in (0, 1)]

    def paid(loading: float, cost: float) -> list[float]:  # what the runtime's per-step cost adds
        return [a - b for a, b in zip(runtime(loading, cost), runtime(loading, 0.0))]

    assert paid(0.0, 0.002) == pytest.approx([0.002] * 2)
    assert paid(0.0015, 0.002) == pytest.approx([0.0005] * 2)
    assert paid(0.005, 0.002) == pytest.approx([0.0] * 2)


def test_interpolation_is_piecewise_linear_and_extrapolates():
    assert interpolate([8, 32], [1.0, 4.0], 16) == pytest.approx(2.0)
    assert interpolate([8, 32], [1.0, 4.0], 64) == pytest.approx(8.0)
    assert interpolate([8, 32], [1.0, 4.0], 4) == pytest.approx(0.5)
    assert interpolate([8], [2.0], 4) == pytest.approx(1.0)


# ---- memory -------------------------------------------------------------------------------


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


@pytest.mark.parametrize("optimizer,momentum", [("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)])
def test_memory_model_matches_torch_state(optimizer, momentum, mlp_profile):
    model = build_model("mlp", (1, 28, 28), 10)
    params = list(model.parameters())
    opt = torch.optim.Adam(params) if optimizer == "adam" else torch.optim.SGD(params, lr=0.1, momentum=momentum)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.arange(4)).backward()
    opt.step()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert optimizer_state_bytes(param_bytes, len(params), optimizer, momentum) == _state_bytes(opt)
    grads, state = stage_state(mlp_profile, 0, len(mlp_profile.blocks), optimizer, momentum)
    assert (grads, state) == (grad_bytes, _state_bytes(opt))


def test_gpipe_keeps_more_activations_than_1f1b(mlp_profile, cluster):
    common = dict(workers=2, batch_size=64, pp=2, microbatches=8)
    gpipe = predict_plan(mlp_profile, cluster, Plan("gpipe", schedule="gpipe", **common))
    ofob = predict_plan(mlp_profile, cluster, Plan("1f1b", schedule="1f1b", **common))
    recompute = predict_plan(mlp_profile, cluster, Plan("1f1b", schedule="1f1b", recompute=True, **common))
    assert gpipe.memory.activations > ofob.memory.activations >= recompute.memory.activations
    fsdp = predict_plan(mlp_profile, cluster, Plan("fsdp", workers=4, dp=4, batch_size=64))
    ddp = predict_plan(mlp_profile, cluster, Plan("ddp", workers=4, dp=4, batch_size=64))
    assert fsdp.memory.optimizer * 4 == pytest.approx(ddp.memory.optimizer, rel=0.01)


def test_transient_beyond_a_byte_per_byte_is_held_for_one_micro_batch(mlp_profile, cluster):
    """A step's transient memory is fitted per byte of activations. Up to one byte per byte is
    the gradients flowing back through what a stage holds (every micro-batch in flight); the
    rest is the computation's workspace, for the one micro-batch it computes at a time."""
    n = len(mlp_profile.blocks)
    acts = [activation_bytes(mlp_profile, 0, n, b) + block_input_bytes(mlp_profile, 0, b) for b in (4, 16)]
    gradients, momentum = stage_state(mlp_profile, 0, n, "sgd", 0.9)
    base = mlp_profile.baseline_rss_bytes + gradients + momentum
    # serial peaks of 1 MB fixed and 3 bytes per byte of activations, at both profiled batch sizes
    wide = dataclasses.replace(mlp_profile, batch_sizes=[4, 16],
                               train_peak_rss_bytes=[int(base + a + 2**20 + 3 * a) for a in acts])
    assert transient_bytes(wide, 8e6) == pytest.approx(2**20 + 3 * 8e6, rel=1e-3)  # all held, all computed
    assert transient_bytes(wide, 8e6, 1e6) == pytest.approx(2**20 + 8e6 + 2 * 1e6, rel=1e-3)
    narrow = dataclasses.replace(wide, train_peak_rss_bytes=[int(base + a + 2**20 + 0.5 * a) for a in acts])
    assert transient_bytes(narrow, 8e6, 1e6) == pytest.approx(2**20 + 0.5 * 8e6, rel=1e-3)  # no workspace beyond

    common = dict(workers=2, batch_size=64, pp=2, microbatches=8)
    gpipe = predict_plan(wide, cluster, Plan("gpipe", schedule="gpipe", **common))
    ofob = predict_plan(wide, cluster, Plan("1f1b", schedule="1f1b", **common))
    held = gpipe.memory.activations - ofob.memory.activations  # GPipe holds 8 micro-batches, 1F1B 2
    assert held > 0 and gpipe.memory.transient - ofob.memory.transient == pytest.approx(held, rel=0.05)


# ---- predictions --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_profile():
    return profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True)


@pytest.fixture(scope="module")
def factory_profile():
    return profile_model("tests.userfactory:build", "mnist", [4, 16], threads=1, synthetic=True)


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(EXAMPLE_CLUSTER)


def test_plans_that_would_shard_a_scalar_parameter_are_refused(factory_profile):
    # the model profile names the scalar; train refuses fsdp and a hybrid's replicas for it
    import dataclasses

    scalar = dataclasses.replace(factory_profile, scalar_parameter="gain")
    why = {p.label(): reason for p, reason in enumerate_plans(scalar, workers=4, batch_size=32, with_invalid=True)}
    refused = {label for label, reason in why.items() if reason and "parameter gain is a scalar" in reason}
    assert any(label.startswith("fsdp") for label in refused) and any("dp2" in label for label in refused)
    assert refused == {label for label in why if label.startswith("fsdp") or "dp2" in label or "dp4" in label}
    assert all(reason is None or "scalar" not in reason
               for _, reason in enumerate_plans(factory_profile, workers=4, batch_size=32, with_invalid=True))


def test_every_plan_on_a_user_factory(factory_profile, cluster):
    plans = enumerate_plans(factory_profile, workers=2, batch_size=32)
    strategies = {p.strategy for p in plans}
    assert {"ddp", "local-sgd", "fsdp", "gpipe", "1f1b", "model-parallel"} <= strategies
    for plan in plans:
        pred = predict_plan(factory_profile, cluster, plan)
        assert pred.seconds_per_step > 0 and pred.memory_bytes_per_worker > 0
        parts = pred.compute_s + pred.comm_s + pred.bubble_s + pred.optimizer_s + pred.data_s
        assert parts == pytest.approx(pred.seconds_per_step, rel=1e-6, abs=1e-9)
        assert pred.seconds_per_epoch == pytest.approx(pred.seconds_per_step * pred.steps_per_epoch)
        assert pred.fits(cluster.device_memory_bytes) and not pred.fits(1)
    # the factory has two blocks: no four-stage pipeline, and the reason says so
    reasons = dict(enumerate_plans(factory_profile, workers=4, batch_size=32, with_invalid=True))
    assert any("blocks" in (why or "") for why in reasons.values())


def test_plan_cli_args_round_trip(mlp_profile):
    for plan in enumerate_plans(mlp_profile, workers=4, batch_size=64):
        assert "--model" not in plan.cli_args() and "--dataset" not in plan.cli_args()
        args = build_parser().parse_args(["train", "--model", "mlp", *plan.cli_args()])
        assert Plan.from_config(config_from_args(args)) == plan, plan.label()


def test_check_plan_names_the_problem(mlp_profile):
    assert check_plan(mlp_profile, Plan("gpipe", workers=2, batch_size=30, pp=2, microbatches=4, schedule="gpipe"))
    assert check_plan(mlp_profile, Plan("ddp", workers=2, batch_size=64, dp=2)) is None


def test_profile_batch_sizes_cover_the_plans():
    assert profile_batch_sizes([8, 32, 64]) == [8, 32, 64]
    assert profile_batch_sizes([4, 8, 16, 32, 64]) == [4, 16, 64]
    assert profile_batch_sizes([6, 6]) == [4, 6]


def test_predict_cli_on_a_user_factory_and_a_cluster(tmp_path, capsys, monkeypatch):
    # a busy machine (other processes at 25% of the CPU or more) would profile twice and cache nothing:
    # its handling has its own tests; this one is about the factory, the cluster and the cache
    from partrain.profile import cache

    monkeypatch.setattr(cache, "BUSY_SHARE", float("inf"))
    status = main(["predict", "--model", "tests.userfactory:build", "--synthetic", "--workers", "4", "--batch-size", "32",
                   "--cluster", str(EXAMPLE_CLUSTER), "--profile-dir", str(tmp_path), "--threads", "1", "--json"])
    assert status == 0
    out = json.loads(capsys.readouterr().out)
    labels = {p["label"] for p in out["predictions"]}
    assert any(label.startswith("ddp") for label in labels) and any(label.startswith("hybrid") for label in labels)
    assert all(p["seconds_per_step"] > 0 for p in out["predictions"])
    assert len(list(tmp_path.glob("model-*.json"))) == 1  # profiled once, cached


def test_predict_says_why_no_plan_of_the_strategies_asked_can_run(tmp_path, capsys, monkeypatch):
    from partrain.profile import cache

    monkeypatch.setattr(cache, "BUSY_SHARE", float("inf"))
    common = ["predict", "--synthetic", "--workers", "2", "--cluster", str(EXAMPLE_CLUSTER), "--profile-dir",
              str(tmp_path), "--threads", "1"]
    assert main([*common, "--model", "tests.userfactory:plain", "--strategies", "warp"]) == 2
    assert "unknown strategy 'warp'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was measured
    # a plain module the tracer cannot split has no pipelines to predict: an empty table said nothing
    assert main([*common, "--model", "tests.gallery:untraceable", "--strategies", "gpipe"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("partrain: error: no plan of gpipe can run tests.gallery:untraceable on 2 worker(s)")
    assert "one block to the profiler" in line and "return (module, blocks)" in line
    assert main([*common, "--model", "tests.gallery:untraceable", "--strategies", "hybrid"]) == 2
    assert "hybrid on pp x dp" in capsys.readouterr().err
    assert main([*common, "--model", "tests.gallery:untraceable", "--strategies", "ddp,gpipe"]) == 0  # what can run, shown
    capsys.readouterr()
    # one the tracer splits is predicted like a model with blocks: its pieces are its blocks
    assert main([*common, "--model", "tests.userfactory:plain", "--strategies", "gpipe", "--json"]) == 0
    assert any(p["label"].startswith("gpipe") for p in json.loads(capsys.readouterr().out)["predictions"])


# ---- validation ---------------------------------------------------------------------------


def _row(cfg: RunConfig, seconds: float, memory: int, hardware: str) -> dict:
    run = {**cfg.to_dict(), "resolved": {"pp": cfg.dims.pp, "dp": cfg.dims.dp}}
    return {"status": "ok", "hardware_hash": hardware, "config": json.dumps({"cell": {}, "run": run}),
            "step_seconds_median": seconds, "peak_memory_per_worker": json.dumps([memory] * cfg.workers),
            "peak_memory_bytes": memory, "threads": 1, "wall_seconds": 10.0}


def test_validate_reports_errors_per_strategy(mlp_profile, cluster, tmp_path):
    configs = [RunConfig(model="mlp", strategy="ddp", workers=2), RunConfig(model="mlp", strategy="gpipe", workers=2),
               RunConfig(model="mlp", strategy="1f1b", workers=2)]
    truth = [predict_plan(mlp_profile, cluster, Plan.from_config(c)) for c in configs]
    rows = [_row(c, p.seconds_per_step * f, p.memory_bytes_per_worker, cluster.fingerprint)
            for c, p, f in zip(configs, truth, (1.0, 1.25, 0.8))]
    rows.append({**rows[0], "hardware_hash": "other machine"})
    report = validate(rows, lambda cfg, sizes: (mlp_profile, 2.0), lambda workers: cluster, cluster.fingerprint)
    assert len(report.cases) == 3
    assert report.mape("ddp") == pytest.approx(0.0, abs=1e-9)
    assert report.mape("gpipe") == pytest.approx(0.2)  # predicted 1 where 1.25 was measured
    assert report.mape("1f1b") == pytest.approx(0.25)
    assert report.memory_mape() == pytest.approx(0.0)
    assert report.worst(1)[0].strategy == "1f1b"
    assert report.profile_cost() == pytest.approx(2.0 / 30)
    assert plot_scatter(report, tmp_path / "scatter.png").stat().st_size > 0
    assert json.dumps(report.to_dict())


def test_validate_counts_a_configuration_once_at_the_median_of_its_repeats(mlp_profile, cluster):
    cfg = RunConfig(model="mlp", strategy="ddp", workers=2)
    truth = predict_plan(mlp_profile, cluster, Plan.from_config(cfg)).median_step_s
    rows = []
    for repeat, factor in enumerate((0.9, 1.0, 1.3)):
        row = _row(cfg, truth * factor, 100, cluster.fingerprint)
        row["config"] = json.dumps({**json.loads(row["config"]), "cell": {"strategy": "ddp", "repeat": repeat}})
        rows.append(row)
    report = validate(rows, lambda cfg, sizes: (mlp_profile, 1.0), lambda workers: cluster, cluster.fingerprint)
    (case,) = report.cases
    assert case.measured_s == pytest.approx(truth) and case.error == pytest.approx(0.0, abs=1e-9)
    assert case.repeats == pytest.approx((truth * 0.9, truth, truth * 1.3))
    assert report.noise_floor() == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert math.isnan(Report([], 0.0, []).noise_floor())


def test_validate_pairs_the_cells_that_ran_the_same_thing_under_two_names(mlp_profile, cluster):
    """A 2-worker hybrid (pp2 x dp1) runs its schedule's pipeline: the two cells are one run
    measured twice, predicted alike, and how far apart they measured is the noise under both."""
    from partrain.validate import twins

    def cfg(strategy, **kw):
        return RunConfig(model="mlp", strategy=strategy, workers=kw.pop("workers", 2), microbatches=4, **kw)

    configs = [cfg("1f1b"), cfg("hybrid", pp=2, dp=1, schedule="1f1b"), cfg("gpipe"),
               cfg("hybrid", pp=2, dp=1, schedule="gpipe"), cfg("hybrid", workers=4, pp=2, dp=2, schedule="1f1b"),
               cfg("gpipe", workers=4)]
    measured = (0.010, 0.012, 0.020, 0.020, 0.030, 0.015)
    rows = [_row(c, t, 100, cluster.fingerprint) for c, t in zip(configs, measured)]
    report = validate(rows, lambda cfg, sizes: (mlp_profile, 1.0), lambda workers: cluster, cluster.fingerprint)
    pairs = {(a.strategy, b.strategy, a.runs_as.split()[0]): apart for a, b, apart in twins(report.cases)}
    assert pairs == {("1f1b", "hybrid", "1f1b"): pytest.approx(0.002 / 0.011), ("gpipe", "hybrid", "gpipe"): 0.0}
    hybrid = next(c for c in report.cases if "pp2xdp1 1f1b" in c.label)
    pipeline = next(c for c in report.cases if c.strategy == "1f1b")
    assert hybrid.predicted_s == pipeline.predicted_s  # one run, one prediction
    assert twins([dataclasses.replace(c, runs_as="") for c in report.cases]) == []  # cases from before runs_as


def test_validate_predicts_the_stage_cut_the_run_chose(mlp_profile, cluster):
    cfg = RunConfig(model="mlp", strategy="gpipe", workers=2)
    row = _row(cfg, 0.01, 1, cluster.fingerprint)
    run = json.loads(row["config"])
    auto = stage_bounds(mlp_profile, Plan.from_config(cfg))
    chosen = 1 if auto[1][0] != 1 else 2  # a cut the profile's own balance would not make
    run["run"]["resolved"]["split_points"] = [chosen]
    row["config"] = json.dumps(run)
    assert row_config(row).split_points == [chosen]
    assert stage_bounds(mlp_profile, Plan.from_config(row_config(row)))[1][0] == chosen
    assert row_config(_row(cfg, 0.01, 1, cluster.fingerprint)).split_points is None  # none recorded: the profile's cut


def test_spearman():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(Report([], 0.0, []).mape())


def test_the_simulator_refuses_costs_that_are_not_finite_instead_of_waiting_forever():
    from partrain.predict.pipeline_sim import PipelineCosts

    with pytest.raises(ValueError, match="finite seconds"):
        PipelineCosts((0.01, float("nan")), (0.02, 0.02), (0.0, 0.0), (0.0, 0.0))


@pytest.mark.timeout(30)
def test_the_simulator_ends_when_a_cost_is_below_the_clocks_precision():
    """A stage of 1e20 s beside one of a microsecond: at a clock of ~1e20 adding the short one
    does not move it, which once left the event loop waiting for it forever."""
    huge = PipelineCosts((1e20, 1e-6), (1e20, 1e-6), (0.0, 0.0), (0.0, 0.0))
    sim = simulate(schedule_order("1f1b", 2, 4), huge)
    assert math.isfinite(sim.step_s) and sim.step_s == pytest.approx(8 * 1e20, rel=1e-6)


def test_validate_predicts_each_repeat_at_the_cut_it_chose(mlp_profile, cluster):
    """Repeats of one pipeline cell may cut its stages differently (the run balances by block
    times it takes at start-up): each is predicted at its own cut, and the case holds the
    median of those predictions beside the median of the measurements."""
    cfg = RunConfig(model="mlp", strategy="gpipe", workers=2, microbatches=4)
    at = {cut: predict_plan(mlp_profile, cluster, Plan.from_config(cfg.replace(split_points=[cut])))
          for cut in (1, 2)}
    assert at[1].median_step_s != at[2].median_step_s  # the two cuts are predicted apart
    rows = []
    for repeat, cut in enumerate((1, 2)):
        row = _row(cfg, 0.01 * (repeat + 1), 100, cluster.fingerprint)
        run = json.loads(row["config"])
        run["run"]["resolved"]["split_points"] = [cut]
        run["cell"] = {"strategy": "gpipe", "repeat": repeat}
        row["config"] = json.dumps(run)
        rows.append(row)
    report = validate(rows, lambda cfg, sizes: (mlp_profile, 1.0), lambda workers: cluster, cluster.fingerprint)
    (case,) = report.cases  # one configuration, two repeats
    assert case.measured_s == pytest.approx(0.015)
    assert case.predicted_s == pytest.approx((at[1].median_step_s + at[2].median_step_s) / 2)
    assert case.runs_as.endswith("cut [1] or [2]")
    # both repeats at one cut: that cut's prediction, as before
    for row in rows:
        run = json.loads(row["config"])
        run["run"]["resolved"]["split_points"] = [2]
        row["config"] = json.dumps(run)
    (case,) = validate(rows, lambda cfg, sizes: (mlp_profile, 1.0), lambda workers: cluster, cluster.fingerprint).cases
    assert case.predicted_s == pytest.approx(at[2].median_step_s) and case.runs_as.endswith("cut [2]")
