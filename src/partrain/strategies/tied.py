"""Weights tied across pipeline stages (an embedding reused as the output head).

Serially one parameter used in two places gets the sum of both uses' gradients. Cut into
stages, every stage that uses it holds its own copy (each worker built the same model from
the same seed, so the copies start equal) and sees only its own use's gradient. Summing
the copies' gradients over the stages that hold them before the optimizer step restores
the serial gradient, and equal gradients with equal optimizer state keep the copies
equal: Megatron-LM's embedding group does the same for the tied word embedding
(Shoeybi et al., 2019; Narayanan et al., SC 2021, sec. 3). Cost: one allreduce of the
tied parameter's bytes per step among its holders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


@dataclass
class TiedGroup:
    owners: list[tuple[nn.Module, str]]  # where this worker's copies are registered (module, attribute)
    group: dist.ProcessGroup

    def params(self) -> list[nn.Parameter]:
        # looked up when used: a wrapper such as fully_shard re-registers parameters under the same names
        return list({id(p): p for p in (getattr(m, name) for m, name in self.owners)}.values())


def tied_groups(stage_modules: list[list[nn.Module]], pp: int, dp: int, pp_rank: int, dp_rank: int) -> list[TiedGroup]:
    """Process groups over the pipeline ranks that hold copies of one tied parameter.

    ``stage_modules[s]`` are the modules of stage ``s`` (on every worker the same list, built
    before any wrapping: each worker built the whole model). Stage ``s`` lives on pipeline
    rank ``s % pp``; rank ``(r, d)`` of the (pp, dp) mesh is ``r * dp + d``. Every worker
    calls ``new_group`` for every set in the same order (a collective requirement) and
    keeps the groups it is in.
    """
    ranks_of, owners = {}, {}
    for s, modules in enumerate(stage_modules):
        for top in modules:
            for m in top.modules():
                for name, p in m._parameters.items():
                    if p is None:
                        continue
                    ranks_of.setdefault(id(p), set()).add(s % pp)
                    if s % pp == pp_rank:
                        owners.setdefault(id(p), []).append((m, name))
    holders: dict[tuple[int, ...], list[int]] = {}
    for pid, ranks in ranks_of.items():
        if len(ranks) > 1:
            holders.setdefault(tuple(sorted(ranks)), []).append(pid)
    mine = []
    for ranks, pids in sorted(holders.items()):
        for d in range(dp):
            group = dist.new_group([r * dp + d for r in ranks])
            if d == dp_rank and pp_rank in ranks:
                mine.append(TiedGroup([o for i in pids for o in owners[i]], group))
    return mine


@torch.no_grad()
def sum_tied_gradients(groups: list[TiedGroup]) -> None:
    """Add up the tied copies' gradients over their holders (after backward, before the step)."""
    for g in groups:
        for p in g.params():
            if p.grad is None:  # a holder whose use got no gradient still takes part
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=g.group)
