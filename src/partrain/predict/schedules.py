"""The action orders of the pipeline schedules partrain runs, per rank, as
``torch.distributed.pipelining`` runs them (``pipeline_sim`` simulates them).

- GPipe (``ScheduleGPipe``; Huang et al., "GPipe", NeurIPS 2019): all M forwards, then all M
  backwards.
- 1F1B (``Schedule1F1B``; PipeDream-Flush, Narayanan et al., "Memory-Efficient Pipeline-
  Parallel DNN Training", ICML 2021): stage s runs min(M, P - s) forwards, then alternates
  one backward and one forward, then drains the backwards.
- interleaved 1F1B (``ScheduleInterleaved1F1B``; Narayanan et al., "Efficient Large-Scale
  Language Model Training on GPU Clusters", SC 2021): V stages per rank placed round-robin
  (stage s on rank s mod P), the action order of torch's ``_get_1f1b_rank_ops``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward | "B" backward
    stage: int
    mb: int


def gpipe_order(pp: int, microbatches: int) -> list[list[Action]]:
    """Per rank: all forwards, then all backwards (``ScheduleGPipe._step_microbatches``)."""
    return [[Action("F", s, m) for m in range(microbatches)] + [Action("B", s, m) for m in range(microbatches)]
            for s in range(pp)]


def one_f_one_b_order(pp: int, microbatches: int) -> list[list[Action]]:
    """Per rank: min(M, P - s) warm-up forwards, then B, F, B, F ..., then the last backwards
    (``Schedule1F1B._step_microbatches``)."""
    orders = []
    for s in range(pp):
        warmup = min(microbatches, pp - s)
        ops = [Action("F", s, m) for m in range(warmup)]
        nxt = warmup
        for m in range(microbatches):
            ops.append(Action("B", s, m))
            if nxt < microbatches:
                ops.append(Action("F", s, nxt))
                nxt += 1
        orders.append(ops)
    return orders


def interleaved_order(pp: int, stages_per_rank: int, microbatches: int) -> list[list[Action]]:
    """Per rank, the non-idle actions of torch's ``ScheduleInterleaved1F1B`` (``_get_warmup_ops``
    and ``_get_1f1b_rank_ops``): rounds of ``microbatches_per_round`` micro-batches, each visiting
    the rank's V stages in turn; backwards visit them in reverse."""
    v = stages_per_rank
    rounds = max(1, microbatches // pp)
    per_round = microbatches // rounds
    orders = []
    for rank in range(pp):
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), microbatches * v)
        steady = microbatches * v - warmup
        fwd_stage = lambda op: ((op // per_round) % v) * pp + rank  # noqa: E731
        bwd_stage = lambda op: (v - 1 - ((op - warmup) // per_round) % v) * pp + rank  # noqa: E731
        next_mb: dict[tuple[str, int], int] = defaultdict(int)

        def take(kind: str, stage: int) -> Action:
            m = next_mb[kind, stage]
            next_mb[kind, stage] += 1
            return Action(kind, stage, m)

        ops = []
        for op in range(warmup + steady + warmup):
            if op < warmup + steady:
                ops.append(take("F", fwd_stage(op)))
            if op >= warmup:
                ops.append(take("B", bwd_stage(op)))
        orders.append(ops)
    return orders


def schedule_order(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    if schedule == "gpipe":
        return gpipe_order(pp, microbatches)
    if schedule == "1f1b":
        return one_f_one_b_order(pp, microbatches)
    if schedule == "interleaved-1f1b":
        return interleaved_order(pp, stages_per_rank, microbatches)
    raise ValueError(f"unknown schedule {schedule!r}")
