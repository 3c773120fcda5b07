"""``partrain predict``: time, memory and breakdown of every plan for one worker count."""

from __future__ import annotations

import argparse
import json
import sys

from partrain.commands.args import (
    PROFILE_DIR_HELP,
    add_data_args,
    add_run_options,
    int_list,
    model_options,
    print_table,
    str_list,
)
from partrain.commands.profile import announce_profile
from partrain.errors import PartrainError
from partrain.spec import strategy_spec


def add_predict_parser(sub) -> None:
    p = sub.add_parser(
        "predict", help="predict time per step and epoch, memory and breakdown for every strategy",
        description="Predict, for every strategy and the parameters that matter (pp x dp, micro-batches, schedule, "
        "bucket size, averaging period), seconds per step and per epoch, peak memory per worker and the breakdown "
        "compute / exposed communication / pipeline bubble / optimizer / data, from a model profile and this "
        "machine's hardware profile (each measured first if not cached) or a cluster file.",
    )
    add_data_args(p)
    p.add_argument("--workers", type=int, default=1, help="number of workers (default: 1)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (default: 64)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    p.add_argument("--threads", type=int, help="intra-op threads per worker (default: cores / local workers, as train)")
    p.add_argument("--strategies", type=str_list, help="only these strategies (comma-separated)")
    p.add_argument("--cluster", help="predict for a cluster instead of this machine: a TOML description (see examples/cluster.toml) or a hardware profile .json measured there (profile --hardware under torchrun)")
    p.add_argument("--profile-batch-sizes", type=int_list, help="model profile batch sizes (default: covering the plans)")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    add_run_options(p)
    p.add_argument("--all", action="store_true", help="also list the plans that cannot run, with the reason")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from partrain.predict import enumerate_plans, predict_plan
    from partrain.predict.cluster import check_workers_fit, load_cluster
    from partrain.predict.plan import (
        candidate_plans,
        local_workers,
        profile_batch_sizes,
        threads_for,
    )
    from partrain.predict.provenance import provenance, provenance_lines
    from partrain.profile.cache import (
        RunOptions,
        hardware_for,
        load_or_profile,
        profile_threads,
    )
    from partrain.report.tables import predictions_table

    from partrain.runner import check_job

    run = RunOptions.from_args(args)
    for name in args.strategies or []:
        strategy_spec(name)  # an unknown name refused before anything is measured
    check_job(args.model, args.dataset, args.data_dir, args.synthetic, model_options(args))
    if args.cluster:
        hw = load_cluster(args.cluster)
        check_workers_fit(hw, args.workers, f"--cluster {args.cluster}")
    else:
        hw, hw_path, hw_reused = hardware_for(args.workers, args.profile_dir, device=run.device)
        if not hw_reused:
            print(f"measured this machine's collectives with {args.workers} workers: {hw_path or 'not kept'}", file=sys.stderr)
    # the threads the plans' workers will run with, as recommend profiles them
    threads = profile_threads(threads_for(args.workers, hw, args.threads))
    options = model_options(args)
    plans = candidate_plans(args.workers, args.batch_size)  # the profile is sized to cover every plan
    sizes = args.profile_batch_sizes or profile_batch_sizes([b for plan in plans for b in plan.batch_sizes()])
    profile, path, reused = load_or_profile(args.model, args.dataset, sizes, threads, args.profile_dir, args.data_dir,
                                            args.synthetic, options, run=run)
    checked = enumerate_plans(profile, args.workers, args.batch_size, args.optimizer, args.momentum, args.threads,
                              with_invalid=True, hardware=hw)
    wanted = [(plan, why) for plan, why in checked if not args.strategies or plan.strategy in args.strategies]
    predictions = [predict_plan(profile, hw, plan) for plan, why in wanted if why is None]
    if not predictions:  # an empty table says nothing: say why
        reasons = sorted({why for _, why in wanted if why}) or [
            "serial runs on 1 worker; data-parallel strategies and pipelines on 2 or more; hybrid on pp x dp, "
            "both at least 2"]
        raise PartrainError(f"no plan of {', '.join(args.strategies or ['any strategy'])} can run {args.model} on "
                            f"{args.workers} worker(s) at batch {args.batch_size}: {'; '.join(reasons)}")
    limit = hw.memory_limit_per_worker(local_workers(args.workers, hw))
    prov = provenance(profile, hw, args.cluster)
    if args.json:
        print(json.dumps({"hardware": hw.description, "memory_limit_bytes": limit, "model_profile": str(path),
                          "device": profile.device, **profile.run_options(), "provenance": prov,
                          "profile_seconds": profile.profile_seconds, "profile_reused": reused,
                          "predictions": [p.to_dict() for p in predictions],
                          "invalid": [{"plan": p.label(), "reason": why} for p, why in wanted if why and args.all]}))
        return 0
    title = f"{args.model} on {args.dataset}, {args.workers} worker(s), batch {args.batch_size}, {hw.description}"
    print_table(predictions_table(predictions, title, limit))
    for line in provenance_lines(prov):
        print(line)
    for note in sorted({n for p in predictions for n in p.notes if "side by side" in n}):  # where the sharing came from
        print(f"  {note}")
    for plan, why in wanted:
        if why and args.all:
            print(f"  cannot run {plan.label()}: {why}")
    announce_profile(profile, path, reused, f"; memory limit {limit / 2**30:.1f} GiB per worker")
    return 0
