"""Cutting a model's ordered blocks into balanced pipeline stages.

A pipeline runs at the pace of its slowest stage, so the cut minimises the largest
stage cost: the classic linear-partition problem, solved exactly by dynamic programming
in O(n^2 k) over n blocks and k stages (PipeDream's partitioner does the same over
profiled layer times; Narayanan et al., SOSP 2019). Costs are measured forward+backward
seconds per block (default) or parameter counts (``--balance params``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

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
    if cfg.pipeline_schedule == "interleaved-1f1b" and cfg.num_microbatches % cfg.dims.pp:
        return (f"interleaved-1f1b needs micro-batches in multiples of the {cfg.dims.pp} pipeline workers, "
                f"got {cfg.num_microbatches}")
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


def param_costs(blocks: list[nn.Module]) -> list[float]:
    return [float(sum(p.numel() for p in b.parameters())) for b in blocks]


def _fresh_input(x):
    """``x`` cut from its graph, floats requiring grad: a block's input, alone (tensor or tuple)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    return type(x)(_fresh_input(v) for v in x)


def _backward(out) -> None:
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def measure_block_times(blocks: list[nn.Module], sample, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each block on ``sample``'s batch size.

    Each block runs on the previous block's (detached) output, once to warm up and then
    ``repeats`` times; the whole model runs about ``repeats + 1`` times, i.e. a few
    training steps' worth of compute. The timing leaves no trace on the run: the RNG is
    forked (dropout draws nothing from the run's stream) and buffers such as BatchNorm's
    running statistics are put back as they were.
    """
    buffers = [(b, b.detach().clone()) for blk in blocks for b in blk.buffers()]
    times, x = [], sample
    with torch.random.fork_rng(devices=None if torch.cuda.is_available() else []):
        for block in blocks:
            x = _fresh_input(x)
            samples = []
            for r in range(repeats + 1):
                start = time.perf_counter()
                out = block(x)
                _backward(out)
                if r:
                    samples.append(time.perf_counter() - start)
            block.zero_grad(set_to_none=True)
            times.append(statistics.median(samples))
            x = out
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    return times


def partition(
    blocks: list[nn.Module],
    n_stages: int,
    balance: str = "time",
    split_points: list[int] | None = None,
    sample: torch.Tensor | None = None,
) -> Partition:
    """Cut ``blocks`` into ``n_stages`` stages (see module docstring)."""
    if n_stages > len(blocks):
        raise PartrainError(
            f"{n_stages} pipeline stages but the model has only {len(blocks)} blocks: use at most {len(blocks)} stages"
        )
    if balance == "time" and sample is None:
        raise ValueError("balance='time' needs a sample batch to time the blocks on")
    costs = measure_block_times(blocks, sample) if balance == "time" else param_costs(blocks)
    if split_points:
        return Partition(tuple(bounds_from_split_points(split_points, len(blocks), n_stages)), tuple(costs), balance)
    return Partition(tuple(balanced_bounds(costs, n_stages)), tuple(costs), balance)


def describe(part: Partition, blocks: list[nn.Module]) -> str:
    """One line per stage: its blocks, parameters, and measured time (or parameter share)."""
    lines = []
    for s, (a, b) in enumerate(part.bounds):
        params = sum(p.numel() for blk in blocks[a:b] for p in blk.parameters())
        cost = sum(part.costs[a:b])
        what = f"{cost * 1e3:8.2f} ms fwd+bwd" if part.balance == "time" else f"{cost / max(1, sum(part.costs)):6.1%} of params"
        lines.append(f"  stage {s}: blocks {a:>2}..{b - 1:<2} ({b - a:>2} blocks) {params:>12,} params {what}")
    return "\n".join(lines)
