"""The recommender held against the results store: for every job the store measured under
several plans, was its pick (the predicted fastest) the measured fastest (top-1 hit rate),
how much slower if not (regret), and how well the two orderings agree (Kendall's tau); a pick
the benchmark's own repeats cannot tell from the fastest is counted apart, as a tie."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from partrain.recommend import ASYNCHRONOUS


def kendall_tau(xs: list[float], ys: list[float], y_tied: Callable[[int, int], bool] | None = None) -> float:
    """Kendall's tau-b between two orderings (ties in either count as neither concordant nor
    discordant; Kendall 1945). ``y_tied(i, j)`` declares more pairs of ``ys`` tied (e.g. two
    measurements the benchmark's noise cannot order). NaN when either side is all ties."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], 0.0 if y_tied and y_tied(i, j) else ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else float("nan")


@dataclass(frozen=True)
class GroupOutcome:
    """One job the recommender was asked about: measured plans for (model, dataset, batch) on up to W workers."""

    key: str
    plans: int
    picked: str  # the plan predicted fastest
    best: str  # the plan measured fastest
    regret: float  # picked's measured time / best's - 1
    tau: float
    tie: bool = False  # picked is not best, but the benchmark cannot tell them apart: their repeats overlap
    tau_within_noise: float = float("nan")  # tau with measured pairs whose repeats overlap counted as ties


def measured_tie(a, b) -> bool:
    """True when two measured cases' repeats overlap: some run of the slower was as fast as
    some run of the faster, so their order is within the benchmark's own noise."""
    if len(a.repeats) < 2 or len(b.repeats) < 2:
        return False
    return min(a.repeats) <= max(b.repeats) and min(b.repeats) <= max(a.repeats)


def recommendation_outcomes(cases, max_workers=(2, 4), include_async: bool = False) -> list[GroupOutcome]:
    """For each (model, dataset, batch, threads) and each W with cells on W workers, the
    candidates are the measured plans the recommender would enumerate on at most W workers
    (fewer workers can win; one worker means serial; local SGD and Hogwild only with
    ``include_async``, as ``recommend --async``): its pick is the predicted fastest, held
    against the measured fastest of the same candidates."""
    by_job: dict[tuple, list] = {}
    for case in cases:
        model, dataset, batch, workers, threads = case.group
        if workers == 1 and case.strategy != "serial":
            continue  # on one worker the recommender proposes serial only (candidate_plans)
        if case.strategy in ASYNCHRONOUS and not include_async:
            continue  # recommend ranks them only when asked to (--async)
        by_job.setdefault((model, dataset, batch, threads), []).append((workers, case))
    outcomes = []
    for (model, dataset, batch, threads), entries in sorted(by_job.items(), key=str):
        for w in max_workers:
            if not any(workers == w for workers, _ in entries):
                continue
            cands = [c for workers, c in entries if workers <= w]
            if len(cands) < 2:
                continue
            picked = min(cands, key=lambda c: c.predicted_s)
            best = min(cands, key=lambda c: c.measured_s)
            predicted, measured = [c.predicted_s for c in cands], [c.measured_s for c in cands]
            outcomes.append(GroupOutcome(
                f"{model}/{dataset} batch {batch}, up to {w} workers", len(cands), picked.label, best.label,
                picked.measured_s / best.measured_s - 1, kendall_tau(predicted, measured),
                picked is not best and measured_tie(picked, best),
                kendall_tau(predicted, measured, lambda i, j: measured_tie(cands[i], cands[j])),
            ))
    return outcomes


def summarize_outcomes(outcomes: list[GroupOutcome]) -> dict:
    def mean(values) -> float:
        values = [v for v in values if not math.isnan(v)]
        return sum(values) / len(values) if values else float("nan")

    return {
        "groups": len(outcomes),
        "hit_rate": mean([float(o.picked == o.best) for o in outcomes]),
        # a pick whose repeats overlap the fastest's counts: the benchmark cannot order the two
        "hit_rate_within_noise": mean([float(o.picked == o.best or o.tie) for o in outcomes]),
        "mean_regret": mean([o.regret for o in outcomes]),
        "worst_regret": max((o.regret for o in outcomes), default=float("nan")),
        "kendall_tau": mean([o.tau for o in outcomes]),
        # pairs the benchmark cannot order (their repeats overlap) counted as ties
        "kendall_tau_within_noise": mean([o.tau_within_noise for o in outcomes]),
    }
