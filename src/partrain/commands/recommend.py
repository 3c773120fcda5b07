"""``partrain recommend``: the fastest plan that fits, why, and the command that runs it (--run runs it)."""

from __future__ import annotations

import argparse
import json
import sys

from partrain.commands.args import (
    PROFILE_DIR_HELP,
    add_data_args,
    add_run_options,
    model_options,
    print_table,
)
from partrain.errors import PartrainError


def add_recommend_parser(sub) -> None:
    p = sub.add_parser(
        "recommend", help="the fastest plan that fits, why, and the command that runs it",
        description="Enumerate every plan (strategy x workers up to N x pp/dp split x micro-batches x schedule x "
        "batch), drop those that cannot run or do not fit in memory (saying why), rank the rest by predicted time "
        "per epoch, explain the winner, and print the command that runs it. Profiles are measured first when not "
        "cached. --run trains the winner straight away and prints the measured step time beside the prediction.",
    )
    add_data_args(p)
    p.add_argument("--workers", type=int, help="at most this many workers (default: the cluster's, else 1)")
    p.add_argument("--cluster", help="recommend for a cluster instead of this machine: a TOML description (see examples/cluster.toml) or a hardware profile .json measured there (profile --hardware under torchrun)")
    p.add_argument("--batch-size", type=int, help="fix the global batch (default: free, 32/64/128 per worker)")
    p.add_argument("--memory-limit", help="memory per worker, e.g. 2GB (default: the device's, or RAM / local workers)")
    p.add_argument("--objective", choices=["time", "memory"], default="time", help="rank by time per epoch (default) or memory")
    p.add_argument("--threads", type=int, help="intra-op threads per worker (default: cores / local workers, as train)")
    p.add_argument("--async", dest="include_async", action="store_true",
                   help="also rank local-sgd and hogwild, which do not reproduce serial training")
    p.add_argument("--top", type=int, default=8, help="plans to show (default: 8)")
    p.add_argument("--all", action="store_true", help="list every plan that was dropped, with the reason")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--refresh", action="store_true", help="profile again even when cached")
    add_run_options(p)
    p.add_argument("--run", action="store_true", help="train the recommended plan now")
    p.add_argument("--steps", type=int, default=100, help="--run: optimizer steps to train (default: 100)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=cmd_recommend)


def cmd_recommend(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from partrain.predict.cluster import check_workers_fit, load_cluster
    from partrain.predict.plan import profile_batch_sizes
    from partrain.predict.provenance import provenance, provenance_lines
    from partrain.profile.cache import (
        RunOptions,
        hardware_for,
        load_or_profile,
        profile_threads,
    )
    from partrain.recommend import (
        needed_batch_sizes,
        parse_bytes,
        recommend,
        recommendation_table,
    )

    from partrain.runner import check_job

    console = Console(stderr=True)
    run = RunOptions.from_args(args)
    check_job(args.model, args.dataset, args.data_dir, args.synthetic, model_options(args))  # before any measuring
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    if args.run and args.cluster:
        raise PartrainError("--run trains the pick on this machine, which --cluster does not describe: a measurement "
                            "here says nothing of the prediction there; run the printed command on that cluster")
    hw = load_cluster(args.cluster) if args.cluster else None
    workers = args.workers or (hw.nodes * hw.workers_per_node if hw else 1)
    if workers < 1:
        raise PartrainError(f"--workers must be at least 1, got {workers}")
    if hw is not None:
        check_workers_fit(hw, workers, f"--cluster {args.cluster}")
    start, profiled, kept = time.perf_counter(), [], True  # kept: every new profile was cached
    if hw is None:
        with console.status(f"measuring this machine's collectives with {workers} workers (cached afterwards)..."):
            hw, hw_path, reused = hardware_for(workers, args.profile_dir, device=run.device)
        profiled += [] if reused else ["collectives"]
        kept = hw_path is not None or workers <= 1
    sizes = profile_batch_sizes(needed_batch_sizes(workers, args.batch_size))
    options = model_options(args)

    used = []

    def profile_for(threads: int):
        nonlocal kept
        threads = profile_threads(threads)
        with console.status(f"profiling {args.model} on {args.dataset} with {threads} thread(s), batches {sizes}..."):
            profile, path, reused = load_or_profile(args.model, args.dataset, sizes, threads, args.profile_dir,
                                                    args.data_dir, args.synthetic, options, refresh=args.refresh, run=run)
        profiled.extend([] if reused else [f"{args.model} at {threads} thread(s)"])
        kept = kept and path.is_file()
        used.append(profile)
        return profile

    rec = recommend(profile_for, hw, workers, args.batch_size, limit, args.objective, args.threads, args.include_async)
    rec.data_dir, rec.profile_seconds, rec.profile_reused = args.data_dir, time.perf_counter() - start, not profiled
    prov = provenance(used[-1], hw, args.cluster)
    if args.json:
        measured = _run_recommended(rec, args) if args.run else None
        print(json.dumps({**rec.to_dict(), "provenance": prov, "measured": measured}, default=str))
        return 0
    if profiled:
        cached = "cached for next time" if kept else "not all cached: the machine was busy"
        print(f"profiled {', '.join(profiled)} in {rec.profile_seconds:.1f} s ({cached})", file=sys.stderr)
    print_table(recommendation_table(rec, args.top))
    for line in provenance_lines(prov):
        print(line)
    print(f"\n{rec.explanation()}\n")
    dropped = rec.rejected if args.all else rec.rejected[:3]
    if rec.rejected:
        print(f"{len(rec.rejected)} plans dropped{' (first 3; --all lists them)' if not args.all else ''}:")
        for plan, reason in dropped:
            print(f"  {plan.label()} on {plan.workers} workers, batch {plan.batch_size}: {reason}")
    print(f"\nrun it here:\n  {rec.local_command()}\nor on each node, under torchrun:\n  {rec.torchrun_command()}")
    measured = _run_recommended(rec, args) if args.run else None  # after the recommendation that chose it
    if measured:
        print(f"\nmeasured {measured['seconds_per_step'] * 1e3:.2f} ms/step over {measured['steps']} steps, predicted "
              f"{measured['predicted_seconds_per_step'] * 1e3:.2f} ms/step ({measured['error']:+.0%})")
    return 0


def _run_recommended(rec, args: argparse.Namespace) -> dict:
    """Train the winner for ``--steps`` steps; its measured step time beside the prediction."""
    from partrain.runner import run_training

    cfg = rec.config(steps=args.steps, eval_limit=1000)
    result = run_training(cfg, show_progress=not args.json)
    if result is None:
        return {}
    summary, predicted = result.summary(), rec.winner.median_step_s
    print(f"trained {rec.winner.plan.label()}: test accuracy {summary['test_accuracy']:.2%} after {summary['steps']} steps",
          file=sys.stderr)
    return {**summary, "predicted_seconds_per_step": predicted,
            "error": summary["seconds_per_step"] / predicted - 1 if summary["seconds_per_step"] else None}
