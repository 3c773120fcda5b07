"""The benchmark scripts' workers still start: they join partrain's local rendezvous.

``benchmarks/overhead.py``'s hand-written DDP loop once read ``MASTER_ADDR``, which
``spawn`` does not set (its workers meet in a private FileStore), and failed at once with no
test to say so. These run each script's multi-process worker for a few steps on 2 gloo
workers, with a timeout.
"""

from __future__ import annotations

import importlib
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
