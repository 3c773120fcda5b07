"""The bad-input battery (issue 19, item 7): every case exit status 2, one line naming the
problem, no traceback, and nothing written: no store, no profile, no model file."""

from __future__ import annotations

import gzip
import sqlite3
import struct
from pathlib import Path

import pytest

from partrain.cli import main

pytestmark = pytest.mark.alone  # runs predict, recommend and profile: never beside another test (make test)

TRAIN = ["train", "--steps", "1", "--limit", "128", "--eval-limit", "16", "--quiet"]
CLUSTER = """[cluster]
nodes = 2
workers_per_node = 1
device_memory_gb = 4
compute_speed = 1.0
backend = "gloo"
[intra]
bandwidth_gb_per_s = 10
latency_us = 5
[inter]
bandwidth_gb_per_s = 1
latency_us = 50
"""
SUITE = 'models = ["mlp"]\ndatasets = ["mnist"]\nstrategies = ["serial"]\nworkers = [1]\nsteps = 1\n'


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def _idx_pair(folder: Path, prefix: str, rows: int, cols: int, count: int = 4) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 2051, count, rows, cols) + bytes(count * rows * cols))
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 2049, count) + bytes(count))


# (id, argv with {tmp} and {data} to fill, files to create first {name: text}, words the line must hold)
CASES = [
    ("argument-of-the-wrong-type", ["train", "--epochs", "nan"], {}, ["argument --epochs: invalid int value: 'nan'", "partrain train --help"]),
    ("argument-missing-its-value", ["predict", "--workers"], {}, ["--workers: expected one argument"]),
    ("scratch-hidden-negative", [*TRAIN, "--engine", "scratch", "--hidden", "-5"], {}, ["--hidden", "got -5"]),
    ("scratch-events-is-a-file", [*TRAIN, "--engine", "scratch", "--events", "{tmp}/f.txt"], {"f.txt": "x"}, ["--events", "a file is in the way"]),
    ("scratch-trace-is-a-folder", [*TRAIN, "--engine", "scratch", "--trace", "{tmp}"], {}, ["--trace", "is a directory"]),
    ("mlp-on-tokens", [*TRAIN, "--dataset", "tokens"], {}, ["model 'mlp' reads images", "--model gpt"]),
    ("scratch-on-tokens", [*TRAIN, "--engine", "scratch", "--dataset", "tokens"], {}, ["reads images", "gpt"]),
    ("sweep-workers-beyond-the-machine", ["sweep", "--workers", "100", "--trials", "1"], {}, ["--workers 100", "at most"]),
    ("serve-model-file-is-a-folder", ["serve", "--model-file", "{tmp}"], {}, ["is a directory"]),
    ("scratch-workers-beyond-the-machine", [*TRAIN, "--engine", "scratch", "--strategy", "ddp", "--workers", "64"], {}, ["--workers 64"]),
    ("scratch-threads-beyond-the-machine", [*TRAIN, "--engine", "scratch", "--strategy", "threads", "--threads", "100"], {}, ["--threads 100"]),
    ("lr-nan", [*TRAIN, "--lr", "nan"], {}, ["--lr"]),
    ("lr-inf", [*TRAIN, "--lr", "inf"], {}, ["--lr"]),
    ("lr-zero", [*TRAIN, "--lr", "0"], {}, ["--lr"]),
    ("weight-decay-nan", [*TRAIN, "--weight-decay", "nan"], {}, ["--weight-decay"]),
    ("weight-decay-negative", [*TRAIN, "--weight-decay", "-1"], {}, ["--weight-decay"]),
    ("momentum-above-1", [*TRAIN, "--momentum", "1.5"], {}, ["--momentum"]),
    ("lr-beyond-float32", [*TRAIN, "--lr", "1e300"], {}, ["--lr", "1e+300"]),
    ("weight-decay-beyond-float32", [*TRAIN, "--weight-decay", "1e39"], {}, ["--weight-decay"]),
    ("bucket-mb-huge", [*TRAIN, "--strategy", "ddp", "--bucket-mb", "1e300"], {}, ["--bucket-mb"]),
    ("timeout-below-a-millisecond", [*TRAIN, "--timeout", "1e-9"], {}, ["--timeout", "0.001"]),
    ("hogwild-batch-fewer-than-workers", [*TRAIN, "--strategy", "hogwild", "--workers", "2", "--batch-size", "1"], {}, ["global batch 1", "hogwild"]),
    ("bucket-mb-nan", [*TRAIN, "--strategy", "ddp", "--bucket-mb", "nan"], {}, ["--bucket-mb"]),
    ("timeout-negative", [*TRAIN, "--strategy", "ddp", "--timeout", "-5"], {}, ["--timeout"]),
    ("timeout-nan", [*TRAIN, "--timeout", "nan"], {}, ["--timeout"]),
    ("seed-huge", [*TRAIN, "--seed", str(10**30)], {}, ["--seed"]),
    ("seed-negative", [*TRAIN, "--seed", "-1"], {}, ["--seed"]),
    ("threads-zero", [*TRAIN, "--threads", "0"], {}, ["--threads"]),
    ("threads-huge", [*TRAIN, "--threads", "100000"], {}, ["--threads"]),
    ("workers-huge", [*TRAIN, "--strategy", "ddp", "--workers", "1000", "--batch-size", "64000"], {}, ["--workers"]),
    ("workers-zero", [*TRAIN, "--strategy", "ddp", "--workers", "0"], {}, ["--workers"]),
    ("batch-zero", [*TRAIN, "--batch-size", "0"], {}, ["--batch-size"]),
    ("epochs-negative", [*TRAIN, "--epochs", "-2"], {}, ["--epochs"]),
    ("average-every-zero", [*TRAIN, "--strategy", "local-sgd", "--average-every", "0"], {}, ["--average-every"]),
    ("split-points-beyond", [*TRAIN, "--strategy", "gpipe", "--workers", "2", "--split-points", "99"], {}, ["split"]),
    ("microbatches-fewer-than-stages", [*TRAIN, "--strategy", "gpipe", "--workers", "2", "--microbatches", "1"], {}, ["micro-batches"]),
    ("unknown-strategy", [*TRAIN, "--strategy", "warp"], {}, ["warp"]),
    ("save-model-is-a-folder", [*TRAIN, "--save-model", "{tmp}"], {}, ["--save-model"]),
    ("save-model-missing-parent", [*TRAIN, "--save-model", "{tmp}/no/such/m.pt"], {}, ["--save-model"]),
    ("checkpoint-is-a-file", [*TRAIN, "--checkpoint", "{tmp}/f.txt"], {"f.txt": "x"}, ["--checkpoint"]),
    ("events-is-a-file", [*TRAIN, "--events", "{tmp}/f.txt"], {"f.txt": "x"}, ["--events"]),
    # /proc takes no new files, not even from root, whom os.access lets write anywhere
    ("checkpoint-where-nothing-can-be-made", [*TRAIN, "--checkpoint", "/proc/partrain-ck"], {}, ["--checkpoint", "not writable"]),
    ("step-out-of-memory", [*TRAIN, "--model", "tests.userfactory:out_of_memory"], {}, ["out of memory", "56.1 GiB", "--batch-size"]),
    ("step-out-of-memory-on-a-worker", [*TRAIN, "--model", "tests.userfactory:out_of_memory", "--strategy", "ddp", "--workers", "2"], {},
     ["out of memory", "(ddp, 2 workers)", "--batch-size"]),
    # the user's model raising as it trains: one line naming the model, the error, and where
    ("model-raises-in-its-forward", [*TRAIN, "--model", "tests.userfactory:raises_in_forward"], {},
     ["tests.userfactory:raises_in_forward", "raised ValueError", "userfactory.py:", "in forward", "at most 4 samples", "--debug"]),
    ("model-batchnorm-on-one-sample", [*TRAIN, "--model", "tests.userfactory:batchnorm", "--batch-size", "1"], {},
     ["raised ValueError", "in its BatchNorm1d", "more than 1 value per channel"]),
    ("data-dir-5000-chars", ["train", "--data-dir", "x" * 5000, "--steps", "1"], {}, ["data"]),
    ("factory-raises", [*TRAIN, "--model", "tests.userfactory:raises"], {}, ["raised ValueError", "width must be even"]),
    ("factory-exits", [*TRAIN, "--model", "tests.userfactory:exits"], {}, ["sys.exit(3)"]),
    ("factory-wrong-output", [*TRAIN, "--model", "tests.userfactory:wrong_output"], {}, ["7", "10 classes"]),
    ("factory-bad-shapes", [*TRAIN, "--model", "tests.userfactory:bad_shapes"], {}, ["block 2", "(2, 32)"]),
    ("resume-missing", [*TRAIN, "--resume", "{tmp}/none"], {}, ["--resume"]),
    ("resume-corrupt-meta", [*TRAIN, "--resume", "{tmp}/ck"], {"ck/LATEST": "step-000001", "ck/step-000001/meta.json": "{not json"}, ["meta.json"]),
    # predict and recommend check the data and the model before a minute of measuring collectives
    ("predict-without-data", ["predict", "--workers", "2", "--data-dir", "{tmp}/nodata", "--profile-dir", "{tmp}/p"], {}, ["mnist test data not found"]),
    ("recommend-model-that-raises", ["recommend", "--workers", "2", "--model", "tests.userfactory:raises", "--profile-dir", "{tmp}/p"], {},
     ["raised ValueError", "width must be even"]),
    ("predict-batch-beyond-the-data", ["predict", "--batch-size", "100000", "--profile-dir", "{tmp}/p"], {},
     ["batch size 100000 exceeds the 60000 training samples of mnist"]),
    ("predict-workers-zero", ["predict", "--workers", "0", "--profile-dir", "{tmp}/p"], {}, ["--workers"]),
    # a local profile with more workers than the machine can run (it spawned them all, for minutes)
    ("recommend-workers-beyond-the-machine", ["recommend", "--workers", "100000", "--profile-dir", "{tmp}/p"], {}, ["--workers 100000", "--cluster"]),
    ("profile-workers-beyond-the-machine", ["profile", "--hardware", "--workers", "100000", "--profile-dir", "{tmp}/p"], {}, ["--workers 100000"]),
    ("recommend-workers-zero", ["recommend", "--workers", "0", "--profile-dir", "{tmp}/p"], {}, ["--workers"]),
    ("profile-max-mb-negative", ["profile", "--hardware", "--max-mb", "-1", "--profile-dir", "{tmp}/p"], {}, ["--max-mb"]),
    ("profile-dir-is-a-file", ["profile", "--profile-dir", "{tmp}/f.txt"], {"f.txt": "x"}, ["--profile-dir"]),
    ("cluster-nan", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER.replace("compute_speed = 1.0", "compute_speed = nan")}, ["compute_speed"]),
    ("cluster-negative-latency", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER.replace("latency_us = 5", "latency_us = -5")}, ["latency_us"]),
    ("cluster-inf-bandwidth", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER.replace("bandwidth_gb_per_s = 1\n", "bandwidth_gb_per_s = inf\n")}, ["bandwidth_gb_per_s"]),
    # figures no cluster has, which overflowed the predictor's arithmetic or stopped its simulation
    ("cluster-memory-beyond-any-machine", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER.replace("device_memory_gb = 4", "device_memory_gb = 1e300")}, ["device_memory_gb", "from 0.001 to 1e+06"]),
    ("cluster-latency-of-ages", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER.replace("latency_us = 50", "latency_us = 1e308")}, ["latency_us", "1e+308"]),
    ("cluster-bandwidth-below-a-byte", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER.replace("bandwidth_gb_per_s = 10", "bandwidth_gb_per_s = 1e-320")}, ["[intra]", "bandwidth_gb_per_s"]),
    ("cluster-compute-speed-near-zero", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER.replace("compute_speed = 1.0", "compute_speed = 1e-320")}, ["compute_speed"]),
    ("predict-workers-beyond-the-cluster", ["predict", "--workers", "16", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER}, ["--workers 16", "2 node(s) x 1 worker(s) = 2"]),
    ("recommend-workers-beyond-the-cluster", ["recommend", "--workers", "8", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER}, ["--workers 8", "= 2"]),
    ("cluster-fractional-nodes", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER.replace("nodes = 2", "nodes = 0.5")}, ["nodes"]),
    ("cluster-unknown-backend", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER.replace('"gloo"', '"mpi9"')}, ["backend"]),
    ("cluster-misspelled-key", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER.replace("compute_speed", "compute_sped")}, ["compute_sped"]),
    ("cluster-shared-memory-as-a-word", ["predict", "--cluster", "{tmp}/c.toml", "--profile-dir", "{tmp}/p"],
     {"c.toml": CLUSTER.replace('backend = "gloo"', 'backend = "gloo"\nshared_memory = "no"')}, ["shared_memory must be true or false"]),
    ("recommend-cluster-and-run", ["recommend", "--cluster", "{tmp}/c.toml", "--run", "--profile-dir", "{tmp}/p"], {"c.toml": CLUSTER},
     ["--run", "--cluster"]),
    ("recommend-memory-limit-zero", ["recommend", "--memory-limit", "0", "--profile-dir", "{tmp}/p"], {}, ["more than 0 bytes"]),
    ("predict-strategies-empty", ["predict", "--strategies", ",,", "--profile-dir", "{tmp}/p"], {}, ["--strategies", "expected comma-separated names"]),
    ("cluster-json-of-another-program", ["predict", "--cluster", "{tmp}/c.json", "--profile-dir", "{tmp}/p"], {"c.json": '{"a": 1}'},
     ["is not a hardware profile partrain can use", "examples/cluster.toml"]),
    ("scale-unknown-strategy", ["scale", "strong", "--strategies", "ddp,warp", "--store", "{tmp}/s.sqlite"], {}, ["warp"]),
    ("suite-a-model-twice", ["bench", "{tmp}/s.toml", "--store", "{tmp}/s.sqlite"], {"s.toml": SUITE.replace('["mlp"]', '["mlp", "mlp"]')},
     ["models lists 'mlp' twice", "repeats"]),
    ("suite-infinite-lr", ["bench", "{tmp}/s.toml", "--store", "{tmp}/s.sqlite"], {"s.toml": SUITE + "lrs = [inf]\n"}, ["lrs"]),
    ("suite-huge-batch", ["bench", "{tmp}/s.toml", "--store", "{tmp}/s.sqlite"], {"s.toml": SUITE + "batch_sizes = [1000000000000]\n"}, ["batch"]),
    ("suite-model-without-factory", ["bench", "{tmp}/s.toml", "--store", "{tmp}/s.sqlite"], {"s.toml": SUITE.replace('"mlp"', '"mlp:"')}, ["unknown model 'mlp:'"]),
    ("suite-threads-beyond-the-machine", ["bench", "{tmp}/s.toml", "--store", "{tmp}/s.sqlite"], {"s.toml": SUITE + "threads = 100000\n"}, ["threads = 100000"]),
    ("suite-not-utf8", ["bench", "{tmp}/s.toml", "--store", "{tmp}/s.sqlite"], {"s.toml": b"name = \"\xff\xfe\"\n"}, ["UTF-8"]),
    ("store-is-a-folder", ["results", "--store", "{tmp}"], {}, ["is a directory", "results.sqlite"]),
    ("store-under-a-file", ["bench", "{tmp}/s.toml", "--store", "{tmp}/f.txt/s.sqlite"], {"s.toml": SUITE, "f.txt": "x"}, ["is a file, not a folder"]),
    ("store-an-empty-file", ["results", "--store", "{tmp}/empty.sqlite"], {"empty.sqlite": ""}, ["holds no partrain results", "partrain bench"]),
    ("validate-store-an-empty-file", ["validate", "--store", "{tmp}/empty.sqlite"], {"empty.sqlite": ""}, ["holds no partrain results"]),
    ("store-of-another-program", ["results", "--store", "{tmp}/other.sqlite"], {"other.sqlite": "SQLITE:other"}, ["not a partrain results store"]),
    # output paths: refused before any work, whatever the command (audit of session 41)
    ("save-model-is-a-device", [*TRAIN, "--save-model", "/dev/null"], {}, ["--save-model /dev/null", "not a regular file"]),
    ("trace-where-nothing-can-be-made", [*TRAIN, "--trace", "/proc/t.json"], {}, ["--trace", "not writable"]),
    ("trace-html-is-a-folder", [*TRAIN, "--trace", "{tmp}/t.json", "--html", "{tmp}"], {}, ["--html", "is a directory"]),
    ("checkpoint-holds-another-run", [*TRAIN, "--checkpoint", "{tmp}/ck"], {"ck/LATEST": "step-000001", "ck/step-000001/meta.json": "{}"},
     ["--checkpoint", "already holds a checkpoint (step-000001)", "--resume"]),
    ("results-output-is-a-folder", ["results", "--store", "{tmp}/s.sqlite", "--format", "csv", "--output", "{tmp}"], {}, ["--output", "is a directory"]),
    ("results-output-under-a-file", ["results", "--store", "{tmp}/s.sqlite", "--output", "{tmp}/f.txt/x.csv"], {"f.txt": "x"}, ["--output", "is a file, not a folder"]),
    ("report-output-is-a-folder", ["report", "--store", "{tmp}/s.sqlite", "-o", "{tmp}"], {}, ["--output", "is a directory"]),
    ("trace-output-missing-folder", ["trace", "{tmp}/ev", "-o", "{tmp}/no/t.json"], {}, ["--output", "does not exist"]),
    ("validate-plot-under-a-file", ["validate", "--store", "{tmp}/s.sqlite", "--plot", "{tmp}/f.txt/v.png"], {"f.txt": "x"}, ["--plot", "is a file"]),
    ("scale-plot-under-a-file", ["scale", "strong", "--store", "{tmp}/s.sqlite", "--plot", "{tmp}/f.txt/p.png"], {"f.txt": "x"}, ["--plot"]),
    ("sweep-storage-of-another-program", ["sweep", "--trials", "1", "--storage", "{tmp}/other.sqlite"], {"other.sqlite": "SQLITE:other"},
     ["not an Optuna study storage", "invoices"]),
    ("sweep-study-empty", ["sweep", "--trials", "1", "--study", ""], {}, ["--study"]),
    ("idx-wrong-image-size", ["train", "--data-dir", "{tmp}/d", "--steps", "1"], {"IDX": (14, 56)}, ["14x56", "28x28"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, data_dir, tmp_path, monkeypatch, capsys):
    _, argv, files, words = case
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # the default store and profile directory live here
    monkeypatch.setenv("PARTRAIN_DATA_DIR", str(data_dir))
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        if name == "IDX":
            for prefix in ("train", "t10k"):
                _idx_pair(tmp_path / "d" / "mnist", prefix, *text)
            continue
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if text == "SQLITE:other":
            with sqlite3.connect(path) as db:
                db.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    before = {p: p.stat().st_mtime_ns for p in _files(tmp_path)}
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own refusals: one line too (cli.OneLineParser)
        status = exit_.code
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    line = err.splitlines()[-1]
    assert line.startswith("partrain: error:"), err
    for word in words:
        assert word in line, line
    after = {p: p.stat().st_mtime_ns for p in _files(tmp_path)}
    assert after == before, f"written: {sorted(set(after) - set(before))}"
