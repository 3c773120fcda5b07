"""Cutting a model's ordered blocks into balanced pipeline stages: the arithmetic.

A pipeline runs at the pace of its slowest stage, so the cut minimises the largest
stage cost: the classic linear-partition problem, solved exactly by dynamic programming
in O(n^2 k) over n blocks and k stages (PipeDream's partitioner does the same over
profiled layer times; Narayanan et al., SOSP 2019). Pure: the runtime
(``strategies.partition``) cuts over times it measures, the predictor over profiled ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from partrain.errors import PartrainError


@dataclass(frozen=True)
class Partition:
    """Stage s holds blocks ``bounds[s][0] <= i < bounds[s][1]``."""

    bounds: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]  # per block, in the unit of `balance`
    balance: str  # "time" (seconds) | "params" | "explicit"

    def stage_costs(self) -> list[float]:
        return [sum(self.costs[a:b]) for a, b in self.bounds]

    @property
    def split_points(self) -> list[int]:
        return [a for a, _ in self.bounds[1:]]


def balanced_bounds(costs: list[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous cut of ``costs`` into ``n_stages`` non-empty parts minimising the max sum."""
    n = len(costs)
    if n_stages > n:
        raise PartrainError(f"{n_stages} pipeline stages but the model has only {n} blocks: use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-stage cost of the first i blocks in k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(n_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def pipeline_refusal(cfg, n_blocks: int) -> str | None:
    """Why ``cfg``'s pipeline cannot be cut from a model of ``n_blocks`` blocks (None when it can).

    One line with the fix; the launcher raises it before spawning, the predictor reports
    it for a plan it drops.
    """
    n_stages = cfg.dims.pp * cfg.stages_per_worker
    if n_stages > n_blocks:
        return f"{n_stages} pipeline stages but {cfg.model} has only {n_blocks} blocks: use at most {n_blocks} stages"
    if cfg.split_points and len(cfg.split_points) != n_stages - 1:
        return f"--split-points needs {n_stages - 1} block indices for {n_stages} stages, got {len(cfg.split_points)}"
    edges = [0, *(cfg.split_points or []), n_blocks]
    if cfg.split_points and any(b <= a for a, b in zip(edges, edges[1:])):
        return (f"--split-points {','.join(map(str, cfg.split_points))} must increase strictly within "
                f"1..{n_blocks - 1} ({cfg.model} has {n_blocks} blocks)")
    if cfg.pipeline_schedule == "interleaved-1f1b" and cfg.num_microbatches % cfg.dims.pp:
        return (f"interleaved-1f1b needs micro-batches in multiples of the {cfg.dims.pp} pipeline workers, "
                f"got {cfg.num_microbatches}")
    return None


def untraced_refusal(model: str, n_blocks: int, n_stages: int) -> str | None:
    """Why a pipeline of a one-block profile is not predicted: a plain module the tracer could
    not split into pieces (``strategies.traced``), whose pipelines the run refuses too. None
    when there are blocks to cut."""
    if n_blocks == 1 < n_stages:
        return (f"{model} is one block to the profiler: a plain module the tracer could not split into pieces, "
                "whose pipelines cannot run; return (module, blocks) from the factory, or use a data-parallel strategy")
    return None


def bounds_from_split_points(points: list[int], n_blocks: int, n_stages: int) -> list[tuple[int, int]]:
    if len(points) != n_stages - 1:
        raise PartrainError(
            f"--split-points needs {n_stages - 1} block indices for {n_stages} stages, got {len(points)}"
        )
    edges = [0, *points, n_blocks]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise PartrainError(
            f"--split-points {','.join(map(str, points))} must increase strictly within 1..{n_blocks - 1}"
        )
    return list(zip(edges, edges[1:]))
