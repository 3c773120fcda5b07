"""The command line as a user meets it: help, version, and one clear line for bad input."""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from partrain import __version__
from partrain.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def subcommands() -> list[str]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


def test_console_entry_point_and_version():
    proc = subprocess.run([sys.executable, "-m", "partrain", "--version"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"partrain {__version__}"


@pytest.mark.parametrize("command", subcommands())
def test_every_subcommand_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: partrain {command}") and len(out.splitlines()) > 3


def test_help_and_flag_errors_come_before_torch_is_imported():
    """Importing torch costs 3 s: ``--help`` and a bad flag are answered without it."""
    code = ("import sys\nfrom partrain.cli import main\n"
            "for argv in (['--help'], ['predict', '--help'], ['train', '--workers', '0']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr
    assert "--workers must be an integer >= 1, got 0" in proc.stderr


def error_line(argv, capsys) -> str:
    status = main(argv)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "\n" not in err and "Traceback" not in err
    return err.removeprefix("partrain: error: ")


def test_unknown_model(data_dir, capsys):
    assert "unknown model 'resnet9000'" in error_line(["train", "--model", "resnet9000", "--data-dir", str(data_dir)], capsys)


def test_bad_user_factory(data_dir, capsys):
    msg = error_line(["train", "--model", "tests.userfactory:not_a_module", "--data-dir", str(data_dir)], capsys)
    assert "tests.userfactory:not_a_module" in msg


def test_missing_dataset_says_where_and_how(tmp_path, capsys):
    msg = error_line(["train", "--data-dir", str(tmp_path)], capsys)
    assert str(tmp_path) in msg and "--synthetic" in msg


def test_corrupt_dataset_file_is_named(data_dir, tmp_path, capsys):
    mnist = tmp_path / "mnist"
    shutil.copytree(data_dir / "mnist", mnist)
    raw = gzip.decompress((mnist / "t10k-images-idx3-ubyte.gz").read_bytes())
    (mnist / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw[: len(raw) // 2]))  # truncated
    msg = error_line(["train", "--data-dir", str(tmp_path)], capsys)
    assert "t10k-images-idx3-ubyte.gz" in msg


@pytest.mark.parametrize("argv,expected", [
    (["--strategy", "1f1b", "--workers", "2", "--microbatches", "1"], "needs at least as many micro-batches as stages"),
    (["--strategy", "hybrid", "--workers", "4", "--pp", "3", "--dp", "2"], "differs from the world size 4"),
    (["--strategy", "gpipe", "--workers", "4", "--model", "mlp"], "4 pipeline stages but mlp has only 3 blocks"),
    (["--strategy", "gpipe", "--workers", "2", "--batch-size", "30"], "not divisible by 4 micro-batches"),
    (["--strategy", "pipedream"], "unknown strategy 'pipedream'"),
    (["--strategy", "hogwild", "--workers", "2", "--backend", "nccl"], "hogwild shares weights in host memory"),
])
def test_bad_configuration_is_refused_before_anything_runs(argv, expected, data_dir, tmp_path, capsys):
    outputs = ["--save-model", str(tmp_path / "model.pt"), "--checkpoint", str(tmp_path / "ckpt"), "--events", str(tmp_path / "ev")]
    assert expected in error_line(["train", "--data-dir", str(data_dir), *outputs, *argv], capsys)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_train_prints_a_summary_line(data_dir, capsys):
    assert main(["train", "--data-dir", str(data_dir), "--steps", "5", "--eval-limit", "200", "--quiet"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("mlp on mnist, serial x1, test accuracy ") and "samples/s" in out


def test_models_lists_parameter_counts(capsys):
    assert main(["models", "--dataset", "cifar10"]) == 0
    assert "resnet18" in (out := capsys.readouterr().out) and "11,173,962" in out
