"""Predictions held against the results store: error per strategy, memory error, worst cases.

Every successful cell measured on this hardware is predicted from a model profile (the
cached one for its model, dataset, threads and batch sizes, measured now if missing) and
the hardware profile of this machine, with the configuration the cell ran. Reported:

- the mean absolute percentage error (MAPE) of the median steady-state step time, per
  strategy and overall, and of the peak memory per worker; a configuration measured more
  than once (a suite's ``repeats``) counts once, at the median of its repeats, and how far
  its repeats lie from that median is the noise floor: what a perfect predictor would score;
- how often the predicted fastest strategy of a group of cells (same model, dataset, batch,
  workers and threads) was the measured fastest, the regret of the pick (how much slower it
  ran than the measured best), and the Spearman rank correlation within groups;
- the cost of the profiles against the wall time of the cells they predict;
- a predicted-against-measured scatter plot and the worst cases.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from partrain.config import RunConfig
from partrain.predict.strategies import Plan, Prediction, predict_plan
from partrain.profile.hardware import HardwareProfile
from partrain.profile.model import ModelProfile

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(RunConfig)}


@dataclass(frozen=True)
class Case:
    """One measured cell and its prediction."""

    label: str
    group: tuple  # cells that compete for the same job: model, dataset, batch, workers, threads
    strategy: str
    measured_s: float
    predicted_s: float
    measured_bytes: int
    predicted_bytes: int
    wall_s: float  # benchmarking the configuration once
    repeats: tuple[float, ...] = ()  # each repeat's median step time; measured_s is their median

    @property
    def repeat_spread(self) -> float | None:
        """Mean relative distance of the repeats from their median: the error a perfect
        predictor would show against a single run (None with one repeat)."""
        if len(self.repeats) < 2:
            return None
        return statistics.fmean(abs(r - self.measured_s) / self.measured_s for r in self.repeats)

    @property
    def error(self) -> float:
        """Signed relative error of the step time: (predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass
class Report:
    cases: list[Case]
    profile_seconds: float
    skipped: list[str]

    def mape(self, strategy: str | None = None) -> float:
        errors = [abs(c.error) for c in self.cases if strategy in (None, c.strategy)]
        return statistics.fmean(errors) if errors else float("nan")

    def noise_floor(self, strategy: str | None = None) -> float:
        """Mean ``repeat_spread`` over the cases measured more than once (nan if none)."""
        spreads = [c.repeat_spread for c in self.cases if strategy in (None, c.strategy) and c.repeat_spread is not None]
        return statistics.fmean(spreads) if spreads else float("nan")

    def memory_mape(self) -> float:
        return statistics.fmean(abs(c.memory_error) for c in self.cases) if self.cases else float("nan")

    def per_strategy(self) -> dict[str, tuple[int, float, float, float]]:
        """strategy -> (cases, MAPE, worst absolute error, repeat noise floor)."""
        out = {}
        for s in sorted({c.strategy for c in self.cases}):
            errs = [abs(c.error) for c in self.cases if c.strategy == s]
            out[s] = (len(errs), statistics.fmean(errs), max(errs), self.noise_floor(s))
        return out

    def worst(self, n: int = 10) -> list[Case]:
        return sorted(self.cases, key=lambda c: -abs(c.error))[:n]

    def ranking(self) -> dict[str, float]:
        """Hit rate of the predicted fastest, mean regret of that pick, mean Spearman rho, over groups
        of two or more cells."""
        groups: dict[tuple, list[Case]] = defaultdict(list)
        for c in self.cases:
            groups[c.group].append(c)
        hits, regrets, rhos = [], [], []
        for cases in groups.values():
            if len(cases) < 2:
                continue
            picked = min(cases, key=lambda c: c.predicted_s)
            best = min(cases, key=lambda c: c.measured_s)
            hits.append(picked is best)
            regrets.append(picked.measured_s / best.measured_s - 1)
            rhos.append(spearman([c.predicted_s for c in cases], [c.measured_s for c in cases]))
        mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
        rhos = [r for r in rhos if not math.isnan(r)]  # a group of ties has no rank correlation
        return {"groups": len(hits), "hit_rate": mean(hits), "regret": mean(regrets), "spearman": mean(rhos)}

    def profile_cost(self) -> float:
        """Profiling seconds as a fraction of the wall time of the cells predicted."""
        wall = sum(c.wall_s for c in self.cases)
        return self.profile_seconds / wall if wall else float("nan")

    def to_dict(self) -> dict:
        return {
            "cases": [{**dataclasses.asdict(c), "error": c.error, "memory_error": c.memory_error} for c in self.cases],
            "mape": self.mape(), "memory_mape": self.memory_mape(),
            "per_strategy": {s: {"cases": n, "mape": m, "worst": w, "noise_floor": f}
                             for s, (n, m, w, f) in self.per_strategy().items()},
            "noise_floor": self.noise_floor(),
            "ranking": self.ranking(), "profile_cost": self.profile_cost(), "skipped": self.skipped,
        }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (Pearson's r of the ranks; ties get their mean rank)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def row_config(row: dict) -> RunConfig:
    """The ``RunConfig`` a stored cell ran, with the pipeline stage cut it chose if recorded
    (the run times its blocks to cut; the profile's timings might cut elsewhere)."""
    run = json.loads(row["config"])["run"] if isinstance(row["config"], str) else row["config"]["run"]
    fields = {k: v for k, v in run.items() if k in _CONFIG_FIELDS}
    chosen = (run.get("resolved") or {}).get("split_points")
    if chosen and not fields.get("split_points"):
        fields["split_points"] = chosen
    return RunConfig(**fields)


def measured_rows(rows: list[dict], hardware_hash: str) -> list[dict]:
    """The successful, timed cells measured on this hardware."""
    return [r for r in rows if r["status"] == "ok" and r["hardware_hash"] == hardware_hash and r["step_seconds_median"]]


def repeat_groups(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by what was measured, repeats together, in store order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        config = json.loads(row["config"]) if isinstance(row["config"], str) else row["config"]
        run = {k: v for k, v in config["run"].items() if k != "resolved"}
        cell = {k: v for k, v in config.get("cell", {}).items() if k != "repeat"}
        groups.setdefault(json.dumps([run, cell, row["hardware_hash"]], sort_keys=True), []).append(row)
    return list(groups.values())


def _peak(row: dict) -> int:
    per_worker = row["peak_memory_per_worker"]
    measured = json.loads(per_worker) if isinstance(per_worker, str) else per_worker
    return max(measured) if measured else row["peak_memory_bytes"]


def _case(rows: list[dict], cfg: RunConfig, pred: Prediction) -> Case:
    """One configuration's repeats against its prediction: the median over the repeats of
    their median steady-state step (and of their peak memory)."""
    label = f"{cfg.model}/{cfg.dataset} {pred.plan.label()} x{cfg.workers} b{cfg.batch_size}"
    group = (cfg.model, cfg.dataset, cfg.batch_size, cfg.workers, rows[0]["threads"])
    seconds = tuple(r["step_seconds_median"] for r in rows)
    return Case(label, group, cfg.strategy, statistics.median(seconds), pred.median_step_s,
                int(statistics.median(_peak(r) for r in rows)), pred.memory_bytes_per_worker,
                statistics.fmean(r["wall_seconds"] or 0.0 for r in rows), seconds)


def validate(rows: list[dict], profile_for, hardware_for, fingerprint: str) -> Report:
    """Predict every row measured on the hardware ``fingerprint``.

    ``profile_for(cfg, batch_sizes) -> (ModelProfile, seconds it cost)`` gives the model
    profile of a configuration; ``hardware_for(workers) -> HardwareProfile`` the hardware
    profile measured with that many workers (the same processes competing for the cores).
    """
    cases, skipped, spent = [], [], 0.0
    profiles: dict[tuple, ModelProfile] = {}
    hardware: dict[int, HardwareProfile] = {}
    configs = [(group, row_config(group[0])) for group in repeat_groups(measured_rows(rows, fingerprint))]
    wanted: dict[tuple, set[float]] = defaultdict(set)
    for group, cfg in configs:
        wanted[_profile_key(group[0], cfg)].update(Plan.from_config(cfg).batch_sizes())
    for group, cfg in configs:
        key = _profile_key(group[0], cfg)
        if key not in profiles:
            profiles[key], seconds = profile_for(cfg, sorted(wanted[key]))
            spent += seconds
        if cfg.strategy == "hogwild":
            skipped.append(f"{cfg.model}/{cfg.dataset} hogwild x{cfg.workers}: asynchronous, not validated")
            continue
        if cfg.workers not in hardware:
            hardware[cfg.workers] = hardware_for(cfg.workers)
        pred = predict_plan(profiles[key], hardware[cfg.workers], Plan.from_config(cfg))
        cases.append(_case(group, cfg, pred))
    return Report(cases, spent, skipped)


def _profile_key(row: dict, cfg: RunConfig) -> tuple:
    return (cfg.model, cfg.dataset, cfg.synthetic, row["threads"] or cfg.threads, json.dumps(cfg.model_options, sort_keys=True))


def plot_scatter(report: Report, path: str | Path) -> Path:
    """Predicted against measured seconds per step, log-log, one colour per strategy, +-10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for strategy in sorted({c.strategy for c in report.cases}):
        pts = [(c.measured_s * 1e3, c.predicted_s * 1e3) for c in report.cases if c.strategy == strategy]
        ax.scatter(*zip(*pts), label=f"{strategy} ({report.mape(strategy):.1%})", s=22)
    values = [v * 1e3 for c in report.cases for v in (c.measured_s, c.predicted_s)]
    lo, hi = min(values) / 1.3, max(values) * 1.3
    ax.plot([lo, hi], [lo, hi], "k-", lw=1)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2, label="±10%")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms/step", ylabel="predicted ms/step",
           title=f"predicted vs measured, MAPE {report.mape():.1%} over {len(report.cases)} cells")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report_tables(report: Report, worst: int = 10):
    """(per-strategy table, worst-cases table) as rich tables."""
    from rich.table import Table

    summary = Table(title=f"time per step: MAPE {report.mape():.1%} over {len(report.cases)} cells; "
                          f"memory MAPE {report.memory_mape():.1%}")
    for name in ("strategy", "cells", "MAPE", "worst", "repeat noise"):
        summary.add_column(name, justify="left" if name == "strategy" else "right")
    floor = lambda f: "-" if math.isnan(f) else f"{f:.1%}"  # noqa: E731
    for strategy, (n, mape, top, noise) in report.per_strategy().items():
        summary.add_row(strategy, str(n), f"{mape:.1%}", f"{top:.1%}", floor(noise))
    summary.add_row("all", str(len(report.cases)), f"{report.mape():.1%}", f"{max(abs(c.error) for c in report.cases):.1%}",
                    floor(report.noise_floor()))
    rank = report.ranking()
    summary.caption = (f"fastest strategy picked right in {rank['hit_rate']:.0%} of {rank['groups']} groups, "
                       f"regret {rank['regret']:.1%}, Spearman {rank['spearman']:.2f}; "
                       f"profiles cost {report.profile_cost():.1%} of the cells' wall time")
    cases = Table(title=f"worst {worst} cases")
    for name in ("cell", "measured ms", "predicted ms", "error", "measured MiB", "predicted MiB", "memory error"):
        cases.add_column(name, justify="left" if name == "cell" else "right")
    for c in report.worst(worst):
        cases.add_row(c.label, f"{c.measured_s * 1e3:.2f}", f"{c.predicted_s * 1e3:.2f}", f"{c.error:+.1%}",
                      f"{c.measured_bytes / 2**20:.0f}", f"{c.predicted_bytes / 2**20:.0f}", f"{c.memory_error:+.1%}")
    return summary, cases
