"""Profiles and predictions on the device that will train, at the precision asked: cache keys
by device and numerics, the hardware fingerprint, where each part of a prediction came from,
--precision through predict and recommend into the printed command, the store's run columns
and the migration of an older store, and validate holding a prediction only against cells
that ran alike. The tests marked ``gpu`` need CUDA (skipped without it: run them on a GPU
machine with ``python -m pytest -m gpu``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from partrain.bench.cell import Cell, _digest
from partrain.bench.runner import figures
from partrain.bench.store import COLUMNS, RUN_COLUMNS, Outcome, Store
from partrain.bench.suite import suite_from_dict
from partrain.cli import main
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict import Plan, enumerate_plans, predict_plan
from partrain.predict.cluster import load_cluster
from partrain.predict.machine import Hardware, fingerprint
from partrain.predict.profiles import ModelProfile
from partrain.predict.provenance import provenance, provenance_lines
from partrain.profile import model as model_module
from partrain.profile.cache import (
    RunOptions,
    load_or_profile,
    local_hardware,
    profile_path,
)
from partrain.profile.model import profile_model
from partrain.profile.timing import Stopwatch
from partrain.validate import validate
from tests.test_store import HW, run_result

pytestmark = pytest.mark.alone  # profiles models: never beside another test (make test)

GPU_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster-8xh100.toml"
# a model profile's keys before it recorded its device and numerics
OLD_KEYS = {"model", "dataset", "synthetic", "batch_sizes", "threads", "fingerprint", "input_shape", "input_bytes",
            "train_samples", "blocks", "loss_s", "data_s", "optimizer_s", "baseline_rss_bytes", "baseline_peak_rss_bytes",
            "train_peak_rss_bytes", "replica_wrapper_s", "profile_seconds", "other_load", "options", "world_of_one_s",
            "world_of_one_batch"}


@pytest.fixture(scope="module")
def fp32() -> ModelProfile:
    return dataclasses.replace(profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True, device="cpu"),
                               other_load=0.0)


@pytest.fixture(scope="module")
def bf16() -> ModelProfile:
    profile = profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True, device="cpu", precision="bf16")
    return dataclasses.replace(profile, other_load=0.0)


# ---- the profile --------------------------------------------------------------------------


def test_a_cpu_profile_keeps_the_shape_it_had(fp32):
    d = fp32.to_dict()
    assert OLD_KEYS <= set(d)
    assert (d["device"], d["precision"], d["channels_last"], d["compile"]) == ("cpu", "fp32", False, False)
    assert d["train_peak_reserved_bytes"] == []  # on CPU: the resident set, as before
    assert len(d["loop_s"]) == len(d["batch_sizes"]) and d["loop_s"][0] == d["world_of_one_s"]["serial"]
    assert set(fp32.world_of_one_s) == {"serial", "ddp", "local-sgd", "fsdp", "hybrid"}
    older = ModelProfile.from_dict({k: v for k, v in d.items() if k in OLD_KEYS})  # saved before these fields
    assert older.device == "cpu" and older.run_options() == {"precision": "fp32", "channels_last": False, "compile": False}


def test_a_bf16_profile_on_cpu_is_measured_under_autocast(fp32, bf16):
    assert (bf16.device, bf16.precision) == ("cpu", "bf16")
    # under autocast a Linear's output is bf16: half the bytes a stage boundary sends at fp32
    assert bf16.blocks[1].out_bytes == [2 * b * 128 for b in (4, 16)]
    assert fp32.blocks[1].out_bytes == [4 * b * 128 for b in (4, 16)]
    assert bf16.blocks[1].flops == fp32.blocks[1].flops  # the same arithmetic, in another type
    assert all(t > 0 for b in bf16.blocks for t in b.fwd_s + b.bwd_s)
    assert bf16.param_bytes == fp32.param_bytes  # autocast keeps fp32 master weights
    assert len(bf16.train_peak_rss_bytes) == 2 and set(bf16.world_of_one_s) == {"serial", "ddp", "local-sgd", "fsdp", "hybrid"}


def test_the_stopwatch_on_cpu_is_the_host_clock():
    watch = Stopwatch("cpu").start()
    time.sleep(0.01)
    watch.mark()
    laps = watch.laps()
    assert len(laps) == 2 and laps[0] >= 0.009 and laps[1] >= 0


# ---- the cache ----------------------------------------------------------------------------


def test_cache_keys_hold_the_device_and_numerics(tmp_path):
    cpu = profile_path(tmp_path, "mlp", "mnist", [16, 4], 1, True, {}, RunOptions("cpu"))
    assert cpu.name == f"model-mlp-mnist-synthetic-b4_16-t1-{fingerprint().hash}.json"  # the name it always had
    names = {profile_path(tmp_path, "mlp", "mnist", [4, 16], 1, True, {}, RunOptions(d, p, cl, c)).name
             for d in ("cpu", "cuda") for p in ("fp32", "bf16", "fp16") for cl in (False, True) for c in (False, True)}
    assert len(names) == 24
    assert "-t1-cuda-bf16-cl-compile-" in profile_path(tmp_path, "mlp", "mnist", [4], 1, run=RunOptions("cuda", "bf16",
                                                                                                          True, True)).name


def test_a_profile_is_reused_only_for_the_device_and_numerics_it_was_taken_with(tmp_path, monkeypatch, fp32, bf16):
    calls = []

    def fake_profile(*args, **kw):
        calls.append((kw["device"], kw["precision"]))
        return bf16 if kw["precision"] == "bf16" else fp32

    monkeypatch.setattr(model_module, "profile_model", fake_profile)
    args = ("mlp", "mnist", [4, 16], 1, tmp_path)
    half, half_path, _ = load_or_profile(*args, synthetic=True, run=RunOptions("cpu", "bf16"))
    full, full_path, reused = load_or_profile(*args, synthetic=True, run=RunOptions("cpu"))
    again, _, reused_again = load_or_profile(*args, synthetic=True, run=RunOptions("cpu", "bf16"))
    assert calls == [("cpu", "bf16"), ("cpu", "fp32")] and not reused and reused_again
    assert (half.precision, full.precision, again.precision) == ("bf16", "fp32", "bf16") and half_path != full_path
    full_path.write_text(half_path.read_text())  # a bf16 profile under the fp32 name: measured again
    redone, _, reused = load_or_profile(*args, synthetic=True, run=RunOptions("cpu"))
    assert not reused and redone.precision == "fp32" and calls[-1] == ("cpu", "fp32")
    assert not RunOptions("cuda").matches(fp32) and RunOptions("cpu").matches(fp32)  # never a CPU profile for a GPU


def test_a_machine_without_a_gpu_keeps_its_hardware_hash():
    old = {"cpu_model": "Test CPU", "cpu_cores": 2, "memory_gib": 8, "gpu": None, "gpu_count": 0, "backend": "gloo",
           "torch_version": "2.13.0"}
    assert HW.hash == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    gpu = Hardware("Xeon", 32, 512, "NVIDIA H100 80GB HBM3", 1, "nccl", "2.11.0", 81559)
    assert gpu.gpu_memory_bytes == 81559 * 2**20 and "1 x NVIDIA H100 80GB HBM3 (80 GiB)" in gpu.describe()
    assert gpu.hash != dataclasses.replace(gpu, gpu_memory_mib=40960).hash


def test_a_gpu_job_with_more_workers_than_gpus_asks_for_a_cluster_file(tmp_path):
    from partrain.profile.cache import hardware_for

    gpus = fingerprint().gpu_count
    with pytest.raises(PartrainError, match="--cluster"):
        hardware_for(max(2, gpus + 1), tmp_path, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of --device cuda without a GPU")
def test_device_cuda_without_a_gpu_is_one_clear_line(tmp_path, capsys):
    for command in ("profile", "predict"):
        # --synthetic: the refusal is the device's wherever the data is (or is not)
        argv = [command, "--model", "mlp", "--synthetic", "--device", "cuda", "--profile-dir", str(tmp_path)]
        assert main(argv) == 2
        assert "--device cuda, but torch sees no GPU here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing half-written


# ---- predictions at a precision ----------------------------------------------------------------


def test_a_plan_is_never_predicted_from_a_profile_at_another_precision(fp32, bf16):
    hw = local_hardware("cpu")
    with pytest.raises(PartrainError, match="precision"):
        predict_plan(fp32, hw, Plan("serial", 1, 16, precision="bf16"))
    assert predict_plan(bf16, hw, Plan("serial", 1, 16, precision="bf16")).seconds_per_step > 0
    plans = enumerate_plans(bf16, 2, 16)
    assert plans and all(p.precision == "bf16" for p in plans)  # the profile's precision, never another
    argv = plans[0].to_config("mlp", "mnist").to_argv()
    assert argv[argv.index("--precision") + 1] == "bf16" and "bf16" in plans[0].label()
    cfg = RunConfig(precision="fp16", channels_last=True, compile=True)
    argv = Plan.from_config(cfg).to_config("mlp", "mnist").to_argv()
    assert argv[argv.index("--precision") + 1] == "fp16" and {"--channels-last", "--compile"} <= set(argv)


def test_on_a_gpu_the_serial_step_is_the_loop_measured_at_each_batch(fp32):
    gpu = dataclasses.replace(fp32, device="NVIDIA H100 80GB HBM3", loop_s=[0.002, 0.005])
    hw = local_hardware("cpu")
    for batch, seconds in ((4, 0.002), (16, 0.005), (10, 0.0035)):
        assert predict_plan(gpu, hw, Plan("serial", 1, batch)).seconds_per_step == pytest.approx(seconds)
    # without the loop (a CPU profile) the step is the blocks' sum plus the world-of-one loop's overhead
    assert predict_plan(fp32, hw, Plan("serial", 1, 4)).seconds_per_step >= fp32.world_of_one_s["serial"] * 0.999


def test_provenance_says_what_was_measured_here_and_what_came_from_the_file(fp32):
    hw = load_cluster(GPU_CLUSTER)
    lines = provenance_lines(provenance(fp32, hw, str(GPU_CLUSTER)))
    assert lines[0].startswith("measured on this machine: model profile of mlp (cpu, fp32)")
    assert lines[1].startswith(f"taken from {GPU_CLUSTER} (written by hand): ")
    assert "device memory per worker" in lines[1] and "link bandwidth" in lines[1]
    local = provenance(fp32, local_hardware("cpu"))
    assert local["file"] is None and local["from_file"] == [] and len(provenance_lines(local)) == 1
    assert provenance(fp32, hw, "measured-there.json")["file"] == "measured-there.json (measured there)"


def test_predict_with_a_gpu_cluster_file_reports_provenance_and_precision(tmp_path, monkeypatch, capsys, bf16):
    monkeypatch.setattr(model_module, "profile_model", lambda *a, **kw: bf16)
    argv = ["predict", "--model", "mlp", "--dataset", "mnist", "--synthetic", "--workers", "8", "--batch-size", "64",
            "--cluster", str(GPU_CLUSTER), "--precision", "bf16", "--device", "cpu", "--strategies", "serial,ddp",
            "--profile-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "bf16" and out["provenance"]["file"].startswith(str(GPU_CLUSTER))
    assert out["memory_limit_bytes"] == 85 * 10**9  # the file's GPU memory, not this host's RAM
    assert {p["plan"]["precision"] for p in out["predictions"]} == {"bf16"}
    assert all("--precision" in p["cli_args"] for p in out["predictions"])
    assert main(argv[:-1]) == 0
    text = capsys.readouterr().out
    assert "measured on this machine: model profile of mlp (cpu, bf16)" in text and f"taken from {GPU_CLUSTER}" in text


def test_recommend_prints_the_command_at_the_precision_asked(tmp_path, monkeypatch, capsys, bf16):
    monkeypatch.setattr(model_module, "profile_model", lambda *a, **kw: bf16)
    argv = ["recommend", "--model", "mlp", "--dataset", "mnist", "--synthetic", "--precision", "bf16", "--device", "cpu",
            "--cluster", str(GPU_CLUSTER), "--workers", "2", "--profile-dir", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "--precision bf16" in out["command"] and "--precision bf16" in out["torchrun_command"]
    assert {p["plan"]["precision"] for p in out["ranked"]} == {"bf16"}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "partrain train" in text and "--precision bf16" in text and "taken from" in text


# ---- the store ----------------------------------------------------------------------------


def _old_store(path: Path, rows: list[dict]) -> None:
    """A results store as partrain wrote it before schema 2: no run columns, user_version 1."""
    old = [(n, t) for n, t, _ in COLUMNS if n not in RUN_COLUMNS]
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE cells (" + ", ".join(f'"{n}" {t}' for n, t in old) + ")")
    db.execute("PRAGMA user_version = 1")
    for i, row in enumerate(rows):
        full = {"cell_key": f"k{i}", "baseline_key": "b", "model": "mlp", "dataset": "mnist", "strategy": "serial",
                "workers": 1, "batch_size": 64, "lr": 0.01, "repeat": 0, "synthetic": 0, "warmup_steps": 1,
                "status": "ok", "hardware_hash": "h", **row}
        db.execute(f"INSERT INTO cells ({', '.join(full)}) VALUES ({', '.join('?' * len(full))})", list(full.values()))
    db.commit()
    db.close()


OLD_ROWS = [{"config": json.dumps({"run": {"backend": None}}), "gpu": None},  # a CPU machine
            {"config": json.dumps({"run": {"backend": None}}), "gpu": "NVIDIA H100 80GB HBM3"},  # trained on the GPU
            {"config": json.dumps({"run": {"backend": "gloo"}}), "gpu": "NVIDIA H100 80GB HBM3"}]  # on its CPU


def test_a_store_from_before_opens_and_its_rows_say_cpu_or_gpu_fp32(tmp_path):
    path = tmp_path / "old.sqlite"
    _old_store(path, OLD_ROWS)
    want = ["cpu", "NVIDIA H100 80GB HBM3", "cpu"]
    with Store(path, create=False) as store:  # read only: filled in, nothing written
        rows = store.rows()
    assert [r["device"] for r in rows] == want and {r["precision"] for r in rows} == {"fp32"}
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 1
    with Store(path) as store:  # opened to write: migrated
        rows = store.rows()
        store.record(Cell("mlp", "mnist", "serial", 1, 64, None, 0.01, precision="bf16", channels_last=True), HW,
                     Outcome("ok", figures=figures(Cell("mlp", "mnist", "serial", 1, 64, None, 0.01), run_result(0.5))),
                     "s", None)
        new = store.rows()[-1]
    assert [r["device"] for r in rows] == want and [r["channels_last"] for r in rows] == [0, 0, 0]
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert set(RUN_COLUMNS) <= {row[1] for row in db.execute("PRAGMA table_info(cells)")}
    assert (new["device"], new["precision"], new["channels_last"], new["compile"]) == ("cpu", "bf16", 1, 0)


def test_figures_record_the_device_a_run_trained_on():
    result = run_result(0.5)
    assert figures(Cell("mlp", "mnist", "serial", 1, 64, None, 0.01), {**result, "backend": "gloo"})["device"] == "cpu"
    on_gpu = figures(Cell("mlp", "mnist", "serial", 1, 64, None, 0.01), {**result, "backend": "nccl"})["device"]
    assert on_gpu == (fingerprint().gpu or "cpu")


def test_a_suite_runs_each_cell_at_every_precision_asked_and_old_cells_keep_their_keys():
    suite = suite_from_dict({"models": ["mlp"], "strategies": ["serial"], "precisions": ["fp32", "bf16"],
                             "channels_last": True}, "t")
    cells = suite.cells()
    assert [(c.precision, c.channels_last) for c in cells] == [("fp32", True), ("bf16", True)]
    assert cells[1].run_config(None, 60).precision == "bf16" and cells[1].run_config(None, 60).channels_last
    assert cells[0].key("h") != cells[1].key("h") and cells[0].baseline_key("h") != cells[1].baseline_key("h")
    plain = Cell("mlp", "mnist", "serial", 1, 64, None, 0.01)
    before = {k: v for k, v in dataclasses.asdict(plain).items() if k not in ("repeat", "precision", "channels_last",
                                                                              "compile", "engine", "nodes", "workers_per_node",
                                                                              "link_mbit", "min_seconds")}
    assert plain.key("h") == _digest({**before, "repeat": 0, "hardware": "h"})  # as stored before: found again
    with pytest.raises(PartrainError, match="precisions"):
        suite_from_dict({"models": ["mlp"], "precisions": ["fp8"]}, "t")


def test_bench_runs_a_suite_at_the_precision_and_options_given(capsys):
    assert main(["bench", "--suite", "quick", "--list", "--precision", "bf16", "--compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.endswith("bf16 compiled") for line in lines)
    assert main(["bench", "--suite", "quick", "--list"]) == 0
    assert "bf16" not in capsys.readouterr().out  # the suite's own: fp32


def test_bench_runs_every_cell_as_many_times_as_repeats_says(capsys):
    assert main(["bench", "--suite", "quick", "--list"]) == 0
    once = capsys.readouterr().out.splitlines()
    assert main(["bench", "--suite", "quick", "--list", "--repeats", "3"]) == 0
    thrice = capsys.readouterr().out.splitlines()
    assert len(thrice) == 3 * len(once)
    assert sorted(thrice) == sorted(once + [f"{c} #{r}" for c in once for r in (1, 2)])  # the first run keeps its key
    assert main(["bench", "--suite", "quick", "--list", "--repeats", "0"]) == 2
    assert "repeats" in capsys.readouterr().err


# ---- validate ------------------------------------------------------------------------------


def _row(cfg: RunConfig, seconds: float, hardware: str, **columns) -> dict:
    run = {**cfg.to_dict(), "resolved": {"pp": 1, "dp": 1}}
    return {"status": "ok", "hardware_hash": hardware, "config": json.dumps({"cell": {}, "run": run}),
            "step_seconds_median": seconds, "peak_memory_per_worker": json.dumps([1000]), "peak_memory_bytes": 1000,
            "threads": 1, "wall_seconds": 10.0, **columns}


def test_validate_holds_a_prediction_only_against_cells_that_ran_alike(fp32):
    hw = local_hardware("cpu")
    cfg = RunConfig(model="mlp", synthetic=True, batch_size=16)
    half = cfg.replace(precision="bf16")
    rows = [_row(cfg, 0.01, hw.fingerprint, device="cpu", precision="fp32"),
            _row(cfg, 0.01, hw.fingerprint),  # from before the columns: CPU, fp32
            _row(cfg, 0.001, hw.fingerprint, device="NVIDIA H100 80GB HBM3", precision="fp32"),
            _row(half, 0.02, hw.fingerprint, device="cpu", precision="bf16")]
    asked = []

    def profile_for(config, sizes):
        asked.append(config.precision)
        return fp32, 1.0  # an fp32 profile whatever was asked: the bf16 cell is not held against it

    report = validate(rows, profile_for, lambda workers: hw, hw.fingerprint, "cpu")
    assert len(report.cases) == 1 and report.mismatched == 2 and report.to_dict()["mismatched"] == 2
    assert sorted(asked) == ["bf16", "fp32"]  # the GPU cell was never profiled here
    on_gpu = validate(rows, profile_for, lambda workers: hw, hw.fingerprint, "NVIDIA H100 80GB HBM3")
    assert on_gpu.cases == [] and on_gpu.mismatched == 4  # a CPU profile never predicts a GPU cell


def test_validate_cli_counts_the_cells_of_another_device_and_says_what_to_do(tmp_path, capsys):
    cell = Cell("mlp", "mnist", "serial", 1, 64, None, 0.01)
    ran = figures(cell, run_result(0.5))
    with Store(tmp_path / "s.sqlite") as store:
        store.record(cell, fingerprint(), Outcome("ok", figures={**ran, "device": "NVIDIA H100 80GB HBM3"}), "s", None)
    argv = ["validate", "--store", str(tmp_path / "s.sqlite"), "--profile-dir", str(tmp_path), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "skipped 1 cells for mismatch" in err and "validate with --device" in err


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_fingerprint_names_the_gpu_and_its_memory_bounds_a_worker():
    here = fingerprint()
    assert here.gpu == torch.cuda.get_device_name(0) and here.gpu_count == torch.cuda.device_count()
    assert here.gpu_memory_mib == torch.cuda.get_device_properties(0).total_memory // 2**20
    local = local_hardware()
    assert local.device_memory_bytes == here.gpu_memory_bytes and local.backend == "nccl" and not local.shared_memory
    assert local_hardware("cpu").device_memory_bytes == here.memory_gib * 2**30


@pytest.mark.gpu
def test_the_stopwatch_times_the_gpu():
    a = torch.randn(2048, 2048, device="cuda")
    watch = Stopwatch("cuda").start()
    for _ in range(20):
        a = a @ a / 2048
    watch.mark()
    first, second = watch.laps()
    assert first > 0 and second >= 0


@pytest.mark.gpu
def test_a_profile_on_cuda_records_cuda_times_and_allocator_memory():
    profile = profile_model("cnn", "mnist", [8, 32], threads=1, synthetic=True)  # the GPU: the default where there is one
    assert profile.on_gpu and profile.device == torch.cuda.get_device_name(0) and profile.precision == "fp32"
    assert all(t > 0 for b in profile.blocks for t in b.fwd_s + b.bwd_s)
    assert len(profile.loop_s) == 2 and all(0 < t < 1 for t in profile.loop_s)
    params = sum(b.param_bytes + b.buffer_bytes for b in profile.blocks)
    assert params <= profile.baseline_rss_bytes < params + 2**21  # the allocator's blocks of the parameters
    small, large = profile.train_peak_rss_bytes
    assert profile.baseline_rss_bytes < small <= large
    assert all(r >= a for r, a in zip(profile.train_peak_reserved_bytes, profile.train_peak_rss_bytes))
    pred = predict_plan(profile, local_hardware(), Plan("serial", 1, 32))
    assert pred.seconds_per_step == pytest.approx(profile.loop_s[1])
    assert pred.memory_bytes_per_worker == pytest.approx(large, rel=0.1)


@pytest.mark.gpu
def test_a_bf16_channels_last_profile_on_cuda():
    fp = profile_model("cnn", "mnist", [16], threads=1, synthetic=True, device="cuda")
    half = profile_model("cnn", "mnist", [16], threads=1, synthetic=True, device="cuda", precision="bf16",
                         channels_last=True)
    assert (half.precision, half.channels_last, half.on_gpu) == ("bf16", True, True)
    assert [b.out_bytes[0] * 2 for b in half.blocks] == [b.out_bytes[0] for b in fp.blocks]  # bf16 activations
    assert all(t > 0 for b in half.blocks for t in b.fwd_s + b.bwd_s) and half.loop_s[0] > 0
