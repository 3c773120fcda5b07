"""Argument types and option groups the subcommands share, and printing tables."""

from __future__ import annotations

import argparse
import sys


def print_table(table) -> None:
    """A rich table on stdout: the terminal's width, or 200 columns when piped (no wrapping in logs)."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(table)


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


STORE_HELP = "results store, an SQLite file (default: $PARTRAIN_STORE, else ~/.partrain/results.sqlite)"


PROFILE_DIR_HELP = "profile cache directory (default: $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles)"


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="mlp", help="zoo model (see `partrain models`) or package.module:factory (default: mlp)")
    g.add_argument("--dataset", default="mnist", help="dataset (see `partrain datasets`; default: mnist)")
    g.add_argument("--data-dir", help="where the datasets are (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)")
    g.add_argument("--synthetic", action="store_true", help="generated data of the dataset's shape instead of the real files")
    g.add_argument("--activation", choices=["relu", "sigmoid"], help="hidden activation of the mlp (default: relu)")
