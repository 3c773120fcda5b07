"""``partrain report``: one self-contained HTML file over a results store.

What a person sees first: a row of cards (cells measured, the best speedup and the plan
that gave it, the predictor's error against the benchmark's own noise, the machine), then
sections they can fold: the best plan per job with the command that runs it, every cell
(sortable, filterable, 50 rows a page), scaling plots, predicted against measured,
memory per worker and timelines. Plots are capped (``MAX_FIGURES``) so a 500-cell store
gives a report of a few hundred KiB, not one image per cell.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import statistics
import tempfile
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from partrain.errors import PartrainError
from partrain.report import cached
from partrain.report.page import cell, esc, figure_png, fmt, img, page, section, table

MAX_FIGURES = 8  # scaling plots drawn; further jobs are in the table only
MAX_MEMORY_BARS = 30


def label(row: dict) -> str:
    from partrain.bench.suite import Cell

    c = Cell(**json.loads(row["config"])["cell"])
    return dataclasses.replace(c, microbatches=row["microbatches"]).label


def plan_label(row: dict) -> str:
    mb = f" M={row['microbatches']}" if row["microbatches"] and row["strategy"] != "serial" else ""
    return f"{row['strategy']} x{row['workers']}{mb}"


def job_label(row: dict) -> str:
    engine = f"{row['engine']} " if row.get("engine", "torch") != "torch" else ""
    return f"{engine}{row['model']}/{row['dataset']} batch {row['batch_size']} lr {row['lr']:g}"


def command(row: dict) -> str:
    """The ``partrain train`` line that runs a stored cell's plan."""
    from partrain.predict.plan import Plan
    from partrain.validate import row_config

    if row.get("engine") == "scratch":
        from partrain.scratch.bench import command_line

        return command_line(json.loads(row["config"])["run"])

    cfg = row_config(row)
    return shlex.join(["partrain", "train", "--model", cfg.model, "--dataset", cfg.dataset,
                       *Plan.from_config(cfg).cli_args()])


def jobs(rows: list[dict]) -> dict[str, list[dict]]:
    """The ok rows by job (the serial baseline they share), in store order."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["status"] == "ok" and r["seconds_per_epoch"]:
            out[r["baseline_key"]].append(r)
    return out


def torch_job(row: dict) -> str:
    """The baseline key of the row's job on the PyTorch engine: the same for the job's cells of
    either engine, so their speedup curves are drawn on one plot."""
    from partrain.bench.suite import Cell

    c = Cell(**json.loads(row["config"])["cell"])
    return dataclasses.replace(c, engine="torch").baseline_key(row["hardware_hash"])


def by_plan(job_rows: list[dict]) -> list[tuple[str, float, dict]]:
    """(plan, median seconds per epoch over repeats, a row), fastest first."""
    plans: dict[str, list[dict]] = defaultdict(list)
    for r in job_rows:
        plans[plan_label(r)].append(r)
    out = [(p, statistics.median(r["seconds_per_epoch"] for r in rs), rs[0]) for p, rs in plans.items()]
    return sorted(out, key=lambda t: t[1])


# ---- sections ---------------------------------------------------------------------------------


def cards(rows: list[dict], report) -> str:
    statuses = defaultdict(int)
    for r in rows:
        statuses[r["status"]] += 1
    items = [(f"{len(rows)}", "cells", ", ".join(f"{n} {s}" for s, n in statuses.items()))]
    best = max((r for r in rows if r["speedup"] and r["workers"] > 1), key=lambda r: r["speedup"], default=None)
    if best:
        items.append((f"{best['speedup']:.2f}x", "best parallel speedup over serial",
                      f"{label(best)}, efficiency {best['efficiency']:.0%}"))
    if report is not None and report.cases:
        floor = report.noise_floor()
        items.append((f"{report.mape():.1%}", "prediction error (MAPE, step time)",
                      f"{len(report.cases)} configurations; repeats' noise floor {fmt(floor, '.1%') or 'not measured'}"))
    machines = {f"{r['cpu_model']} ({r['cpu_cores']} cores{', ' + r['gpu'] if r['gpu'] else ''})" for r in rows}
    items.append((f"{len(machines)}", "machine" + "s" * (len(machines) > 1), "; ".join(sorted(machines))))
    return "<div class=cards>" + "".join(f"<div class=card><b>{esc(a)}</b>{esc(b)}<br><small>{esc(c)}</small></div>"
                                         for a, b, c in items) + "</div>"


MAX_RECOMMENDATIONS = 12


def recommendations(rows: list[dict], profile_dir: str | None) -> str:
    """``partrain recommend`` for each job of the store (up to its largest worker count), from
    cached profiles: the predicted winner, why, and its command. Jobs without them are named."""
    from partrain.recommend import needed_batch_sizes, recommend

    wanted: dict[tuple, int] = {}
    for r in rows:
        if r.get("engine") == "scratch":
            continue  # the recommender plans the PyTorch engine's strategies only
        options = json.loads(r["config"]).get("run", {}).get("model_options") or {}
        key = (r["model"], r["dataset"], r["batch_size"], bool(r["synthetic"]), json.dumps(options, sort_keys=True))
        wanted[key] = max(wanted.get(key, 1), r["workers"])
    parts, missing = [], []
    for (model, dataset, batch, synthetic, options), workers in list(wanted.items())[:MAX_RECOMMENDATIONS]:
        needed = needed_batch_sizes(workers, batch)
        try:
            hw = cached.hardware(workers, profile_dir)
            rec = recommend(lambda threads: cached.model_profile(model, dataset, needed, threads, synthetic,
                                                                 json.loads(options), profile_dir), hw, workers, batch)
        except (cached.Missing, PartrainError) as err:
            missing.append(f"{model}/{dataset} batch {batch}, up to {workers} workers: {err}")
            continue
        parts.append(f"<p><b>{esc(model)}/{esc(dataset)} batch {batch}, up to {workers} workers</b>: "
                     f"{esc(rec.explanation())}<br>run it: <code>{esc(rec.local_command())}</code></p>")
    if len(wanted) > MAX_RECOMMENDATIONS:
        parts.append(f"<p class=note>{len(wanted) - MAX_RECOMMENDATIONS} more jobs not asked (the first "
                     f"{MAX_RECOMMENDATIONS} only)</p>")
    if missing:
        parts.append("<p class=note>No recommendation without cached profiles (<code>partrain recommend --model M "
                     "--dataset D --workers W --batch-size B</code> measures them): " + esc("; ".join(missing)) + "</p>")
    return "<h3>What partrain recommend predicts</h3>" + "".join(parts) if parts or missing else ""


def best_plans(rows: list[dict], report, profile_dir: str | None = None) -> str:
    """Per job: the measured fastest plan, its speedup beside the runner-up, the command; then
    the recommender's pick among the same measured plans."""
    from partrain.validate_recommend import recommendation_outcomes

    lines = []
    for job_rows in jobs(rows).values():
        ranked = by_plan(job_rows)
        name, seconds, row = ranked[0]
        serial = next((s for p, s, r in ranked if r["strategy"] == "serial"), None)
        speedup = serial / seconds if serial else None
        efficiency = speedup / row["workers"] if speedup else None
        runner = f"{ranked[1][0]}: {ranked[1][1] / seconds:.2f}x as long" if len(ranked) > 1 else ""
        lines.append(("", cell(job_label(row)) + cell(name, left=True) + cell(seconds, fmt(seconds, ".2f"))
                      + cell(speedup, fmt(speedup, ".2f")) + cell(efficiency, fmt(efficiency, ".0%"))
                      + cell(runner, left=True) + f'<td class="t cmd"><code>{esc(command(row))}</code></td>'))
    if not lines:
        return section("Best plan per job", "<p class=note>no successful cells</p>", "best")
    body = ("<p>The fastest measured plan of every job (model, dataset, batch, learning rate: the cells that share a "
            "serial baseline), its speedup over serial and parallel efficiency, the next fastest, and the command "
            "that runs it.</p>"
            + table(["job", "fastest plan", "s/epoch", "speedup", "efficiency", "next fastest", "run it"], lines,
                    paged=len(lines) > 10, left={0, 1, 5, 6}))
    if report is not None and report.cases:
        outcomes = recommendation_outcomes(report.cases)
        if outcomes:
            body += ("<p>The recommender's pick among the measured plans (predicted fastest) against the measured "
                     "fastest; regret: how much slower the pick ran.</p>")
            body += table(["job", "plans", "picked", "measured fastest", "regret", "Kendall tau"], left={0, 2, 3},
                          rows=
                          (("", cell(o.key) + cell(o.plans) + cell(o.picked, left=True) + cell(o.best, left=True)
                            + cell(o.regret, fmt(o.regret, ".1%")) + cell(o.tau, fmt(o.tau, ".2f"))) for o in outcomes))
    body += recommendations(rows, profile_dir)
    return section("Best plan per job, and the command that runs it", body, "best")


def results(rows: list[dict]) -> str:
    headers = ["cell", "suite", "status", "ms/step", "p10-p90 ms", "s/epoch", "samples/s", "speedup", "efficiency",
               "peak MiB (max)", "MiB per worker", "accuracy", "final loss"]

    def line(r: dict) -> tuple[str, str]:
        per_worker = json.loads(r["peak_memory_per_worker"]) if r["peak_memory_per_worker"] else []
        spread = f"{fmt(r['step_seconds_p10'], '.2f', 1e3)}-{fmt(r['step_seconds_p90'], '.2f', 1e3)}" if r["step_seconds_p10"] else ""
        epoch = fmt(r["seconds_per_epoch"], ".2f") + ("*" if r["epoch_extrapolated"] else "")
        return ("" if r["status"] == "ok" else "bad",
                cell(label(r)) + cell(r["suite"] or "") + cell(r["status"], title=r["reason"])
                + cell(r["step_seconds_median"], fmt(r["step_seconds_median"], ".2f", 1e3))
                + cell(r["step_seconds_p10"], spread) + cell(r["seconds_per_epoch"], epoch)
                + cell(r["samples_per_s"], fmt(r["samples_per_s"], ",.0f")) + cell(r["speedup"], fmt(r["speedup"], ".2f"))
                + cell(r["efficiency"], fmt(r["efficiency"], ".0%")) + cell(r["peak_memory_bytes"], fmt(r["peak_memory_bytes"], ",.0f", 2**-20))
                + cell(None, " ".join(f"{b / 2**20:.0f}" for b in per_worker)) + cell(r["test_accuracy"], fmt(r["test_accuracy"], ".2%"))
                + cell(r["final_loss"], fmt(r["final_loss"], ".4f")))

    reasons = sum(1 for r in rows if r["reason"])
    note = ("<p class=note>* epoch extrapolated from the median step. Speedup: the matching serial cell's time per epoch "
            "over this cell's; efficiency: speedup / workers. Click a header to sort, type to filter"
            + (f"; hover a status for the reason ({reasons} cells did not run)" if reasons else "") + ".</p>")
    return section(f"All cells ({len(rows)})", note + table(headers, map(line, rows), "cells", paged=True, left=3), "cells")


def scaling(rows: list[dict]) -> str:
    """Speedup and efficiency against workers per job; the scaling studies' own plots."""
    from partrain.bench.scaling import regimes
    from partrain.report import plots

    figures, skipped = [], 0
    studies: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if (r["suite"] or "").startswith("scale-"):
            studies[r["suite"][6:], r["model"], r["dataset"]].append(r)
    drawn = []
    for (kind, *_), group in studies.items():
        drawn.append((kind, group))
    both_engines: dict[str, list[dict]] = defaultdict(list)  # a job's torch and scratch cells: one plot
    for group in jobs(rows).values():
        both_engines[torch_job(group[0])] += group
    for group in both_engines.values():
        if len({r["workers"] for r in group}) > 1 and not group[0]["suite"].startswith("scale-"):
            drawn.append(("strong", group))
    with tempfile.TemporaryDirectory() as tmp:
        for i, (kind, group) in enumerate(drawn):
            if len(figures) >= MAX_FIGURES:
                skipped += 1
                continue
            path = Path(tmp, f"{i}.png")
            if kind == "batch-size":
                first = plots.series(group, "batch_size", lambda r: r["seconds_per_epoch"])
                plots.plot_batch_size(group, path, regimes(next(iter(first.values()), [])))
            else:
                {"lr": plots.plot_lr, "strong": plots.plot_strong, "weak": plots.plot_weak}[kind](group, path)
            figures.append(img(path.read_bytes(), f"{kind} scaling of {group[0]['model']}", "plot"))
    if not figures:
        return section("Scaling", "<p class=note>no job was measured on more than one worker count</p>", "scaling")
    more = f"<p class=note>{skipped} more plots not drawn (see the table)</p>" if skipped else ""
    return section("Scaling", "".join(figures) + more, "scaling")


def prediction(report, missing: list[str]) -> str:
    from partrain.report.plots import plot_scatter

    lacks = "".join(f"<li>{esc(m)}</li>" for m in missing)
    hint = (f"<p class=note>Not predicted (run <code>partrain validate --store ...</code> to measure the missing "
            f"profiles):</p><ul class=note>{lacks}</ul>") if missing else ""
    if report is None or not report.cases:
        return section("Predicted against measured", hint or "<p class=note>no cells to predict</p>", "predicted")
    per = report.per_strategy()
    rows = [("", cell(s, left=True) + cell(n) + cell(m, fmt(m, ".1%")) + cell(w, fmt(w, ".1%")) + cell(f, fmt(f, ".1%") or "-"))
            for s, (n, m, w, f) in per.items()]
    rows.append(("", cell("all", left=True) + cell(len(report.cases)) + cell(report.mape(), fmt(report.mape(), ".1%"))
                 + cell(max(abs(c.error) for c in report.cases), fmt(max(abs(c.error) for c in report.cases), ".1%"))
                 + cell(report.noise_floor(), fmt(report.noise_floor(), ".1%") or "-")))
    rank = report.ranking()
    text = (f"<p>Mean absolute percentage error of the median step time per strategy; the noise floor is how far a "
            f"configuration's repeats lie from their median (what a perfect predictor would score; '-' without "
            f"repeats). Memory error {fmt(report.memory_mape(), '.1%')}. The predicted fastest strategy was the measured "
            f"fastest in {fmt(rank['hit_rate'], '.0%')} of {rank['groups']} groups (regret {fmt(rank['regret'], '.1%')}).</p>")
    with tempfile.TemporaryDirectory() as tmp:
        scatter = img(plot_scatter(report, Path(tmp, "s.png")).read_bytes(), "predicted against measured", "plot")
    worst = [("", cell(c.label) + cell(c.measured_s, fmt(c.measured_s, ".2f", 1e3)) + cell(c.predicted_s, fmt(c.predicted_s, ".2f", 1e3))
              + cell(c.error, fmt(c.error, "+.1%")) + cell(c.measured_bytes, fmt(c.measured_bytes, ".0f", 2**-20))
              + cell(c.predicted_bytes, fmt(c.predicted_bytes, ".0f", 2**-20))) for c in report.worst(len(report.cases))]
    body = (text + table(["strategy", "cells", "MAPE", "worst", "noise floor"], rows) + scatter
            + "<p>Every predicted cell, worst first:</p>"
            + table(["cell", "measured ms", "predicted ms", "error", "measured MiB", "predicted MiB"], worst, paged=True)
            + hint)
    return section("Predicted against measured", body, "predicted")


def memory(rows: list[dict]) -> str:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ok = [r for r in rows if r["status"] == "ok" and r["peak_memory_per_worker"]]
    if not ok:
        return ""
    ok = sorted(ok, key=lambda r: -r["peak_memory_bytes"])[:MAX_MEMORY_BARS]
    fig = Figure(figsize=(10, 1 + 0.28 * len(ok)), layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(ok):
        per = json.loads(r["peak_memory_per_worker"])
        height = 0.8 / len(per)
        for k, b in enumerate(per):
            ax.barh(i - 0.4 + height * (k + 0.5), b / 2**20, height=height, color=f"C{k % 10}")
    ranks = max(len(json.loads(r["peak_memory_per_worker"])) for r in ok)
    ax.legend(handles=[Patch(color=f"C{k % 10}", label=f"rank {k}") for k in range(min(ranks, 8))], fontsize=7,
              loc="lower right")
    ax.set_yticks(range(len(ok)), [label(r) for r in ok], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("peak memory per worker, MiB (resident set on CPU, allocator peak on GPU)")
    note = f"<p class=note>The {len(ok)} cells with the largest peak; every cell's figures are in the table.</p>"
    return section("Memory per worker", note + img(figure_png(fig), "memory per worker", "plot"), "memory")


def timelines(events: list[str], profile_dir: str | None) -> str:
    from partrain.report.gantt import png_bytes
    from partrain.report.trace import add_predicted, measured_timeline, run_plan

    if not events:
        return section("Timelines", "<p class=note>no run's events given: record a run with <code>partrain train ... "
                       "--events DIR</code> and pass <code>--events DIR</code> to the report</p>", "timelines", open_=False)
    parts = []
    for directory in events:
        t = measured_timeline(directory)
        plan, cfg = run_plan(t.meta)
        note = ""
        if plan is not None:
            try:
                threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers)  # as the run's workers (set_threads)
                profile = cached.model_profile(cfg.model, cfg.dataset, list(plan.batch_sizes()), threads, cfg.synthetic,
                                               cfg.model_options, profile_dir)
                add_predicted(t, profile, cached.hardware(cfg.workers, profile_dir), plan)
            except cached.Missing as err:
                note = f" Not predicted: {err} (partrain trace {directory} measures it)."
        parts.append(f"<h3>{esc(directory)}</h3><p class=note>The last two steps; measured ranks above, the predictor's "
                     f"simulated schedule below the line.{esc(note)}</p>" + img(png_bytes(t), f"timeline of {directory}", "timeline"))
    return section("Timelines", "".join(parts), "timelines")


def build_report(store: str | None, output: str, events: list[str], profile_dir: str | None = None,
                 title: str | None = None) -> Path:
    from partrain.atomic import write_atomic
    from partrain.bench import Store

    with Store(store, create=False) as db:
        rows, path = db.rows(), db.path
    if not rows:
        raise PartrainError(f"the results store {path} holds no cells: run `partrain bench` first")
    report, missing = cached.validation(rows, profile_dir)
    body = (cards(rows, report) + best_plans(rows, report, profile_dir) + results(rows) + scaling(rows) + prediction(report, missing)
            + memory(rows) + timelines(events, profile_dir))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = f"{esc(path)} &middot; {len(rows)} cells &middot; written {when}"
    return write_atomic(output, page(title or f"partrain report: {path.stem}", meta, body))
