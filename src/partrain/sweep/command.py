"""``partrain sweep``: the parser and the handler (cli.py only calls ``add_parser``)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time

from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.outputs import check_file

# how long an interrupted sweep waits for its slots to stop their trials' workers and remove
# their temporary folders (a slot's spawn waits on its workers after SIGKILLing them) before killing them
STOP_GRACE_S = 5.0


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sweep", help="parallel hyper-parameter search (Optuna): W workers, k per trial",
        description="Search run and model options (lr, batch size, momentum, optimizer, epochs, mlp width and depth) "
        "by grid, random or TPE search on Optuna. W workers run W/k trials side by side, each k-way data parallel. "
        "The study lives in Optuna's database storage (an SQLite file by default; any database URL lets many machines "
        "share it); a killed sweep run again keeps its finished trials and reruns the interrupted ones. Bad trials are "
        "pruned on per-epoch accuracy. Prints the trials, the best configuration with the command that reproduces it, "
        "and plots accuracy against each searched value. --plan predicts which k finishes soonest instead.",
    )
    g = p.add_argument_group("the search")
    g.add_argument("--trials", type=int, default=16, help="trials with a verdict in the study in all (default: 16)")
    g.add_argument("--workers", type=int, default=1, help="W: workers the sweep may use (default: 1)")
    g.add_argument("--per-trial", type=int, default=1, help="k: workers per trial, ddp when > 1 (default: 1)")
    g.add_argument("--sampler", choices=["grid", "random", "tpe"], default="tpe", help="default: tpe")
    g.add_argument("--space", nargs="+", metavar="NAME[=SPEC]",
                   help="what to search, e.g. lr=1e-3..0.3:log batch_size=32,64 width depth (a bare name takes its "
                   "default range; default: lr batch_size momentum epochs, and width depth for the mlp)")
    g.add_argument("--grid-points", type=int, default=3, help="grid: values a range is cut into (default: 3)")
    g.add_argument("--no-prune", dest="prune", action="store_false", help="run every trial to the end")
    g.add_argument("--storage", help="Optuna storage: database URL or SQLite file (default: <study>.sqlite3 here)")
    g.add_argument("--study", default="partrain-sweep", help="study name (default: partrain-sweep)")
    g.add_argument("--plot", help="PNG of accuracy against each value (default: <study>.png)")
    g.add_argument("--plan", action="store_true", help="predict the sweep time for every k dividing W and say which "
                   "finishes soonest, from the model and hardware profiles; trains nothing")
    g.add_argument("--profile-dir", help="--plan: profile cache (default: $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("--quiet", action="store_true", help="no line on stderr when the sweep starts")

    g = p.add_argument_group("fixed train options (a searched one takes the trial's value)")
    g.add_argument("--model", default="mlp")
    g.add_argument("--dataset", default="mnist")
    g.add_argument("--data-dir", help="default: $PARTRAIN_DATA_DIR, else ~/.partrain/data")
    g.add_argument("--synthetic", action="store_true")
    g.add_argument("--hidden", type=_ints, help="mlp hidden widths, e.g. 256,128")
    g.add_argument("--activation", choices=["relu", "sigmoid"])
    for name, kind in (("epochs", int), ("steps", int), ("limit", int), ("eval-limit", int), ("batch-size", int),
                       ("lr", float), ("momentum", float), ("weight-decay", float), ("seed", int), ("threads", int),
                       ("bucket-mb", float)):
        default = getattr(RunConfig(), name.replace("-", "_"))
        g.add_argument(f"--{name}", type=kind, default=default, help=f"default: {default}")
    g.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    g.add_argument("--no-eval", dest="evaluate", action="store_false", help="score trials by final train loss")
    p.set_defaults(func=run)


def _base_config(args, batch_size: int) -> RunConfig:
    options = {k: v for k, v in (("hidden", args.hidden), ("activation", args.activation)) if v}
    k = args.per_trial
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)  # never oversubscribe the cores
    return RunConfig(model=args.model, dataset=args.dataset, data_dir=args.data_dir, synthetic=args.synthetic,
                     model_options=options, epochs=args.epochs, steps=args.steps, limit=args.limit,
                     eval_limit=args.eval_limit, evaluate=args.evaluate, batch_size=batch_size, lr=args.lr,
                     momentum=args.momentum, weight_decay=args.weight_decay, optimizer=args.optimizer, seed=args.seed,
                     strategy="ddp" if k > 1 else "serial", workers=k, threads=threads, bucket_mb=args.bucket_mb)


def _settings(args):
    from partrain.distributed.spawn import check_local_workers
    from partrain.sweep.space import check_divisible, parse_space
    from partrain.sweep.storage import storage_url
    from partrain.sweep.study import SweepSettings

    if args.trials < 1:
        raise PartrainError(f"--trials must be at least 1, got {args.trials}")
    if not args.study.strip():
        raise PartrainError("--study needs a name: it names the study in its storage and the default files")
    check_local_workers(args.workers, "a sweep's slots share this machine; more go on other machines sharing --storage")
    if args.per_trial < 1 or args.workers < 1 or args.workers % args.per_trial:
        raise PartrainError(f"--per-trial {args.per_trial} does not divide --workers {args.workers}: "
                            "choose k with W / k trials side by side")
    if args.grid_points < 2:
        raise PartrainError("--grid-points must be at least 2")
    dims = parse_space(args.space, args.model)
    # a searched batch replaces --batch-size, which no trial then uses (33 was refused for a search over 32, 64)
    searched = next((d for d in dims if d.name == "batch_size"), None)
    base = _base_config(args, min(searched.grid(2)) if searched else args.batch_size)
    check_divisible(dims, base, args.per_trial)
    settings = SweepSettings(storage_url(args.storage, args.study), args.study, args.trials, dims, base, args.sampler,
                             args.seed, args.prune, args.grid_points)
    if args.sampler == "grid":
        size = 1
        for d in dims:
            size *= len(d.grid(args.grid_points))
        if args.trials > size:
            raise PartrainError(f"the grid has {size} points, fewer than --trials {args.trials}: "
                                f"use --trials {size} or more --grid-points / values")
    return settings


def run(args) -> int:
    settings = _settings(args)
    if args.plan:
        return _plan(args, settings)
    from partrain.runner import preflight
    from partrain.sweep.storage import open_study
    from partrain.sweep.study import counts, enqueue_grid, reclaim_interrupted, run_slot, slot_main

    preflight(settings.base)  # missing data or an unknown model: one line, before any trial starts
    check_file("--plot", args.plot or f"{args.study}.png")
    study = open_study(settings, create=True)
    reclaimed = reclaim_interrupted(study, failed_too=True)
    if settings.sampler == "grid":
        enqueue_grid(study, settings)
    done, _ = counts(study)
    settings.trials_before = len(study.trials)
    slots = args.workers // args.per_trial
    if not args.quiet and not args.json:
        resumed = f"; resuming: {done} finished" + (f", {reclaimed} interrupted to run again" if reclaimed else "") if done or reclaimed else ""
        print(f"sweep {args.study} in {settings.storage}: {args.trials} trials, {slots} side by side, "
              f"{'serial' if args.per_trial == 1 else f'ddp x{args.per_trial}'} each{resumed}", file=sys.stderr)
    start = time.perf_counter()
    if slots == 1:
        run_slot(settings)
    else:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=slot_main, args=(_with_slot(settings, i),), name=f"sweep-slot-{i}") for i in range(slots)]
        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
        except BaseException:  # Ctrl-C or SIGTERM: stop the slots now (exit would wait for them);
            _stop_slots(procs)  # their trials are marked failed or stay RUNNING, and the next run reclaims them
            raise
        if bad := [p.exitcode for p in procs if p.exitcode]:
            if all(code in INTERRUPTED for code in bad):  # a Ctrl-C at the terminal reached the slots first
                raise KeyboardInterrupt
            raise PartrainError(f"{len(bad)} sweep slot(s) failed (exit {bad[0]}); the study keeps what finished: run "
                                "the same command again to resume")
    return _report(args, settings, open_study(settings), time.perf_counter() - start)


# a slot's exit status when it was interrupted: 130 (it cleaned up), or killed by SIGINT or SIGTERM
INTERRUPTED = frozenset({130, -signal.SIGINT, -signal.SIGTERM})


def _stop_slots(procs, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each slot, which ends its trial as Ctrl-C does: its workers stopped and their
    ``partrain-*`` folder in $TMPDIR removed (a SIGKILL leaves one per running trial). Wait
    ``grace_s`` for them in all, then kill those still running."""
    started = [p for p in procs if p.pid is not None]  # a Ctrl-C may come before the last one started
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    try:
        for proc in started:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:  # even when a second Ctrl-C cuts the wait short
        for proc in started:
            if proc.is_alive():
                proc.kill()
        for proc in started:
            proc.join()


def _with_slot(settings, i: int):
    import dataclasses

    return dataclasses.replace(settings, slot=i)


def _report(args, settings, study, seconds: float) -> int:
    from rich.console import Console

    from partrain.sweep.report import best, plot, trial_rows, trials_table

    rows = trial_rows(study)
    top = best(study, settings.base)
    title = f"{settings.base.model} on {settings.base.dataset}: {args.sampler} search, study {args.study}"
    png = plot(rows, settings.dims, args.plot or f"{args.study}.png", title) if any(r["value"] is not None for r in rows) else None
    if args.json:
        print(json.dumps({"study": args.study, "storage": settings.storage, "seconds": seconds, "trials": rows,
                          "best": {"number": top[0].number, "accuracy": top[0].value, "params": top[0].params,
                                   "command": top[1]} if top else None, "plot": str(png) if png else None}, default=str))
        return _verdict(rows)
    Console(width=None if sys.stdout.isatty() else 200).print(trials_table(rows, settings.dims, title))
    verdicts = {s: sum(r["state"] == s for r in rows) for s in ("COMPLETE", "PRUNED", "FAIL")}
    print(f"{verdicts['COMPLETE']} complete, {verdicts['PRUNED']} pruned, {verdicts['FAIL']} failed or interrupted; "
          f"{seconds:.1f} s this run")
    if top:
        trial, command = top
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
        print(f"best: trial {trial.number}, test accuracy {trial.value:.2%} with {params}\nreproduce it:\n  {command}")
    if png:
        print(f"plot: {png}")
    return _verdict(rows)


def _verdict(rows: list[dict]) -> int:
    """0 when a trial completed; 1, said, when none did (every one failed, or was pruned)."""
    if any(r["state"] == "COMPLETE" for r in rows):
        return 0
    print(f"partrain: no trial of the {len(rows)} completed; the table gives each one's reason", file=sys.stderr)
    return 1


def _plan(args, settings) -> int:
    from rich.console import Console

    from partrain.profile.cache import hardware_for, load_or_profile
    from partrain.sweep.plan import (
        explain,
        measure_start,
        plan_sweep,
        plan_table,
        profile_sizes,
        sample_configs,
    )

    base = settings.base
    configs = sample_configs(settings.dims, base.replace(workers=1, strategy="serial"), args.sampler, args.grid_points,
                             seed=args.seed)
    sizes = profile_sizes(configs, args.workers)
    if not args.json:
        print(f"profiles of {base.model} on {base.dataset} at {base.threads} thread(s), batches {sizes}, and the "
              f"collectives of up to {args.workers} workers: measured once, then cached", file=sys.stderr)

    def profile_for(options: dict):
        return load_or_profile(base.model, base.dataset, sizes, base.threads, args.profile_dir, base.data_dir,
                               base.synthetic, options)[0]

    def start_for(k: int) -> float:
        if not args.json:
            print(f"timing the start of one trial with {k} worker(s)...", file=sys.stderr)
        return measure_start(base, k)

    plans = plan_sweep(configs, base, args.trials, args.workers, profile_for,
                       lambda n: hardware_for(n, args.profile_dir)[0], start_for)
    if args.json:
        print(json.dumps({"best_k": plans[0].k, "plans": [p.to_dict() for p in plans],
                          "why": explain(plans, args.workers, args.trials)}))
        return 0
    title = f"sweep of {args.trials} {settings.base.model} trials on {args.workers} workers ({len(configs)} configurations averaged)"
    Console(width=None if sys.stdout.isatty() else 200).print(plan_table(plans, title))
    print(explain(plans, args.workers, args.trials))
    return 0
