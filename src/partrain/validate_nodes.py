"""Validation across emulated nodes (issue 18): each cell run across nodes (``bench.nodes``)
held against the prediction from the hardware profile measured across its own placement and
link, the recommender judged per placement and link, and each link's measured rate.

Pure, like ``validate``: the hardware profiles come in through a callable.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from partrain.predict.profiles import ModelProfile
from partrain.testing.netns import payload_share
from partrain.validate import (
    Case,
    Report,
    batch_sizes_by_profile,
    measured_rows,
    profile_key,
    row_config,
    validate,
)


def validate_across_nodes(rows: list[dict], profile_for, hardware_for, hardware_across, fingerprint: str,
                          device: str = "cpu") -> tuple[Report, list[Case]]:
    """``validate``, with the cells run across emulated nodes (``bench.nodes``) predicted from
    the hardware profile measured across the same placement and link:
    ``hardware_across(workers, nodes, link_mbit) -> HardwareProfile | None`` (None: none was
    measured, and those cells are skipped, saying so).

    Returns the report over every cell (a cell across nodes labelled with its placement and
    link) and the jobs across nodes for the recommender's check: each (model, dataset, batch,
    placement, link) a job of its own, in which this machine's serial cells of the same
    model, data and batch compete too, since one worker needs no link.
    """
    # one model profile per model over the calls below, at every batch size any of them needs
    wanted = batch_sizes_by_profile((profile_key(cfg), cfg) for cfg in map(row_config, measured_rows(rows, fingerprint)))
    seen: dict[tuple, ModelProfile] = {}

    def profile_once(cfg, _batch_sizes):
        key = profile_key(cfg)
        if key in seen:
            return seen[key], 0.0  # its cost counted once
        seen[key], seconds = profile_for(cfg, wanted[key])
        return seen[key], seconds

    report = validate([r for r in rows if not r.get("nodes")], profile_once, hardware_for, fingerprint, device)
    links: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("nodes"):
            links[(row["nodes"], row["workers_per_node"], row["link_mbit"])].append(row)
    serial = [c for c in report.cases if c.strategy == "serial"]
    across: list[Case] = []
    for (nodes, per_node, link), link_rows in sorted(links.items()):
        where = f"{nodes}x{per_node} nodes at {link:g} Mbit/s"
        hardware = hardware_across(nodes * per_node, nodes, link)
        if hardware is None:
            report.skipped.append(f"{len(link_rows)} cells on {where}: no hardware profile was measured across them "
                                  "(or one by an earlier partrain, whose figures mean something else); "
                                  "run `partrain bench` on their suite again, as root, with the same --profile-dir")
            continue
        part = validate(link_rows, profile_once, lambda workers, hw=hardware: hw, fingerprint, device)
        report.profile_seconds += part.profile_seconds
        report.mismatched += part.mismatched
        report.skipped += [f"{line} on {where}" for line in part.skipped]
        tagged = [_on(c, where) for c in part.cases]
        report.cases += tagged
        jobs = {c.group[:3] + c.group[4:] for c in part.cases}  # model, dataset, batch, threads
        across += tagged + [_on(c, where) for c in serial if c.group[:3] + c.group[4:] in jobs]
    return report, across


def _on(case: Case, where: str) -> Case:
    """``case`` as part of the job across ``where``: its own group, named so."""
    model, dataset, batch, workers, threads = case.group
    return dataclasses.replace(case, label=f"{case.label} on {where}",
                               group=(model, f"{dataset} on {where}", batch, workers, threads))


def link_rates(rows: list[dict], hardware_across) -> list[tuple[str, float, float | None]]:
    """(placement, shaped Mbit/s, Mbit/s that its profile measured) per emulated link in
    ``rows`` (``HardwareProfile.link_rate``): None where the link was not profiled, NaN where
    its largest message took no longer than the one before (messages that small pass in the
    shaper's burst). The measured rate is of payload: the link's own rate, which meters the
    frames' headers too, is that over ``netns.payload_share()`` (``wire_rate``)."""
    out = []
    placed = {(r["nodes"], r["workers_per_node"], r["link_mbit"]) for r in rows if r.get("nodes")}
    for nodes, per_node, link in sorted(placed):
        hardware = hardware_across(nodes * per_node, nodes, link)
        rate = None if hardware is None else hardware.link_rate("inter")
        out.append((f"{nodes}x{per_node} nodes at {link:g} Mbit/s", link, None if rate is None else rate * 8 / 1e6))
    return out


def wire_rate(payload_mbit: float) -> float:
    """The rate of the frames that carried ``payload_mbit`` of TCP payload across an emulated
    link: what its shaper metered, and what ``link_mbit`` states (``netns.payload_share``)."""
    return payload_mbit / payload_share()
