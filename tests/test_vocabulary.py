"""One vocabulary for a run: options generated from RunConfig's fields, every bad number
refused in one place with one line, and one to_argv for every command line."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from partrain.cli import build_parser, config_from_args, main
from partrain.config import Job, Machinery, Parallelism, RunConfig, to_argv

pytestmark = pytest.mark.alone  # runs predict, recommend and profile: never beside another test (make test)


def error_line(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BAD = [
    (["train", "--lr", "nan"], "--lr must be a finite number > 0 that float32 holds, got nan"),
    (["train", "--lr", "inf"], "--lr must be a finite number > 0 that float32 holds, got inf"),
    (["train", "--lr", "0"], "--lr must be a finite number > 0 that float32 holds, got 0.0"),
    (["train", "--weight-decay", "-1"], "--weight-decay must be a finite number >= 0 that float32 holds, got -1.0"),
    (["train", "--weight-decay", "nan"], "--weight-decay must be a finite number >= 0 that float32 holds, got nan"),
    (["train", "--momentum", "1"], "--momentum must be a finite number in [0, 1), got 1.0"),
    (["train", "--bucket-mb", "nan"], "--bucket-mb must be a finite number in (0, 1e+06], got nan"),
    (["train", "--timeout", "-5"], "--timeout must be a finite number in [0.001, 604800], got -5.0"),
    (["train", "--threads", "0"], "--threads must be an integer in 1..1024, got 0"),
    (["train", "--threads", "100000"], "--threads must be an integer in 1..1024, got 100000"),
    (["train", "--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["train", "--seed", str(2**40)], "--seed must be an integer in 0..4294967295, got 1099511627776"),
    (["train", "--seed", "-1"], "--seed must be an integer in 0..4294967295, got -1"),
    (["train", "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["train", "--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["train", "--limit", "-3"], "--limit must be an integer >= 1, got -3"),
    (["train", "--microbatches", "0"], "--microbatches must be an integer >= 1, got 0"),
    (["predict", "--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["recommend", "--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["profile", "--hardware", "--max-mb", "-1"], "--max-mb must be a finite number > 0, got -1.0"),
    (["scale", "strong", "--lr", "nan"], "--lr must be a finite number > 0 that float32 holds, got nan"),
]


@pytest.mark.parametrize("argv, expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_every_bad_number_is_refused_in_one_line(argv, expected, capsys, tmp_path):
    assert error_line([*argv, *(["--profile-dir", str(tmp_path)] if argv[0] in ("predict", "recommend", "profile") else [])],
                      capsys) == f"partrain: error: {expected}"


def test_split_points_outside_the_model_are_refused_before_any_worker(capsys, data_dir):
    msg = error_line(["train", "--strategy", "gpipe", "--workers", "2", "--split-points", "99",
                      "--data-dir", str(data_dir)], capsys)
    assert "--split-points 99 must increase strictly within 1..2 (mlp has 3 blocks)" in msg


def test_the_parts_of_a_run_are_typed_and_each_default_is_written_once():
    names = [f.name for f in dataclasses.fields(RunConfig)]
    parts = [f.name for cls in (Job, Parallelism, Machinery) for f in dataclasses.fields(cls)]
    assert names == parts and "lr" in [f.name for f in dataclasses.fields(Job)]
    args = build_parser().parse_args(["train"])
    for f in dataclasses.fields(RunConfig):
        if f.name not in ("workers", "model_options"):
            assert getattr(args, f.name) == getattr(RunConfig(), f.name), f.name


@pytest.mark.parametrize("cfg", [
    RunConfig(),
    RunConfig(model="cnn", dataset="cifar10", strategy="hybrid", workers=4, pp=2, dp=2, microbatches=4, lr=0.1,
              weight_decay=1e-4, seed=7, recompute=True, split_points=[2], threads=1, timeout_s=60.0, synthetic=True),
    RunConfig(strategy="local-sgd", workers=2, average_every="epoch", evaluate=False, steps=5, limit=100,
              model_options={"activation": "sigmoid"}, optimizer="adam"),
    RunConfig(strategy="ddp", workers=2, bucket_mb=1.0, data_dir="/some where/data", eval_limit=10),
])
def test_to_argv_round_trips(cfg):
    argv = cfg.to_argv()
    assert config_from_args(build_parser().parse_args(["train", *shlex.split(shlex.join(argv))])) == cfg


def test_to_argv_leaves_out_defaults_but_names_the_job():
    assert to_argv({"model": "mlp", "lr": 0.01, "strategy": "ddp", "workers": 2}) == [
        "--model", "mlp", "--strategy", "ddp", "--workers", "2"]
