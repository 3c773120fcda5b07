"""``--model-option KEY=VALUE``: a model's own options from the command line (gpt's sizes, a factory's knobs).

Values are read as Python literals where they parse (``4``, ``0.1``, ``true``, ``(64, 32)``)
and kept as strings otherwise; the builder receives them by keyword and refuses unknown keys.
"""

from __future__ import annotations

import argparse
import ast


def parse_option(text: str) -> tuple[str, object]:
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    literal = {"true": "True", "false": "False", "none": "None"}.get(value.strip().lower(), value)
    try:
        return key.strip().replace("-", "_"), ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return key.strip().replace("-", "_"), value


def add_model_option_arg(group) -> None:
    group.add_argument("--model-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                       help="an option of the model, repeatable: e.g. --model-option layers=4 --model-option d_model=128 for gpt")


def model_options(args: argparse.Namespace) -> dict:
    """The model options a command line gives: ``--activation`` and every ``--model-option``."""
    options = {"activation": args.activation} if getattr(args, "activation", None) else {}
    return {**options, **dict(getattr(args, "model_option", None) or [])}
