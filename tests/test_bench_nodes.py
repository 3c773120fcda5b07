"""Benchmark suites across emulated nodes (issue 18): the suite keys, the refusal where no
namespaces can be made, the store's link columns, and real cells across two namespaces."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from partrain.bench import Store, run_suite, runner
from partrain.bench import nodes as bench_nodes
from partrain.bench.store import COLUMNS
from partrain.bench.suite import suite_from_dict
from partrain.cli import main
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict.cluster import load_cluster
from partrain.predict.plan import Plan
from partrain.predict.profiles import HardwareProfile
from partrain.predict.predictor import predict_plan
from partrain.profile.cache import hardware_across
from partrain.profile.pipeline_fits import fit_loaded
from partrain.testing import netns
from partrain.validate_recommend import recommendation_outcomes
from partrain.validate_nodes import link_rates, validate_across_nodes, wire_rate

pytestmark = pytest.mark.alone  # measures emulated links and holds cells against their profiles: never beside another test (make test)

ACROSS = {"models": ["mlp"], "strategies": ["serial", "ddp", "gpipe"], "nodes": [2, 4], "workers_per_node": [1, 2],
          "link_mbit": [100, 1000]}
TINY = {"warmup_steps": 1, "steps": 2, "limit": 256, "timeout": 120, "threads": 1}
needs_netns = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


# --- the suite keys (pure) -----------------------------------------------------------------


def test_node_cells_are_the_placements_times_the_links_and_serial_runs_here_once():
    cells = suite_from_dict(ACROSS, "nodes.toml").cells()
    serial = [c for c in cells if c.strategy == "serial"]
    assert [(c.workers, c.nodes, c.link_mbit) for c in serial] == [(1, None, None)]
    ddp = [(c.nodes, c.workers_per_node, c.workers, c.link_mbit) for c in cells if c.strategy == "ddp"]
    assert ddp == [(n, w, n * w, link) for n in (2, 4) for w in (1, 2) for link in (100.0, 1000.0)]
    assert len(cells) == 1 + 2 * 8
    # the serial baseline of a cell across nodes is the serial cell here
    assert {c.baseline_key("h") for c in cells} == {serial[0].baseline_key("h")}
    assert len({c.key("h") for c in cells}) == len(cells)
    assert cells[1].label == "mlp/mnist ddp x2 b64 lr0.01 on 2x1 nodes at 100 Mbit/s"


def test_placements_name_the_pairs_and_a_local_cell_keeps_its_key():
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "placements": ["2x1", "4x1", "2x2"],
                             "link_mbit": 1000}, "p")
    assert [(c.nodes, c.workers_per_node) for c in suite.cells()] == [(2, 1), (4, 1), (2, 2)]
    assert suite.replace(steps=3).cells()[2].nodes == 2  # replace keeps the placements
    local = suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "workers": [2]}, "l").cells()[0]
    assert "nodes" not in local.identity() and "link_mbit" not in local.identity()


@pytest.mark.parametrize("keys, says", [
    ({"nodes": [2]}, "nodes and link_mbit come together"),
    ({"link_mbit": [100]}, "nodes and link_mbit come together"),
    ({"nodes": [1], "link_mbit": [100]}, "nodes must be 2..64"),
    ({"nodes": [2], "workers": [1, 2], "link_mbit": [100]}, "give workers (this machine) or nodes"),
    ({"nodes": [2], "placements": ["2x1"], "link_mbit": [100]}, "not both"),
    ({"workers_per_node": [2]}, "workers_per_node needs nodes"),
    ({"placements": ["2by1"], "link_mbit": [100]}, "placements must be NODESxWORKERS"),
    ({"nodes": [2], "link_mbit": [0]}, "link_mbit must be a finite number > 0"),
    ({"profile_max_mb": 4}, "profile_max_mb sizes the link's profile"),
])
def test_bad_node_keys_are_one_line_naming_the_key(keys, says):
    with pytest.raises(PartrainError) as err:
        suite_from_dict({"models": ["mlp"], **keys}, "nodes.toml")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_cells_across_nodes_are_refused_before_anything_runs_where_namespaces_cannot_be_made(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "available", lambda: "emulated nodes need root (network namespaces)")
    monkeypatch.setattr(runner, "measure", lambda *a, **k: pytest.fail("a cell ran"))
    with Store(tmp_path / "r.sqlite") as store:
        with pytest.raises(PartrainError) as err:
            run_suite(suite_from_dict(ACROSS, "nodes.toml"), store, show_progress=False)
        assert store.rows() == []
    assert str(err.value).startswith("16 of the suite's cells run across emulated nodes, and emulated nodes need root")


def test_bench_refuses_such_a_suite_before_it_makes_the_store(tmp_path, monkeypatch, capsys):
    from partrain.cli import main

    monkeypatch.setattr(netns, "available", lambda: "emulated nodes need root (network namespaces)")
    suite = tmp_path / "nodes.toml"
    suite.write_text('models = ["mlp"]\nstrategies = ["ddp"]\nnodes = [2]\nlink_mbit = [100]\n')
    assert main(["bench", str(suite), "--store", str(tmp_path / "r.sqlite")]) == 2
    assert capsys.readouterr().err.startswith("partrain: error: 1 of the suite's cells run across emulated nodes")
    assert not (tmp_path / "r.sqlite").exists()


def test_a_store_from_before_the_link_columns_opens_and_gains_them(tmp_path):
    path = tmp_path / "old.sqlite"
    old = [(n, sql) for n, sql, _ in COLUMNS if n not in ("nodes", "workers_per_node", "link_mbit")]
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE TABLE cells ({', '.join(f'{n} {sql}' for n, sql in old)})")
        db.execute("INSERT INTO cells (cell_key, baseline_key, model, dataset, strategy, workers, batch_size, lr, repeat, "
                   "synthetic, warmup_steps, config, status, hardware_hash) VALUES "
                   "('k', 'b', 'mlp', 'mnist', 'serial', 1, 64, 0.01, 0, 0, 5, '{}', 'ok', 'h')")
        db.execute("PRAGMA user_version = 1")
    with Store(path) as store:
        (row,) = store.rows()
    assert row["cell_key"] == "k" and row["nodes"] is None and row["link_mbit"] is None


def test_emulated_nodes_share_the_machines_cores():
    hw = load_cluster(Path(__file__).resolve().parents[1] / "examples" / "cluster.toml")
    # every node plans its threads on its share (at least one core); compute contends machine-wide
    for nodes, cores, per_node in ((2, 2, 1), (4, 2, 1), (2, 16, 8)):
        shared = bench_nodes.shares_cores(dataclasses.replace(hw), nodes, cores)
        assert (shared.cores_per_node, shared.shared_cores, shared.compute_speed) == (per_node, cores, 1.0)
    assert "2 emulated nodes sharing 16 cores" in shared.source
    assert HardwareProfile.from_dict(json.loads(json.dumps(shared.to_dict()))).shared_cores == 16
    # synchronising k busy workers per node costs what k x nodes busy workers cost on the machine
    two_by_two = dataclasses.replace(hw, workers_per_node=2, sync_s={2: 0.0})
    assert bench_nodes.shares_cores(two_by_two, 2, 2, {2: 0.0001, 4: 0.004}).sync_s == {1: 0.0001, 2: 0.004}
    assert bench_nodes.shares_cores(dataclasses.replace(hw, workers_per_node=1), 4, 2, {4: 0.004}).sync_s == {1: 0.004}
    # ... with the compute the machine's probe timed it after, as much as k x nodes workers each ran
    carried = bench_nodes.shares_cores(dataclasses.replace(two_by_two), 2, 2, {2: 0.0001, 4: 0.004},
                                       {2: 0.005, 4: 0.011})
    assert carried.sync_compute_s == {1: 0.005, 2: 0.011}
    assert HardwareProfile.from_dict(json.loads(json.dumps(carried.to_dict()))).sync_compute_s == {1: 0.005, 2: 0.011}


def test_emulated_nodes_fit_their_loaded_pipeline_probe_on_the_cores_they_share():
    """4 nodes of one worker on 2 cores: their probe over stages that compute, timed with the
    machine's cores shared, is fitted again once the profile says so; seen from inside a node
    (a core each, nothing shared) the probe's slower steps were all put down to the messages."""
    from tests.probe_worker import simulated_world_probe

    hw = load_cluster(Path(__file__).resolve().parents[1] / "examples" / "cluster.toml")
    hw = dataclasses.replace(hw, nodes=4, workers_per_node=1, cores_per_node=2, compute_sharing={}, sync_s={},
                             compute_speed=1.0, pipeline_action_s=0.0, pipeline_world=(0.0, 4e-4))
    shared = lambda k: max(1.0, k / 2)  # noqa: E731  (4 busy workers on the machine's 2 cores)
    stages = [(1e-3, 2e-3)] * 4
    probes = [simulated_world_probe([(1e-5, 2e-5)] * 4, 4e-4, 0.0, 0.0, shared),
              simulated_world_probe(stages, 1.5e-3, 0.0, 0.0, shared)]
    hw = dataclasses.replace(hw, points={"pipeline_world": {**probes[0], "loaded": probes[1:]}})
    alone = fit_loaded(hw, "pipeline_world")
    assert alone[1][1] > 2e-3  # each node's own core: the sharing is taken for messages
    fitted = bench_nodes.shares_cores(hw, 4, 2).pipeline_world_loaded
    assert fitted[0] == alone[0] and fitted[1] == (pytest.approx(1.5e-3), pytest.approx(1.5e-3, rel=0.05))


@pytest.fixture(scope="module")
def mlp_profile():
    from partrain.profile.model import profile_model

    return profile_model("mlp", "mnist", [64], threads=1, synthetic=True)


def _row(cfg: RunConfig, seconds: float, hardware: str, nodes=None, link=None) -> dict:
    run = {**cfg.to_dict(), "resolved": {"pp": cfg.dims.pp, "dp": cfg.dims.dp}}
    return {"status": "ok", "hardware_hash": hardware, "config": json.dumps({"cell": {"link": link}, "run": run}),
            "step_seconds_median": seconds, "peak_memory_per_worker": json.dumps([1] * cfg.workers),
            "peak_memory_bytes": 1, "threads": 1, "wall_seconds": 10.0, "nodes": nodes,
            "workers_per_node": nodes and 1, "link_mbit": link}


def _two_nodes(tmp_path: Path, gb_per_s: float):
    path = tmp_path / f"link-{gb_per_s}.toml"
    path.write_text(f"""[cluster]\nnodes = 2\nworkers_per_node = 1\ndevice_memory_gb = 8\nbackend = "gloo"
[intra]\nbandwidth_gb_per_s = 10\nlatency_us = 5\n[inter]\nbandwidth_gb_per_s = {gb_per_s}\nlatency_us = 100\n""")
    return load_cluster(path)


def test_each_cell_across_nodes_is_predicted_from_the_profile_of_its_own_link(mlp_profile, tmp_path):
    here = _two_nodes(tmp_path, 10.0)
    links = {100.0: _two_nodes(tmp_path, 0.0125), 1000.0: _two_nodes(tmp_path, 0.125)}  # 100 Mbit/s, 1 Gbit/s
    serial, ddp = RunConfig(model="mlp", batch_size=64), RunConfig(model="mlp", strategy="ddp", workers=2, batch_size=64)
    truth = {link: predict_plan(mlp_profile, hw, Plan.from_config(ddp)).median_step_s for link, hw in links.items()}
    assert truth[100.0] > truth[1000.0]  # the slow link's profile predicts a slower step
    rows = [_row(serial, 0.9 * truth[1000.0], here.fingerprint),
            _row(ddp, truth[100.0], here.fingerprint, 2, 100.0),
            _row(ddp, 1.1 * truth[1000.0], here.fingerprint, 2, 1000.0),
            _row(ddp, 1.0, here.fingerprint, 2, 10000.0)]  # its link was never profiled
    report, across = validate_across_nodes(rows, lambda cfg, sizes: (mlp_profile, 1.0), lambda workers: here,
                                           lambda workers, nodes, link: links.get(link), here.fingerprint)
    errors = {c.label: c.error for c in report.cases if c.strategy == "ddp"}
    assert errors == pytest.approx({"mlp/mnist ddp bucket 25MB x2 b64 on 2x1 nodes at 100 Mbit/s": 0.0,
                                    "mlp/mnist ddp bucket 25MB x2 b64 on 2x1 nodes at 1000 Mbit/s": 1 / 1.1 - 1})
    assert report.skipped == ["1 cells on 2x1 nodes at 10000 Mbit/s: no hardware profile was measured across them "
                              "(or one by an earlier partrain, whose figures mean something else); run `partrain bench` on their suite again, as root, with the same --profile-dir"]
    assert report.profile_seconds == 1.0  # one model profile, counted once over the three validations
    jobs = recommendation_outcomes(across, (2,))  # per link, serial competing: 10% faster than ddp at 1 Gbit/s
    assert {(o.key, o.plans, o.best) for o in jobs} == {
        (f"mlp/mnist on 2x1 nodes at {link} Mbit/s batch 64, up to 2 workers", 2,
         f"mlp/mnist serial x1 b64 on 2x1 nodes at {link} Mbit/s") for link in (100, 1000)}


def test_the_link_rate_a_profile_measured_is_the_marginal_rate_of_its_largest_messages(tmp_path):
    hw = _two_nodes(tmp_path, 0.0125)
    hw.points = {"inter": {"2": {"sendrecv": [[2**20, 0.001 + 2**23 / 96e6], [2**22, 0.001 + 2**25 / 96e6]]}}}
    flat = _two_nodes(tmp_path, 0.0125)
    flat.points = {"inter": {"2": {"sendrecv": [[1024, 0.002], [4096, 0.001]]}}}  # inside the shaper's burst
    rows = [{"nodes": 2, "workers_per_node": 1, "link_mbit": link} for link in (100.0, 1000.0, 10000.0)] + [{"nodes": None}]
    rates = link_rates(rows, lambda workers, nodes, link: {100.0: hw, 1000.0: flat}.get(link))
    assert [(p, s) for p, s, _ in rates] == [("2x1 nodes at 100 Mbit/s", 100.0), ("2x1 nodes at 1000 Mbit/s", 1000.0),
                                             ("2x1 nodes at 10000 Mbit/s", 10000.0)]
    assert rates[0][2] == pytest.approx(96.0) and math.isnan(rates[1][2]) and rates[2][2] is None
    # timed with the link alone (the sweep's other ranks busy, as in a job, read the CPU's limit too): that rate wins
    hw.points["link_alone"] = {"inter": [[2**22, 0.001 + 2**25 / 99e6], [2**24, 0.001 + 2**27 / 99e6]]}
    assert link_rates(rows, lambda workers, nodes, link: {100.0: hw}.get(link))[0][2] == pytest.approx(99.0)


def test_a_link_carries_its_rate_in_frames_and_a_messages_bytes_in_their_payload():
    # a full frame at MTU 1500: 1448 bytes of payload (IPv4 20, TCP 32 with timestamps) in 1514 (Ethernet 14)
    assert netns.payload_share() == pytest.approx(1448 / 1514)
    assert netns.payload_share(9000) == pytest.approx(8948 / 9014)  # jumbo frames lose 0.7%, not 4.4%
    assert wire_rate(100 * 1448 / 1514) == pytest.approx(100.0)  # all the payload a 100 Mbit/s link can move
    assert wire_rate(95.0) / 100 - 1 == pytest.approx(-0.0067, abs=1e-4)  # issue 18's -5% links, in frames


def test_the_what_if_check_reads_the_recommenders_claims():
    spec = importlib.util.spec_from_file_location("nodes_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "nodes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ddp = {"label": "ddp bucket 25MB", "plan": {"workers": 2, "strategy": "ddp"}}
    serial = {"label": "serial", "plan": {"workers": 1, "strategy": "serial"}}
    rec = {"winner": ddp, "ranked": [ddp, serial], "explanation": "ddp bucket 25MB on 2 workers is predicted fastest. "
           "With a 10x slower link, serial on 1 worker would win."}
    assert bench.claims(rec) == [(0.1, serial, True)]
    rec = {"winner": serial, "ranked": [serial, ddp],
           "explanation": "... A 10x faster or slower link would not change the choice."}
    assert bench.claims(rec) == [(0.1, ddp, False), (10.0, ddp, False)]


def test_the_token_bucket_holds_a_millisecond_of_the_rate_and_two_frames_at_least():
    assert netns.tbf_burst(1000) == 125_000  # 1 Gbit/s: 1 ms is 125 kB
    assert netns.tbf_burst(10_000) == 1_250_000
    assert netns.tbf_burst(100) == 12_500  # TCP's segments are cut to it (gso_max_size), not it grown to them
    assert netns.tbf_burst(1) == 2 * 1514


# --- real cells across namespaces (root) --------------------------------------------------


def _ours() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return {n for n in listed if n.startswith(f"{netns.PREFIX}{os.getpid()}-")}


@needs_netns
@pytest.mark.slow  # about 2 minutes: the link's profile and the cell across two namespaces, then validate
@pytest.mark.multiproc
def test_a_two_node_cell_runs_through_bench_into_the_store_with_its_link(tmp_path, data_dir, capsys):
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "nodes": [2], "link_mbit": [1000],
                             "profile_max_mb": 0.01, **TINY}, "two-nodes")
    with Store(tmp_path / "r.sqlite") as store:
        run_suite(suite, store, data_dir=str(data_dir), show_progress=False, profile_dir=str(tmp_path))
        (row,) = store.rows()
    assert row["status"] == "ok", row["reason"]
    assert (row["workers"], row["nodes"], row["workers_per_node"], row["link_mbit"]) == (2, 2, 1, 1000.0)
    assert row["steps_run"] == 3 and row["step_seconds_median"] > 0
    measured = hardware_across(2, 2, 1000.0, tmp_path)  # the link's profile, for validate
    assert (measured.nodes, measured.workers_per_node) == (2, 1) and "inter" in measured.links
    # a step's synchronisation after computing, over the world across the two nodes (keyed by it)
    # by message size: the smallest always, the larger ones the link carries in 25 ms (1 Gbit/s: 1 MiB, not 4)
    assert list(measured.step_sync) == [2] and list(measured.step_sync[2])[0] == 64 * 1024
    assert all(len(points) == 3 for points in measured.step_sync[2].values())
    assert not _ours()
    # validate holds the cell against that profile and says what the link moved: payload, and the frames it took
    assert main(["validate", "--store", str(tmp_path / "r.sqlite"), "--profile-dir", str(tmp_path), "--data-dir",
                 str(data_dir), "--plot", str(tmp_path / "v.png")]) == 0
    line = re.search(r"link 2x1 nodes at 1000 Mbit/s: profile --hardware measured (\d+) Mbit/s of payload \(.*\), "
                     r"(\d+) Mbit/s of frames with their headers", capsys.readouterr().out)
    assert line, "no link line"
    payload, frames = map(int, line.groups())
    assert frames == pytest.approx(payload * 1514 / 1448, abs=1)


@needs_netns
@pytest.mark.slow  # 15-30 s: torchrun across two namespaces, twice
@pytest.mark.multiproc
def test_the_namespaces_go_after_a_failing_cell_and_after_an_error_in_the_runner(tmp_path, data_dir, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(__file__)))  # tests.bench_models imports in the cell
    suite = suite_from_dict({"models": ["tests.bench_models:raises_in_forward"], "strategies": ["ddp"],
                             "nodes": [2], "link_mbit": [100], **TINY}, "failing")
    kept = dataclasses.replace(load_cluster(Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"),
                               source="measured")
    kept.save(bench_nodes.link_profile_path(suite.cells()[0], tmp_path))  # as if measured: no profiling here
    with Store(tmp_path / "r.sqlite") as store:
        run_suite(suite, store, data_dir=str(data_dir), show_progress=False, profile_dir=str(tmp_path))
        (row,) = store.rows()
    assert row["status"] == "failed" and "this model fails on purpose" in row["reason"], row["reason"]
    assert not _ours()

    def broken(*args, **kwargs):
        assert len(_ours()) == 3  # two nodes and the hub were up when the runner failed
        raise RuntimeError("the runner itself fails")

    monkeypatch.setattr(runner, "run_processes", broken)
    with Store(tmp_path / "r2.sqlite") as store, pytest.raises(RuntimeError, match="the runner itself"):
        run_suite(suite, store, data_dir=str(data_dir), show_progress=False, profile_dir=str(tmp_path))
    assert not _ours()


def test_the_link_refusal_names_no_cells_when_none_run_across_nodes():
    assert bench_nodes.refusal(suite_from_dict({"models": ["mlp"]}, "here").cells()) is None


@needs_netns
def test_a_link_profile_gets_its_own_timeout_not_only_the_cells(tmp_path):
    """A link profile moves every collective's largest messages through the link: 2 nodes of
    2 workers at 100 Mbit/s took 316 s, past the nodes suite's 300 s per cell."""
    (cell,) = [c for c in suite_from_dict({"models": ["mlp"], "strategies": ["ddp"], "nodes": [2],
                                           "workers_per_node": [2], "link_mbit": [100], **TINY}, "t").cells()]
    given = []

    def run(cmds, timeout, tick, env):
        given.append(timeout)
        return "timeout", "no result in time", None

    said = bench_nodes.ensure_link_profile(cell, run, 4.0, 120, tmp_path)
    assert given == [bench_nodes.LINK_PROFILE_TIMEOUT_S] and "timeout" in said
    assert not _ours()  # its namespaces are gone
