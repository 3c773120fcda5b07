"""``bench --profile``: the profiles validate looks up, taken right before the cells that need them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from partrain.bench import Store, profiles, run_suite, runner
from partrain.bench.runner import figures
from partrain.bench.store import Outcome
from partrain.bench.suite import suite_from_dict
from partrain.cli import main
from partrain.errors import PartrainError
from partrain.predict.cluster import load_cluster
from partrain.predict.machine import fingerprint
from partrain.predict.plan import profile_batch_sizes
from partrain.validate_nodes import validate_across_nodes

pytestmark = pytest.mark.alone  # profiles models beside the cells it benches: never beside another test (make test)

EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


def _step(cell) -> dict:
    """What ``partrain train --json`` reports, cut down to the fields the figures use."""
    return {"step_seconds": [0.01] * 6, "step_losses": [2.3] * 6, "epochs": [], "peak_memory_bytes": 1 << 20,
            "peak_memory_per_worker": [1 << 20] * cell.workers}


@pytest.fixture
def recorded(monkeypatch):
    """Every profile bench takes and every cell it runs, in order; no process starts."""
    events = []
    def load_or_profile(model, dataset, sizes, threads, *a, refresh, **k):
        events.append(("model", model, tuple(sizes), threads, refresh))
        return SimpleNamespace(pace_s=[]), Path("not-kept.json"), False  # no pace windows: none timed later

    monkeypatch.setattr(profiles, "load_or_profile", load_or_profile)
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


def test_cells_run_again_run_beside_the_profiles_taken_for_their_first_repeats(tmp_path, recorded, monkeypatch):
    """rerun_over: the repeats run again after every cell take no profile again (a profile taken
    again would leave the earlier cells beside another one)."""
    first = runner.measure
    slower = [1.0, 1.5, 1.3, 1.0]  # the median of three agrees with neither neighbour: two more runs, no further

    def measure(cell, *a, **k):
        out = first(cell, *a, **k)
        out.figures["step_seconds_median"] *= slower[cell.repeat]
        return out

    monkeypatch.setattr(runner, "measure", measure)
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "workers": [2], "synthetic": True,
                             "repeats": 2, "rerun_over": 0.15}, "t")
    with Store(tmp_path / "s.sqlite") as store:
        run_suite(suite, store, show_progress=False, profile=True)
        assert sorted(r["repeat"] for r in store.rows()) == [0, 1, 2, 3]
    assert [e[0] for e in recorded] == ["model", "hardware", "cell", "cell", "cell", "cell"]


def test_bench_profile_takes_nothing_when_every_cell_was_measured_before(tmp_path, recorded):
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "workers": [2], "synthetic": True}, "t")
    with Store(tmp_path / "s.sqlite") as store:
        run_suite(suite, store, show_progress=False)  # without --profile: no profile
        assert [e[0] for e in recorded] == ["cell"]
        run_suite(suite, store, show_progress=False, profile=True)  # measured already: nothing runs, nothing profiled
    assert [e[0] for e in recorded] == ["cell"]


def test_bench_profile_times_the_machines_pace_before_each_cell_and_validate_reads_the_profile_at_it(tmp_path, monkeypatch,
                                                                                                   capsys):
    """A real profile of the mlp, then before each of its three cells (the cadence set to every
    cell) a window of its pace step (``profile.pace``) added to the profile file, its seconds
    counted as the profile's.
    Read back from the cache, every time figure stands at the median pace of all the windows:
    with the later windows made twice the profile's own, a prediction's times are multiplied by
    median(own + later) / median(own); memory figures stay as measured."""
    import statistics
    import time

    from partrain.predict.profiles import ModelProfile
    from partrain.profile.cache import load_or_profile

    def measure(cell, data_dir, timeout, tick=None):  # the cells themselves are not what is tested
        cfg = runner.check_cell(cell, data_dir, timeout)
        return Outcome("ok", figures=figures(cell, _step(cell)), config={**cfg.to_dict(), "resolved": {}})

    monkeypatch.setattr(runner, "measure", measure)
    monkeypatch.setattr(profiles, "PACE_EVERY_S", 0.0)
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["serial", "ddp", "local-sgd"], "workers": [1],
                             "batch_sizes": [16], "synthetic": True, "threads": 1}, "t")
    with Store(tmp_path / "s.sqlite") as store:
        run_suite(suite, store, show_progress=False, profile=True, profile_dir=str(tmp_path / "prof"))
    [path] = (tmp_path / "prof").glob("*mlp*.json")
    raw = ModelProfile.load(path)
    assert len(raw.pace_s) >= 5 and len(raw.later_pace_s) == 3
    assert all(0 < t < 0.1 for t in raw.pace_s + raw.later_pace_s)

    class Steady:  # a pace step whose every window reads 1 ms and takes 10 ms
        windows: list = []
        warmed: list = []

        def sample(self, warm=False):
            time.sleep(0.01)
            self.windows.append(1e-3)
            self.warmed.append(warm)

    steady = Steady()
    profiles.sample_pace(steady, path, windows=2, extra_s=5.0)  # 5 s of building the step, counted once
    assert steady.warmed == [True, False]  # untimed steps before the first window after a cell
    again = ModelProfile.load(path)
    assert again.later_pace_s == raw.later_pace_s + [1e-3] * 2
    assert again.profile_seconds >= raw.profile_seconds + 5.0 + 0.01 * 2
    raw = again

    own = statistics.fmean(raw.pace_s)
    doctored = [2 * own] * (2 * len(raw.pace_s))  # twice as many later windows, at twice its own mean
    ModelProfile.from_dict({**raw.to_dict(), "later_pace_s": doctored}).save(path)
    paced, _, reused = load_or_profile("mlp", "mnist", raw.batch_sizes, 1, str(tmp_path / "prof"), synthetic=True)
    factor = 5 / 3  # the mean of all windows, (n + 2n * 2) / 3n of its own
    assert reused
    assert paced.blocks[0].fwd_s == pytest.approx([t * factor for t in raw.blocks[0].fwd_s])
    assert paced.blocks[2].bwd_cold_s == pytest.approx([t * factor for t in raw.blocks[2].bwd_cold_s])
    assert paced.loop_s == pytest.approx([t * factor for t in raw.loop_s])
    assert paced.world_of_one_s == pytest.approx({k: t * factor for k, t in raw.world_of_one_s.items()})
    assert paced.optimizer_s == pytest.approx({k: t * factor for k, t in raw.optimizer_s.items()})
    assert paced.train_peak_rss_bytes == raw.train_peak_rss_bytes and paced.profile_seconds == raw.profile_seconds
    # validate says so, per profile
    assert main(["validate", "--store", str(tmp_path / "s.sqlite"), "--profile-dir", str(tmp_path / "prof")]) == 0
    assert f"mlp: its profile read at x{factor:.3f}, the machine's pace over {len(doctored)} windows" in capsys.readouterr().err


def test_bench_profile_times_a_pace_window_at_most_every_pace_every_s(tmp_path, monkeypatch):
    """Cells 20 s apart on the bench's clock: a window before the first, then before the first
    cell at least ``PACE_EVERY_S`` (30 s here) after the last window; building the step counted once."""
    clock, sampled, kept = {"t": 0.0}, [], tmp_path / "kept.json"
    monkeypatch.setattr(profiles, "PACE_EVERY_S", 30.0)
    kept.write_text("{}")
    monkeypatch.setattr(profiles, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    monkeypatch.setattr(profiles, "load_or_profile", lambda *a, **k: (SimpleNamespace(pace_s=[1e-3]), kept, False))
    monkeypatch.setattr(profiles, "ModelProfile", SimpleNamespace(load=lambda path: SimpleNamespace(pace_s=[1e-3])))
    def pace_step(cfg, profile, data_dir):  # building the step takes 5 s
        clock["t"] += 5.0
        return "step"

    monkeypatch.setattr(profiles, "pace_step", pace_step)
    monkeypatch.setattr(profiles, "sample_pace", lambda step, path, extra_s: sampled.append((clock["t"], step, extra_s)))

    def measure(cell, data_dir, timeout, tick=None):
        cfg = runner.check_cell(cell, data_dir, timeout)
        clock["t"] += 20.0
        return Outcome("ok", figures=figures(cell, _step(cell)), config={**cfg.to_dict(), "resolved": {}})

    monkeypatch.setattr(runner, "measure", measure)
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["serial", "ddp", "local-sgd"], "workers": [1],
                             "batch_sizes": [16, 32], "synthetic": True, "threads": 1}, "t")
    with Store(tmp_path / "s.sqlite") as store:
        run_suite(suite, store, show_progress=False, profile=True, profile_dir=str(tmp_path / "prof"))
    assert clock["t"] == 5.0 + 6 * 20.0  # the step built, then six cells ran, 20 s each
    assert sampled == [(5.0, "step", 5.0), (45.0, "step", 0.0), (85.0, "step", 0.0)]
