"""``partrain profile``: a model block by block, or this machine's collectives, through the profile cache."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from partrain.commands.args import (
    PROFILE_DIR_HELP,
    add_data_args,
    add_run_options,
    int_list,
    model_options,
    print_table,
)


def add_profile_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="profile a model block by block, or this machine's collectives (--hardware)",
        description="Measure a model on one worker: per block and batch size forward and backward time, output and "
        "saved-activation bytes, parameters, FLOPs; the optimizer step, the data loading, the process's baseline "
        "memory. With --hardware: time allreduce, all-gather, reduce-scatter, broadcast and send/recv with local "
        "workers over message sizes and fit latency + size / bandwidth. Profiles are cached and reused.",
    )
    add_data_args(p)
    p.add_argument("--batch-sizes", type=int_list, default=[8, 32], help="batch sizes to profile (default: 8,32)")
    p.add_argument("--threads", type=int, help="intra-op threads (default: every core for a model, 1 per worker for --hardware)")
    p.add_argument("--hardware", action="store_true", help="profile the collectives instead of a model")
    p.add_argument("--workers", type=int, default=2, help="--hardware: local workers (default: 2; a launcher's world size under one)")
    p.add_argument("--max-mb", type=float, default=64.0, help="--hardware: largest message in MiB (default: 64)")
    p.add_argument("--quick", action="store_true", help="--hardware: every probe with a third of its rounds, in about "
                   "half the time; noisier, so shown but not cached for predict and recommend")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached profile exists")
    add_run_options(p)
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    import os

    from partrain.predict.fits import default_sizes
    from partrain.profile.cache import NOTICEABLE_LOAD
    from partrain.profile.cache import (
        BUSY_SHARE,
        RunOptions,
        hardware_path,
        load_or_profile,
        profile_dir,
    )
    from partrain.profile.hardware import profile_hardware
    from partrain.report.tables import hardware_table, profile_table

    if args.hardware:
        hw = profile_hardware(args.workers, default_sizes(int(args.max_mb * 2**20)), threads=args.threads or 1,
                              quick=args.quick)
        if hw is None:  # a launched worker other than rank 0
            return 0
        quiet = hw.other_load < BUSY_SHARE  # a contended profile is shown, never kept to spoil later predictions
        # this machine's entry is the one predict and recommend load as their own (``cache.hardware_for``),
        # which they measure with 1 thread a worker and messages up to 64 MiB: measured otherwise, it is
        # shown, not kept in their place (across nodes, the entry is this command's alone: bench's links)
        unlike = [f"--{name} {value:g}" for name, value, ok in (
            ("threads", args.threads or 1, (args.threads or 1) == 1), ("max-mb", args.max_mb, args.max_mb >= 64))
            if not ok] if hw.nodes == 1 else []
        keep = quiet and not unlike and not args.quick
        path = hw.save(hardware_path(profile_dir(args.profile_dir), hw.nodes * hw.workers_per_node, hw.nodes)) if keep else None
        print(json.dumps(hw.to_dict()) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            print_table(hardware_table(hw))
        why = (f" (measured with {' and '.join(unlike)}, where predict and recommend measure 1 thread per worker and "
               "messages up to 64 MiB: kept, it would stand in for theirs)") if unlike and quiet else ""
        why = " (--quick: a first look, not what predict and recommend measure)" if args.quick and quiet else why
        print(f"hardware profile: {path or 'not cached'}{why}", file=sys.stderr)
        if hw.other_load >= NOTICEABLE_LOAD:
            print(f"warning: other processes used {hw.other_load:.0%} of the CPU while the collectives were timed; "
                  f"they may read slow{'' if quiet else ', so it was not cached'}: profile again when the machine is quiet",
                  file=sys.stderr)
        return 0
    options = model_options(args)
    profile, path, reused = load_or_profile(
        args.model, args.dataset, args.batch_sizes, args.threads or os.cpu_count() or 1, args.profile_dir,
        args.data_dir, args.synthetic, options, refresh=args.refresh, run=RunOptions.from_args(args),
    )
    if args.json:
        print(json.dumps(profile.to_dict()))
    else:
        print_table(profile_table(profile))
    announce_profile(profile, path, reused)
    return 0


def announce_profile(profile, path, reused: bool, extra: str = "") -> None:
    """On stderr: which model profile a command used, and whether the machine was busy when it was taken."""
    from partrain.profile.cache import busy_warning

    where = f"{path}{' (cached)' if reused else ''}" if Path(path).is_file() else "not cached (the machine was busy)"
    print(f"model profile: {where}{extra}", file=sys.stderr)
    if warning := busy_warning(profile):
        print(warning, file=sys.stderr)
