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
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:  # "--strategies ,," meant every strategy, silently
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


STORE_HELP = "results store, an SQLite file (default: $PARTRAIN_STORE, else ~/.partrain/results.sqlite)"


PROFILE_DIR_HELP = "profile cache directory (default: $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles)"


def add_data_args(p: argparse.ArgumentParser) -> None:
    """The job's model and data options, as ``train`` has them."""
    from partrain.config import add_options

    add_options(p, ["model", "dataset", "data_dir", "synthetic"])
    add_model_options(p)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Keyword arguments of the model's factory (``RunConfig.model_options``), beside the model:
    ``--activation`` for the mlp, ``--model-option KEY=VALUE`` for any model."""
    from partrain.model_options import add_model_option_arg

    group = next((g for g in p._action_groups if g.title == "model and data"), p)
    group.add_argument("--activation", choices=["relu", "sigmoid"], help="hidden activation of the mlp (default: relu)")
    group.add_argument("--hidden", type=int_list, help="mlp: hidden layer widths, e.g. 256,128 (default: 256,128)")
    add_model_option_arg(group)


def model_options(args: argparse.Namespace) -> dict:
    from partrain.model_options import model_options as given

    hidden = getattr(args, "hidden", None)
    return {**given(args), **({"hidden": hidden} if hidden else {})}


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The device and numerics a profile is taken with and a plan runs with: ``train``'s own
    ``--precision``, ``--channels-last`` and ``--compile`` (``config.add_options``), and
    ``--device`` (the profile's; ``train`` picks the GPU when there is one)."""
    from partrain.config import add_options

    add_options(p, ["precision", "channels_last", "compile"])
    group = next((g for g in p._action_groups if g.title == "speed"), p)
    group.add_argument("--device", choices=["cpu", "cuda"],
                       help="profile on this device (default: the GPU when there is one, as train runs)")
