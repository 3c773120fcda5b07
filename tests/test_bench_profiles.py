"""``bench --profile``: the profiles validate looks up, taken right before the cells that need them."""

from __future__ import annotations

from pathlib import Path

import pytest

from partrain.bench import Store, profiles, run_suite, runner
from partrain.bench.runner import figures
from partrain.bench.store import Outcome
from partrain.bench.suite import suite_from_dict
from partrain.errors import PartrainError
from partrain.predict.cluster import load_cluster
from partrain.predict.machine import fingerprint
from partrain.predict.plan import profile_batch_sizes
from partrain.validate_nodes import validate_across_nodes

EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


def _step(cell) -> dict:
    """What ``partrain train --json`` reports, cut down to the fields the figures use."""
    return {"step_seconds": [0.01] * 6, "step_losses": [2.3] * 6, "epochs": [], "peak_memory_bytes": 1 << 20,
            "peak_memory_per_worker": [1 << 20] * cell.workers}


@pytest.fixture
def recorded(monkeypatch):
    """Every profile bench takes and every cell it runs, in order; no process starts."""
    events = []
    monkeypatch.setattr(profiles, "load_or_profile", lambda model, dataset, sizes, threads, *a, refresh, **k:
                        events.append(("model", model, tuple(sizes), threads, refresh)))
    monkeypatch.setattr(profiles, "hardware_for", lambda workers, directory, refresh:
                        events.append(("hardware", workers, refresh)))

    def measure(cell, data_dir, timeout, tick=None):
        try:
            cfg = runner.check_cell(cell, data_dir, timeout)
        except PartrainError as err:
            return Outcome("skipped", str(err))
        events.append(("cell", cell.model, cell.strategy, cell.workers, cell.batch_size))
        return Outcome("ok", figures=figures(cell, _step(cell)), config={**cfg.to_dict(), "resolved": {}})

    monkeypatch.setattr(runner, "measure", measure)
    return events


def test_bench_profile_takes_what_validate_looks_up_before_the_first_cell_that_needs_it(tmp_path, recorded):
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["serial", "ddp", "gpipe"], "workers": [1, 2],
                             "batch_sizes": [32, 256], "synthetic": True}, "t")
    with Store(tmp_path / "s.sqlite") as store:
        run_suite(suite, store, show_progress=False, profile=True)
        rows = store.rows()
    cells = [e for e in recorded if e[0] == "cell"]
    assert len(cells) == 2 * 4  # serial x1, ddp x1, ddp x2, gpipe x2, at 2 batches; serial x2 and gpipe x1 refused
    first_two = recorded.index(next(e for e in recorded if e[0] == "cell" and e[3] == 2))
    assert recorded[0][0] == "model" and recorded[1][0] == "cell"  # the model's profile right before its first cell
    assert recorded[first_two - 1] == ("hardware", 2, True)  # the collectives right before the first 2-worker cell
    assert [e for e in recorded if e[0] != "cell"] == [recorded[0], ("hardware", 2, True)]  # each once, fresh
    # validate on the store asks for exactly that profile: the same model, threads and batch sizes
    asked = []
    cluster = load_cluster(EXAMPLE_CLUSTER)
    from partrain.profile.model import profile_model

    mlp = profile_model("mlp", "mnist", [32], threads=1, synthetic=True)

    def profile_for(cfg, needed):
        asked.append(("model", cfg.model, tuple(profile_batch_sizes(needed)), cfg.threads, True))
        return mlp, 0.0

    report, _ = validate_across_nodes(rows, profile_for, lambda workers: cluster, lambda *a: None, fingerprint().hash)
    assert asked == [recorded[0]] and len(report.cases) == 8


def test_bench_profile_takes_nothing_when_every_cell_was_measured_before(tmp_path, recorded):
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "workers": [2], "synthetic": True}, "t")
    with Store(tmp_path / "s.sqlite") as store:
        run_suite(suite, store, show_progress=False)  # without --profile: no profile
        assert [e[0] for e in recorded] == ["cell"]
        run_suite(suite, store, show_progress=False, profile=True)  # measured already: nothing runs, nothing profiled
    assert [e[0] for e in recorded] == ["cell"]
