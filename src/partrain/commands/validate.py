"""``partrain validate``: predictions, or the recommender (--recommendations), against the results store."""

from __future__ import annotations

import argparse
import json
import math
import sys

from partrain.commands.args import PROFILE_DIR_HELP, STORE_HELP, print_table
from partrain.errors import PartrainError
from partrain.outputs import check_file


def add_validate_parser(sub) -> None:
    p = sub.add_parser(
        "validate", help="hold predictions against the results store: error per strategy, memory, worst cases",
        description="Predict every successful cell of the results store measured on this machine, with the "
        "configuration it ran, and report the mean absolute percentage error of the time per step per strategy and "
        "overall, the memory error, how often the predicted fastest strategy was the measured fastest, a "
        "predicted-against-measured scatter plot and the worst cases.",
    )
    p.add_argument("--store", help=STORE_HELP)
    p.add_argument("--data-dir", help="where the datasets are (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--plot", default="partrain-validate.png", help="scatter plot PNG (default: partrain-validate.png)")
    p.add_argument("--worst", type=int, default=10, help="worst cases to list (default: 10)")
    p.add_argument("--recommendations", action="store_true",
                   help="judge the recommender: for every job measured under several plans, was its pick the measured "
                   "fastest (hit rate), how much slower if not (regret), and Kendall tau of the orderings; once as "
                   "recommend ranks (plans that train as serial does) and once as recommend --async ranks")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="profile and predict on this device, held against the cells that ran on it (default: the GPU "
                   "when there is one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    if not args.recommendations:
        check_file("--plot", args.plot)
    from partrain.bench import Store

    with Store(args.store, create=False) as store:  # a store that cannot be read: refused before plotting loads
        rows = store.rows()

    from partrain.predict.machine import fingerprint as machine
    from partrain.predict.plan import profile_batch_sizes
    from partrain.profile.cache import busy_warning
    from partrain.profile.cache import (
        RunOptions,
        fingerprint,
        hardware_across,
        hardware_for,
        load_or_profile,
    )
    from partrain.profile.pace import later_pace
    from partrain.report.plots import plot_scatter
    from partrain.report.tables import report_tables
    from partrain.validate import error_signs, speed_shift, twins, without_shift
    from partrain.validate_nodes import link_rates, validate_across_nodes, wire_rate

    def profile_for(cfg, needed):
        run = RunOptions(args.device, cfg.precision, cfg.channels_last, cfg.compile)
        profile = load_or_profile(cfg.model, cfg.dataset, profile_batch_sizes(needed), cfg.threads or 1,
                                  args.profile_dir, args.data_dir, cfg.synthetic, cfg.model_options, run=run)[0]
        if warning := busy_warning(profile):
            print(warning, file=sys.stderr)
        if profile.later_pace_s:  # read at the machine's pace over its cells (bench --profile)
            print(f"{cfg.model}: its profile read at x{later_pace(profile):.3f}, the machine's pace over "
                  f"{len(profile.later_pace_s)} windows timed beside its cells against its own", file=sys.stderr)
        return profile, profile.profile_seconds

    device = "cuda" if RunOptions(args.device).device_kind == "cuda" else "cpu"
    device_name = machine().gpu if device == "cuda" else "cpu"
    # cells across emulated nodes: predicted from the profile measured across their own link
    report, across = validate_across_nodes(
        rows, profile_for, lambda workers: hardware_for(workers, args.profile_dir, device=device)[0],
        lambda workers, nodes, link: hardware_across(workers, nodes, link, args.profile_dir), fingerprint(), device_name)
    if report.mismatched:
        print(f"skipped {report.mismatched} cells for mismatch: they ran on another device than {device_name}, or with "
              "other numerics than their profile", file=sys.stderr)
    if not report.cases:
        raise PartrainError(f"no successful cells measured on this machine ({device_name}) in the store: run `partrain "
                            "bench` first" + (", or validate with --device for the cells that ran elsewhere"
                                              if report.mismatched else ""))
    if args.recommendations:
        return _report_recommendations(report, args.json, across)
    png = plot_scatter(report, args.plot)
    signs = error_signs(report.cases, workers=2)
    pairs = twins(report.cases)
    shift = speed_shift(report.cases)
    unshifted = without_shift(report.cases, shift) if shift is not None else None
    links = link_rates(rows, lambda workers, nodes, link: hardware_across(workers, nodes, link, args.profile_dir))
    if args.json:
        print(json.dumps({**report.to_dict(), "plot": str(png),
                          "links": [{"placement": p, "shaped_mbit": s, "measured_mbit": m,
                                     "wire_mbit": None if m is None else wire_rate(m)} for p, s, m in links],
                          "error_signs_2_workers": {s: {"cells": n, "over": over, "under": under}
                                                    for s, (n, over, under) in signs.items()},
                          "speed_shift": shift,
                          "mape_without_shift": unshifted,
                          "twins": [{"cells": [a.label, b.label], "measured_s": [a.measured_s, b.measured_s],
                                     "apart": apart} for a, b, apart in pairs]}))
        return 0
    for table in report_tables(report, args.worst):
        print_table(table)
    _print_error_signs(signs)
    _print_twins(pairs)
    if shift is not None:
        print(f"the serial cells are predicted {shift:+.0%} (median): serial is the profile's own parts summed, so the "
              f"profiles most likely ran while the machine was {'slower' if shift > 0 else 'faster'} than for the cells, "
              "a shift every prediction carries; profile again into another --profile-dir while it runs as it did then")
        print(f"  with that shift divided out of every prediction: time MAPE {unshifted['all']:.1%} ("
              + ", ".join(f"{s} {m:.1%}" for s, m in sorted(unshifted.items()) if s != "all") + ")")
    for line in report.skipped:
        print(f"  skipped {line}")
    for placement, shaped, measured in links:  # issue 18: within 10% of the shaped rate
        print(f"link {placement}: profile --hardware measured {_link_words(shaped, measured)}")
    print(f"plot: {png}")
    return 0


def _link_words(shaped: float, measured: float | None) -> str:
    """What a link's profile measured (``validate_nodes.link_rates``), against its shaped rate:
    the payload's rate and the frames' it implies (``wire_rate``)."""
    from partrain.validate_nodes import wire_rate

    if measured is None:
        return "nothing: not profiled"
    if math.isnan(measured):
        return "no rate: its largest message was no slower than the one before"
    wire = wire_rate(measured)
    return (f"{measured:.0f} Mbit/s of payload ({measured / shaped - 1:+.1%}), "
            f"{wire:.0f} Mbit/s of frames with their headers ({wire / shaped - 1:+.1%})")


def _print_twins(pairs: list) -> None:
    """How far apart the cells that ran the same thing under two names measured: the floor
    under a single run's error, where the suite has no repeats to show it."""
    if not pairs:
        return
    a, b, worst = max(pairs, key=lambda pair: pair[2])
    mean = sum(apart for _, _, apart in pairs) / len(pairs)
    print(f"the same run measured as two cells (a one-replica hybrid is its pipeline): {len(pairs)} "
          f"{'pair' if len(pairs) == 1 else 'pairs'}, {mean:.0%} apart on average, at most {worst:.0%} "
          f"({a.label}: {a.measured_s * 1e3:.2f} ms, {b.label}: {b.measured_s * 1e3:.2f} ms); no prediction "
          "comes closer to both than half that")


def _print_error_signs(signs: dict) -> None:
    """One line per strategy: how its 2-worker errors split between over and under; the
    strategies whose errors all lean one way named last (a bias, not noise)."""
    from partrain.validate import one_sided

    if not signs:
        return
    print("2-worker errors by sign: " + "; ".join(f"{s} {over} over, {under} under of {n}"
                                                  for s, (n, over, under) in signs.items()))
    biased = one_sided(signs)
    print(f"  all one sign: {', '.join(biased)}" if biased else "  no strategy whose 2-worker errors all share one sign")


def _report_recommendations(report, as_json: bool, across: list = ()) -> int:
    """The recommender judged twice: as ``recommend`` ranks by default (plans that train as
    serial does) and as ``recommend --async`` ranks (local SGD and Hogwild compete too).
    ``across``: the jobs across emulated nodes (their cells and the serial baselines), each
    placement and link a job of its own."""
    from partrain.report.tables import outcome_table
    from partrain.validate_recommend import recommendation_outcomes, summarize_outcomes

    cases = [c for c in report.cases if c not in set(across)] + list(across)
    modes = {"synchronous": recommendation_outcomes(cases),
             "with_async": recommendation_outcomes(cases, include_async=True)}
    if not modes["with_async"]:
        why = f" (skipped: {report.skipped[0]})" if report.skipped else ""
        raise PartrainError("no job in the store was measured under two or more plans: run a suite with several "
                            f"strategies{why}")
    summaries = {mode: {**summarize_outcomes(outcomes), "profile_cost": report.profile_cost()}
                 for mode, outcomes in modes.items()}
    if as_json:
        print(json.dumps({**{mode: {"summary": summaries[mode], "groups": [o.__dict__ for o in outcomes]}
                             for mode, outcomes in modes.items()},
                          "across_nodes": _summarize_across(across, as_json=True)}))
        return 0
    named = (("synchronous", "recommend", "plans that train as serial does"),
             ("with_async", "recommend --async", "local SGD competes too"))
    for mode, command, what in named:
        if modes[mode]:
            print_table(outcome_table(modes[mode], f"{command} ({what}): the pick against the measured fastest"))
    for mode, command, _ in named:
        s = summaries[mode]
        if s["groups"]:
            print(f"{command}: {s['groups']} jobs, top-1 hit rate {s['hit_rate']:.0%} "
                  f"({s['hit_rate_within_noise']:.0%} counting picks the benchmark's repeats cannot tell from the "
                  f"fastest), regret mean {s['mean_regret']:.1%} (worst {s['worst_regret']:.1%}), "
                  f"Kendall tau {s['kendall_tau']:.2f} ({s['kendall_tau_within_noise']:.2f} with pairs whose repeats "
                  "overlap counted as ties)")
    _summarize_across(across, as_json=False)
    print(f"profiling cost {report.profile_cost():.1%} of the benchmark time of the cells it predicts")
    return 0


def _summarize_across(across: list, as_json: bool) -> dict:
    """The recommender over the jobs across emulated nodes alone, per mode: printed, or returned."""
    from partrain.validate_recommend import recommendation_outcomes, summarize_outcomes

    sizes = tuple(sorted({c.group[3] for c in across} - {1}))  # every placement's workers
    out = {mode: summarize_outcomes(recommendation_outcomes(across, sizes, include_async=mode == "with_async"))
           for mode in ("synchronous", "with_async")}
    for mode, s in out.items():
        if s["groups"] and not as_json:
            print(f"across emulated nodes ({'recommend' if mode == 'synchronous' else 'recommend --async'}): "
                  f"{s['groups']} jobs, top-1 hit rate {s['hit_rate']:.0%}, regret mean {s['mean_regret']:.1%} "
                  f"(worst {s['worst_regret']:.1%})")
    return out
