"""Predictions for the report from cached profiles only: a report never measures.

``partrain validate``, ``predict`` and ``trace`` measure a missing profile (seconds to
minutes); the report must open in seconds, so it takes the profiles those commands
cached and says which are missing. The validation itself is ``predict.validate``'s,
run once per profile key so that one missing profile leaves the others' cells in.
"""

from __future__ import annotations

import json
from collections import defaultdict

from partrain.errors import PartrainError


class Missing(Exception):
    """A profile the cache does not hold."""


def model_profile(model: str, dataset: str, needed: list[float], threads: int, synthetic: bool, options: dict,
                  profile_dir: str | None):
    from partrain.predict.plan import profile_batch_sizes
    from partrain.predict.profiles import ModelProfile
    from partrain.profile.cache import profile_dir as directory
    from partrain.profile.cache import profile_path
    from partrain.profile.pace import at_later_pace

    path = profile_path(directory(profile_dir), model, dataset, profile_batch_sizes(needed), threads, synthetic, options)
    if not path.is_file():
        raise Missing(f"no cached profile of {model}/{dataset} at {threads} thread(s)")
    try:
        return at_later_pace(ModelProfile.load(path))  # as validate reads it
    except PartrainError as err:
        raise Missing(str(err)) from None


def hardware(workers: int, profile_dir: str | None):
    from partrain.predict.profiles import HardwareProfile
    from partrain.profile.cache import hardware_path, local_hardware
    from partrain.profile.cache import profile_dir as directory

    if workers <= 1:
        return local_hardware()
    path = hardware_path(directory(profile_dir), workers)
    if not path.is_file():
        raise Missing(f"no cached hardware profile for {workers} workers")
    return HardwareProfile.load(path)


def validation(rows: list[dict], profile_dir: str | None):
    """``predict.validate.Report`` over the cells whose profiles are cached, and what is missing."""
    from partrain.profile.cache import fingerprint
    from partrain.validate import Report, validate

    def profile_for(cfg, needed):
        profile = model_profile(cfg.model, cfg.dataset, needed, cfg.threads or 1, cfg.synthetic, cfg.model_options,
                                profile_dir)
        return profile, profile.profile_seconds

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:  # one validation per profile key: model, dataset, data, threads, model options
        run = json.loads(r["config"]).get("run", {})
        key = json.dumps([r["model"], r["dataset"], r["synthetic"], r["threads"], run.get("model_options")], default=str)
        groups[key].append(r)
    cases, skipped, seconds, missing = [], [], 0.0, []
    for group in groups.values():
        try:
            part = validate(group, profile_for, lambda w: hardware(w, profile_dir), fingerprint())
        except Missing as err:
            missing.append(f"{group[0]['model']}/{group[0]['dataset']}: {err}")
            continue
        cases += part.cases
        skipped += part.skipped
        seconds += part.profile_seconds
    return Report(cases, seconds, skipped), missing
