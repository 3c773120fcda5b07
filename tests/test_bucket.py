"""A policed link (a token bucket) between nodes: fitted from the send/recv sweep a hardware
profile measured, and how the pipeline simulation paces a stage's messages through it."""

import dataclasses
from pathlib import Path

import pytest

from partrain.predict.comm import Bucket, link_bucket
from partrain.predict.pipeline_sim import PipelineCosts, simulate
from partrain.predict.profiles import HardwareProfile
from partrain.predict.schedules import schedule_order

pytestmark = pytest.mark.alone  # measures a policed link: never beside another test (make test)

SIZES = [16 * 4**k for k in range(10)]  # 16 B .. 4 MiB, as profile --hardware sweeps them


def _hardware(one_way, nodes: int = 2, per_node: int = 1) -> HardwareProfile:
    sweep = [[s, one_way(s)] for s in SIZES]
    return HardwareProfile("d", "test", "gloo", nodes, per_node, 1, 1 << 30, True,
                           points={"inter": {str(nodes): {"sendrecv": sweep}}})


def test_the_burst_and_rate_of_a_token_bucket_are_fitted_from_the_sweep():
    # 100 Mbit/s with 12.5 kB of burst (issue 18's tbf): a message crosses in its latency while the
    # bucket holds it, the rest at the rate
    rate, burst, latency = 8e-8, 12_500, 1.4e-4
    bucket = link_bucket(_hardware(lambda s: latency + max(0, s - burst) * rate), 0, 1)
    assert bucket.rate_s_per_byte == pytest.approx(rate)
    assert bucket.burst_bytes == pytest.approx(burst, rel=0.01)
    # 4 nodes: the sweep over all of them, a rank on the first node to one on the third
    assert link_bucket(_hardware(lambda s: latency + max(0, s - 125_000) * rate / 10, nodes=4), 0, 2).burst_bytes \
        == pytest.approx(125_000, rel=0.01)


def test_a_slower_link_asked_of_the_recommender_keeps_the_burst_at_that_much_the_rate():
    from partrain.predict.comm import with_link_bytes_scaled

    from partrain.predict.fits import CostFit, Segment

    hw = dataclasses.replace(_hardware(lambda s: 1.4e-4 + max(0, s - 12_500) * 8e-8),
                             links={"inter": CostFit((Segment(float("inf"), 1.4e-4, 8e-8),))})
    slower = link_bucket(with_link_bytes_scaled(hw, 10.0), 0, 1)
    assert slower.burst_bytes == pytest.approx(12_500, rel=0.01)
    assert slower.rate_s_per_byte == pytest.approx(8e-7)
    assert link_bucket(hw, 0, 1).rate_s_per_byte == pytest.approx(8e-8)  # the measured profile untouched


def test_a_link_that_serialises_every_message_or_none_measured_has_no_bucket():
    real = _hardware(lambda s: 1.4e-4 + s * 8e-8)
    assert link_bucket(real, 0, 1) is None  # every byte at the rate: a real link
    assert link_bucket(_hardware(lambda s: 1.4e-4 + max(0, s - 2000) * 8e-8), 0, 1) is None  # a frame or so: nothing
    within = _hardware(lambda s: 1.4e-4 + max(0, s - 12_500) * 8e-8, nodes=2, per_node=2)
    assert link_bucket(within, 0, 1) is None  # ranks 0 and 1 share a node
    assert link_bucket(within, 1, 2) is not None
    bare = HardwareProfile("d", "file", "nccl", 2, 1, 1, 1 << 30, False)  # a cluster file: no sweep
    assert link_bucket(bare, 0, 1) is None


def test_a_bucket_lets_its_credit_through_at_once_and_the_rest_at_the_rate():
    bucket = Bucket(burst_bytes=100.0, rate_s_per_byte=0.01)
    assert bucket.wire(80, credit=100) == 0.0
    assert bucket.wire(150, credit=100) == pytest.approx(0.5)
    assert bucket.wire(150, credit=-5) == pytest.approx(1.5)


def _costs(bucket: Bucket | None, forward: float = 1.0, nbytes: float = 150.0) -> PipelineCosts:
    """2 stages, forwards of ``forward`` s and 1 s backwards; each message 0.2 s of runtime plus
    1.5 s on the wire as the sweep's fit prices it (150 bytes at 0.01 s a byte)."""
    wire = nbytes * 0.01
    policed = ((bucket, nbytes), None) if bucket else ()
    return PipelineCosts((forward, forward), (1.0, 1.0), (0.2 + wire, 0.0), (0.0, 0.2 + wire), wire_fwd=(wire, 0.0),
                         wire_bwd=(0.0, wire), bucket_fwd=policed, bucket_bwd=tuple(reversed(policed)))


def _spans(costs: PipelineCosts, schedule: str) -> tuple[float, dict]:
    sim = simulate(schedule_order(schedule, 2, 4), costs)
    return sim.step_s, {(r, k, mb): (start, end) for r, k, _, mb, start, end in sim.spans if k in "FB"}


def test_spaced_messages_find_the_bucket_refilled_close_ones_pay_the_rate():
    bucket = Bucket(burst_bytes=100.0, rate_s_per_byte=0.01)  # refills 100 bytes a second
    # 1F1B: a gradient goes back every 2 s or more: each finds the bucket full and pays 0.5 s
    # of its 150 bytes on the wire, not the fit's 1.5 s
    _, spans = _spans(_costs(bucket), "1f1b")
    assert spans[0, "B", 1][0] == pytest.approx(spans[1, "B", 1][1] + 0.2 + 0.5)
    # GPipe with 0.1 s forwards: the first message pays 0.5 s, and each next one moves when the
    # receiver has posted its receive, 0.3 s after the one before left the wire (its hop's
    # runtime, then a forward): the bucket has 30 bytes again, and 120 go at the rate
    _, spans = _spans(_costs(bucket, forward=0.1), "gpipe")
    arrivals = [spans[1, "F", m][0] for m in range(4)]
    assert arrivals[0] == pytest.approx(spans[0, "F", 0][1] + 0.2 + 0.5)
    assert [b - a for a, b in zip(arrivals[1:], arrivals[2:])] == pytest.approx([0.1 + 0.2 + 1.2] * 2)


def test_a_bucket_that_never_holds_enough_is_the_links_fit():
    # a burst far below every message and the fit's own rate: the same schedule as without one
    none = Bucket(burst_bytes=0.0, rate_s_per_byte=0.01)
    for schedule in ("gpipe", "1f1b"):
        assert _spans(_costs(none), schedule)[0] == pytest.approx(_spans(_costs(None), schedule)[0])
        assert _spans(_costs(Bucket(1e9, 0.01)), schedule)[0] < _spans(_costs(None), schedule)[0]


def test_a_pipeline_between_nodes_behind_a_policed_link_is_predicted_through_its_bucket():
    """The plan's messages between nodes carry the link's bucket into the simulation; spaced
    1F1B messages inside the burst cross faster than the link's fit prices them."""
    from partrain.predict.cluster import load_cluster
    from partrain.predict.fits import CostFit, Segment
    from partrain.predict.pipeline import simulate_plan
    from partrain.predict.plan import Plan
    from partrain.profile.model import profile_model

    profile = profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True)
    rate, latency = 8e-8, 1.4e-4  # 100 Mbit/s
    slow = CostFit((Segment(float("inf"), latency, rate),))
    base = dataclasses.replace(load_cluster(Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"), nodes=2, workers_per_node=1, compute_speed=1.0,
                               links={"intra": slow, "inter": slow}, collectives={})

    def swept(burst: float):
        sweep = [[s, latency + max(0, s - burst) * rate] for s in SIZES]
        return dataclasses.replace(base, points={"inter": {"2": {"sendrecv": sweep}}})

    plan = Plan(strategy="1f1b", workers=2, batch_size=16, pp=2, dp=1, microbatches=4, schedule="1f1b", threads=1)
    policed, serialising = simulate_plan(profile, swept(12_500), plan), simulate_plan(profile, swept(0), plan)
    assert link_bucket(swept(12_500), 0, 1) is not None and link_bucket(swept(0), 0, 1) is None
    assert policed.step_s < serialising.step_s
