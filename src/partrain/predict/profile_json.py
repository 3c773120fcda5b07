"""Profiles as JSON files: written atomically, and read only when every figure in them is
one a measurement could give, of the type its dataclass declares (``predict.profiles``)."""

from __future__ import annotations

import json
import math
import os
import types
from dataclasses import fields
from pathlib import Path
from typing import Union, get_args, get_origin, get_type_hints

from partrain.atomic import write_atomic
from partrain.errors import PartrainError


class JsonProfile:
    """Saving and loading for a profile dataclass with ``to_dict`` and ``from_dict``."""

    kind = "profile"  # named in the error when a file cannot be read

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a profile; one that is unreadable or holds a number no measurement gives (NaN,
        an infinity, a negative time or size) is refused rather than fed to the predictor."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise PartrainError(f"{cls.kind} {path} is unreadable ({err}): delete it or profile again") from None
        if bad := first_invalid_number(raw):
            where, value = bad
            raise PartrainError(f"{cls.kind} {path} holds {value} at {where}, which no measurement gives: "
                                "delete it or profile again")
        try:
            return cls.from_dict(raw)
        except (ValueError, KeyError, TypeError) as err:
            raise PartrainError(f"{cls.kind} {path} is unreadable ({err}): delete it or profile again") from None


def first_invalid_number(value, where: str = "") -> tuple[str, float] | None:
    """The first number in a parsed profile that is not finite and >= 0 (where, value), else None.
    Every figure a profile holds is a time, a size, a count or a ratio, none of them negative."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        if isinstance(value, int | float) and not isinstance(value, bool) and not (math.isfinite(value) and value >= 0):
            return where or "the top", value
        return None
    for key, item in items:
        if bad := first_invalid_number(item, f"{where}.{key}" if where else str(key)):
            return bad
    return None


def write_json(path: Path, data: dict) -> Path:
    """Write atomically: a reader never sees half a profile."""
    return write_atomic(path, json.dumps(data, indent=1))


def check_fields(cls, raw, where: str) -> None:
    """Raise ValueError naming the first field of ``raw`` (a ``cls`` as JSON) whose value is not
    of its declared type: a hand-edited profile is refused, not fed to the arithmetic (a time
    that is a string once stopped `predict` with a TypeError)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where.rstrip('.') or 'the top'} is not an object")
    hints = get_type_hints(cls)
    for f in fields(cls):
        if f.name in raw and f.name != "blocks" and not _conforms(raw[f.name], hints[f.name]):
            raise ValueError(f"{where}{f.name} holds {raw[f.name]!r}, not {hints[f.name]}")


def _conforms(value, hint) -> bool:
    """``value`` as JSON gives it fits ``hint``: any number where a number is declared (JSON does
    not keep 1.0 apart from 1), JSON's string keys where a dict has integer ones."""
    origin, args = get_origin(hint), get_args(hint)
    if hint in (int, float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint in (str, bool):
        return isinstance(value, hint)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (list, dict):
        return isinstance(value, hint)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(v, args[1]) for v in value.values())
    return True  # nothing else is declared in a model profile
