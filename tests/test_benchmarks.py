"""The benchmark scripts' workers still start: they join partrain's local rendezvous.

``benchmarks/overhead.py``'s hand-written DDP loop once read ``MASTER_ADDR``, which
``spawn`` does not set (its workers meet in a private FileStore), and failed at once with no
test to say so. These run each script's multi-process worker for a few steps on 2 gloo
workers, with a timeout.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from partrain.distributed.spawn import spawn

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def benchmarks(monkeypatch):
    """Imports a benchmark script by name: from ``benchmarks/`` on the path, which spawned
    workers inherit, so that they can unpickle its worker function."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


@pytest.mark.timeout(120)
def test_p2p_wake_times_every_exchange_on_both_workers(benchmarks):
    bench = benchmarks("p2p_wake")
    exchanges = bench.WARMUP + 5
    by_rank = spawn(bench.exchange_worker, ([0.0, 0.2], exchanges), 2)
    assert sorted(by_rank) == [0, 1]
    for times in by_rank.values():
        assert sorted(times) == [0.0, 0.2]
        assert all(len(pairs) == 5 and all(done >= posted for posted, done in pairs) for pairs in times.values())
    rows = bench.summarize(by_rank)
    assert [r["compute_ms"] for r in rows] == [0.0, 0.2]
    for r in rows:  # two workers' latencies per exchange
        assert r["exchanges"] == 10 and 0 <= r["median_ms"] <= r["p90_ms"]


@pytest.mark.timeout(180)
def test_overheads_hand_written_ddp_loop_trains_on_two_workers(benchmarks, data_dir):
    bench = benchmarks("overhead")
    by_rank = spawn(bench.plain_ddp_worker, ("mlp", 64, 3, str(data_dir)), 2)
    assert sorted(by_rank) == [0, 1]
    assert all(len(seconds) == 3 and min(seconds) > 0 for seconds in by_rank.values())


def test_host_speed_summary_against_hand_computed_slowdowns(benchmarks):
    bench = benchmarks("host_speed")
    # core 0 fast at 10 ms, slow (15 ms) in slots 2 and 3; core 1 steady at 20 ms but slow in slot 3
    # and 4 (24 ms); core 2 never reached its first slot and is left out
    series = {0: {0: 0.010, 1: 0.010, 2: 0.015, 3: 0.015, 4: 0.010},
              1: {0: 0.020, 1: 0.020, 2: 0.020, 3: 0.024, 4: 0.024}, 2: {}}
    s = bench.summarize(series)
    assert sorted(s["cores"]) == [0, 1]
    c0, c1 = s["cores"][0], s["cores"][1]
    assert c0["fast_ms"] == pytest.approx(10.0) and c1["fast_ms"] == pytest.approx(20.0)
    assert c0["mean_slowdown"] == pytest.approx((1 + 1 + 1.5 + 1.5 + 1) / 5)
    assert c1["mean_slowdown"] == pytest.approx((1 + 1 + 1 + 1.2 + 1.2) / 5)
    assert c0["slow_share"] == pytest.approx(2 / 5) and c1["slow_share"] == pytest.approx(2 / 5)
    assert s["serial"] == pytest.approx((1.2 + 1.08) / 2)
    # the slowest core of each slot: 1, 1, 1.5, 1.5, 1.2
    assert s["synchronous"] == pytest.approx((1 + 1 + 1.5 + 1.5 + 1.2) / 5)
    assert s["slots_together"] == 5


@pytest.mark.timeout(180)
def test_host_speed_times_every_core_at_once(benchmarks):
    bench = benchmarks("host_speed")
    series = bench.measure("mlp", "mnist", 16, seconds=2.0, slot=0.25)
    assert set(series) == set(os.sched_getaffinity(0))
    # most of the 8 slots have steps in them, each a positive time (a core another process
    # holds for a while may lose a slot or two)
    for slots in series.values():
        assert set(slots) <= set(range(8)) and len(slots) >= 4 and min(slots.values()) > 0
    s = bench.summarize(series)
    assert s["synchronous"] >= 1.0 and s["serial"] >= 1.0 - 1e-9


def test_cold_actions_reads_each_ranks_forward_and_backward_spans_after_the_warm_up(benchmarks, tmp_path):
    bench = benchmarks("cold_actions")
    events = []
    for rank in (0, 1):
        for step in range(8):
            t = 1000 * step
            events.append({"ph": "X", "pid": rank, "name": "step", "ts": t, "dur": 900})
            events.append({"ph": "X", "pid": rank, "name": "F0", "ts": t + 10, "dur": 100 * (rank + 1) + step})
            events.append({"ph": "X", "pid": rank, "name": "B0", "ts": t + 200, "dur": 300})
            events.append({"ph": "X", "pid": rank, "name": "data", "ts": t, "dur": 5})
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = bench.spans(trace)
    assert sorted(got) == [0, 1]
    assert got[0]["F"] == pytest.approx([(100 + s) / 1e6 for s in (5, 6, 7)])  # steps 5..7: after the warm-up
    assert got[1]["F"] == pytest.approx([(200 + s) / 1e6 for s in (5, 6, 7)])
    assert got[1]["B"] == pytest.approx([300 / 1e6] * 3)
