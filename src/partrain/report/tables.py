"""Rich tables of profiles and predictions: views, kept out of the modules that compute."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.table import Table

from partrain.predict.prediction import Prediction
from partrain.predict.profiles import HardwareProfile, ModelProfile

if TYPE_CHECKING:
    from partrain.validate import Report


def hardware_table(hw: HardwareProfile):
    """A rich table of the fitted collectives: latency and bandwidth per size range."""
    table = Table(title=f"{hw.description}: {hw.nodes} node(s) x {hw.workers_per_node} workers, {hw.backend}")
    for name in ("tier", "ranks", "collective", "fit: latency + bytes / bandwidth, per size range"):
        table.add_column(name)
    for tier, by_size in hw.collectives.items():
        for p, fits in sorted(by_size.items()):
            for name, fit in fits.items():
                table.add_row(tier, str(p), name, ";  ".join(_segment_text(s) for s in fit.segments))
    for tier, link in hw.links.items():
        if tier not in hw.collectives:
            table.add_row(tier, "2", "link", _segment_text(link.segments[0]))
    action = f"pipeline runtime: {hw.pipeline_action_s * 1e6:.0f} us per micro-batch action" + (
        f", {hw.pipeline_message_cpu_s * 1e6:.0f} us of CPU per message posted" if hw.pipeline_message_cpu_s else "")
    rates = [f"{tier} link alone {rate * 8 / 1e9:.2f} Gbit/s" for tier in hw.links
             if (rate := hw.link_rate(tier)) is not None and rate == rate]  # NaN: inside a shaper's burst
    table.caption = "; ".join([action, *rates, *hw.notes])
    return table


def _segment_text(seg) -> str:
    upto = "" if seg.upto_bytes == float("inf") else f"<= {seg.upto_bytes / 1024:g} KiB: "
    bandwidth = "inf" if seg.seconds_per_byte == 0 else f"{seg.bandwidth / 1e9:.2f} GB/s"
    return f"{upto}{seg.latency_s * 1e6:.0f} us + n / {bandwidth}"


def profile_table(profile: ModelProfile):
    """A rich table of the blocks; each cell lists its value at every profiled batch size."""
    sizes = "/".join(map(str, profile.batch_sizes))
    table = Table(title=f"{profile.model} on {profile.dataset}, batch {sizes}, {profile.threads} thread(s)")
    for name in ("block", "params", "fwd ms", "bwd ms", "output KiB", "saved KiB", "MFLOP"):
        table.add_column(name, justify="left" if name == "block" else "right")
    join = lambda values, scale, fmt: " / ".join(format(v * scale, fmt) for v in values)  # noqa: E731
    for blk in profile.blocks:
        table.add_row(blk.name, f"{blk.params:,}", join(blk.fwd_s, 1e3, ".3f"), join(blk.bwd_s, 1e3, ".3f"),
                      join(blk.out_bytes, 1 / 1024, ".0f"), join(blk.saved_bytes, 1 / 1024, ".0f"),
                      join(blk.flops, 1e-6, ".1f"))
    opt = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in profile.optimizer_s.items())
    blocks = [sum(blk.fwd_s[i] + blk.bwd_s[i] for blk in profile.blocks) for i in range(len(profile.batch_sizes))]
    table.caption = (f"blocks {join(blocks, 1e3, '.2f')} ms, loss {join(profile.loss_s, 1e3, '.3f')} ms, "
                     f"data {join(profile.data_s, 1e3, '.3f')} ms, "
                     f"optimizer ms: {opt}; baseline RSS {profile.baseline_rss_bytes / 2**20:.0f} MiB "
                     f"(peak {profile.baseline_peak_rss_bytes / 2**20:.0f}); profiled in {profile.profile_seconds:.1f} s, "
                     f"other processes used {profile.other_load:.0%} of the CPU meanwhile"
                     + "".join(f"; {k} workers side by side {f:.2f}x" for k, f in sorted(profile.compute_sharing.items())))
    return table


def predictions_table(predictions: list[Prediction], title: str, memory_limit: float | None = None):
    """A rich table of predictions, fastest first, with the time breakdown."""
    table = Table(title=title)
    for name in ("plan", "s/step", "s/epoch", "MiB/worker", "compute", "comm", "bubble", "optimizer", "data", "fits"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    for p in sorted(predictions, key=lambda p: p.seconds_per_step):
        fits = "" if memory_limit is None else ("yes" if p.fits(memory_limit) else "NO")
        table.add_row(p.plan.label(), ms(p.seconds_per_step), f"{p.seconds_per_epoch:.1f}",
                      f"{p.memory_bytes_per_worker / 2**20:.0f}", ms(p.compute_s), ms(p.comm_s), ms(p.bubble_s),
                      ms(p.optimizer_s), ms(p.data_s), fits)
    return table


def report_tables(report: Report, worst: int = 10):
    """(per-strategy table, worst-cases table) as rich tables."""
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


def outcome_table(outcomes, title: str):
    table = Table(title=title)
    for name in ("job", "plans", "picked (predicted fastest)", "measured fastest", "regret", "Kendall tau"):
        table.add_column(name)
    for o in outcomes:
        table.add_row(o.key, str(o.plans), o.picked, o.best + (" (repeats overlap the pick's)" if o.tie else ""),
                      f"{o.regret:.1%}", f"{o.tau:.2f}")
    return table
