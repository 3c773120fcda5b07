"""Pipeline cuts: exact min-max partition (oracle: brute force) and balance on resnet18."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from partrain.errors import PartrainError
from partrain.models import build_model, model_blocks
from partrain.strategies.partition import (
    balanced_bounds,
    bounds_from_split_points,
    partition,
)


def brute_force_best(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_bounds_is_optimal(seed):
    rng = random.Random(seed)
    costs = [rng.uniform(0.1, 5) for _ in range(rng.randint(2, 9))]
    k = rng.randint(1, len(costs))
    bounds = balanced_bounds(costs, k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    assert max(sum(costs[a:b]) for a, b in bounds) == pytest.approx(brute_force_best(costs, k))


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(PartrainError, match="4 pipeline stages but the model has only 3 blocks"):
        balanced_bounds([1, 2, 3], 4)


def test_explicit_split_points():
    assert bounds_from_split_points([2, 5], 8, 3) == [(0, 2), (2, 5), (5, 8)]
    with pytest.raises(PartrainError, match="needs 2 block indices"):
        bounds_from_split_points([2], 8, 3)
    with pytest.raises(PartrainError, match="must increase strictly"):
        bounds_from_split_points([5, 2], 8, 3)


def test_param_balance_is_deterministic():
    blocks = model_blocks(build_model("vgg11", (3, 32, 32), 10))
    a = partition(blocks, 4, balance="params")
    assert a == partition(blocks, 4, balance="params") and len(a.bounds) == 4


def test_one_stage_holds_every_block_and_times_none():
    """A world-of-one hybrid (pp1) has nothing to balance: timing its blocks ran the whole model
    a few times at the full batch on the host (33 s for resnet50 at batch 128 on a GPU machine)."""
    calls = []

    class Counted(torch.nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x)

    blocks = [Counted(4, 4) for _ in range(3)]
    part = partition(blocks, 1, balance="time", sample=torch.randn(8, 4))
    assert part.bounds == ((0, 3),) and calls == []
    assert part.costs == (20.0, 20.0, 20.0) and part.balance == "params"  # what the one-line description shows


@pytest.mark.parametrize("stages", [2, 4])
def test_resnet18_cifar_stages_are_time_balanced(stages):
    torch.manual_seed(0)
    blocks = model_blocks(build_model("resnet18", (3, 32, 32), 10))
    part = partition(blocks, stages, balance="time", sample=torch.randn(8, 3, 32, 32))
    times = part.stage_costs()
    mean = sum(times) / stages
    # 1.5x the mean, unless a single block is itself heavier (then nothing can do better)
    assert max(times) <= max(1.5 * mean, max(part.costs)) + 1e-12
