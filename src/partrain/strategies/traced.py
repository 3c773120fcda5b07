"""Pipelines for a plain ``nn.Module``: cut by ``torch.distributed.pipelining``'s own tracer.

A model that is neither an ``nn.Sequential`` nor given with its blocks has its glue in
``forward`` (residuals, loops, reshapes), so it cannot be cut by running blocks one after
the other. ``pipeline(model, example, split_spec={name: SplitPoint.BEGINNING})`` traces it
whole with ``torch.export`` and splits the graph before the named submodules; every
worker traces the same model and keeps its own stage's ``GraphModule``.

Where to cut: the candidates are the submodules ``forward`` calls, in call order, one level
down (the elements of a ``ModuleList`` or ``Sequential`` child count one by one), each
called once. Their forward times are measured on a micro-batch with hooks and the stages
balanced over them by ``balanced_bounds``; backward is taken as proportional to forward
(about 2x, both being the same matrix products; Kaplan et al. 2020, sec. 2.1), so the
balance needs forward times only. Time in ``forward``'s own glue is not counted.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.distributed.pipelining.stage import _PipelineStage

from partrain.errors import PartrainError
from partrain.strategies.partition import (
    Partition,
    balanced_bounds,
    bounds_from_split_points,
)
from partrain.strategies.pipeline import PipelineStepper, SpanStage, build_stepper
from partrain.strategies.precision import autocast_for
from partrain.strategies.tied import tied_groups

_CONTAINERS = (nn.ModuleList, nn.Sequential)


@torch.no_grad()
def split_candidates(model: nn.Module, sample) -> list[tuple[str, nn.Module]]:
    """The (name, submodule) pairs a stage may begin at, in the order ``forward`` calls them."""
    def expand(prefix: str, module: nn.Module):
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS) and len(child) > 1:
                yield from expand(f"{full}.", child)
            else:
                yield full, child

    named = dict(expand("", model))
    calls: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: calls.append(n)) for n, m in named.items()]
    was_training = model.training
    try:
        model.eval()
        model(sample)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    once = [n for n in dict.fromkeys(calls) if calls.count(n) == 1]
    return [(n, named[n]) for n in once]


def candidate_times(model: nn.Module, candidates, sample, repeats: int = 3) -> list[float]:
    """Median forward seconds of each candidate inside a whole forward on ``sample``."""
    starts, spent = {}, {n: [] for n, _ in candidates}
    hooks = []
    for n, m in candidates:
        hooks.append(m.register_forward_pre_hook(lambda mod, args, n=n: starts.__setitem__(n, time.perf_counter())))
        hooks.append(m.register_forward_hook(lambda mod, args, out, n=n: spent[n].append(time.perf_counter() - starts[n])))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for _ in range(repeats + 1):
                model(sample)
    finally:
        for h in hooks:
            h.remove()
    return [statistics.median(spent[n][1:]) for n, _ in candidates]


def untraceable(model: nn.Module, err: Exception) -> PartrainError:
    cause = str(err.__cause__ or err).strip().splitlines()
    return PartrainError(
        f"{type(model).__name__} is a plain nn.Module and torch.export cannot trace it whole "
        f"({cause[0][:160] if cause else type(err).__name__}): return (model, blocks) from the factory so the "
        "pipeline cuts between blocks, or use a data-parallel strategy (ddp, fsdp, local-sgd)"
    )


def choose_cut(model: nn.Module, n_stages: int, mb_sample, balance: str, split_points=None):
    """Where to cut ``model`` into ``n_stages``: (Partition over the candidates, candidate names)."""
    candidates = split_candidates(model, mb_sample)
    if len(candidates) < n_stages:
        raise PartrainError(
            f"{type(model).__name__} calls {len(candidates)} submodules once each, too few to cut {n_stages} stages: "
            f"use at most {len(candidates)} stages, return (model, blocks) from the factory, or use a data-parallel strategy"
        )
    if balance == "time":
        costs = candidate_times(model, candidates, mb_sample)
    else:
        costs = [float(sum(p.numel() for p in m.parameters())) for _, m in candidates]
    bounds = (bounds_from_split_points(split_points, len(costs), n_stages) if split_points
              else balanced_bounds(costs, n_stages))
    return Partition(tuple(bounds), tuple(costs), balance), [n for n, _ in candidates]


def trace(model: nn.Module, part: Partition, names: list[str], mb_sample):
    """``pipeline()`` with a split point at the first candidate of every stage after the first."""
    spec = {names[a]: SplitPoint.BEGINNING for a, _ in part.bounds[1:]}
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)  # export logs a failed trace at length; the error says it in one line
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # and prints the graph it gave up on
            pipe = pipeline(model, (mb_sample,), split_spec=spec)
    except Exception as err:  # torch.export fails in many types; each is one reason
        raise untraceable(model, err) from None
    finally:
        torch_log.setLevel(level)
        for name in spec:  # pipeline() patched these forwards to mark the cut: undo it
            m = model.get_submodule(name)
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_orig_forward", None)
    if pipe.num_stages != len(part.bounds):
        raise PartrainError(
            f"the tracer cut {type(model).__name__} into {pipe.num_stages} stages, not {len(part.bounds)}: "
            "return (model, blocks) from the factory, or use --split-points"
        )
    return pipe


def contiguous_boundaries(gm: torch.fx.GraphModule) -> None:
    """Make every tensor a stage graph returns contiguous (gloo and NCCL send only contiguous buffers),
    in the dtype the trace recorded: under autocast (``--precision``) a traced stage sends float32,
    since the receivers' buffers were sized from the float32 trace. A no-op cast in fp32. And the
    trace's record of every tensor the stage receives says contiguous: ``_PipelineStage`` allocates
    its receive buffers with the traced strides, and a submodule that returned a transpose left
    a view's strides there, which gloo refused to receive into."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"] = _contiguous_like(node.meta["val"])
    out = next(n for n in gm.graph.nodes if n.op == "output")

    def fix(node):
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return node
        with gm.graph.inserting_before(out):
            cast = gm.graph.call_method("to", (node, node.meta["val"].dtype))
            made = gm.graph.call_method("contiguous", (cast,))
        made.meta = {**node.meta, "val": _contiguous_like(node.meta["val"])}
        return made

    out.args = (torch.fx.map_arg(out.args[0], fix),)
    gm.recompile()


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """A storage-free tensor of ``t``'s shape and dtype, with contiguous strides: all the stage reads of it."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class GraphStage(SpanStage, _PipelineStage):
    """A traced stage (``_PipelineStage`` knows the graph's skip connections between stages) with spans."""


def parallelize_traced(model: nn.Module, cfg, ctx, mb_sample) -> PipelineStepper:
    """The pipeline strategies' path for a plain module: the same schedules and stepper as for blocks."""
    if ctx.dims.dp > 1:
        raise PartrainError("hybrid with dp > 1 needs the model's blocks: return (model, blocks) from the factory, "
                            "or use --dp 1, gpipe or 1f1b")
    n_stages = ctx.dims.pp * cfg.stages_per_worker
    box = [None]
    if ctx.rank == 0:  # one cut for everyone, as for blocks
        box[0] = choose_cut(model, n_stages, mb_sample, cfg.balance, cfg.split_points)
    dist.broadcast_object_list(box, src=0)
    part, names = box[0]
    pipe = trace(model, part, names, mb_sample)  # every worker traces the same model the same way
    graphs = [pipe.get_stage_module(s) for s in range(n_stages)]
    tied = tied_groups([[g] for g in graphs], ctx.dims.pp, 1, ctx.pp_rank, 0) if ctx.dims.pp > 1 else []
    stages = []
    for s in [ctx.pp_rank + k * ctx.dims.pp for k in range(cfg.stages_per_worker)]:
        contiguous_boundaries(graphs[s])
        stages.append(GraphStage(graphs[s], s, pipe.info(), ctx.device, ctx.group("pp")))
        stages[-1].events, stages[-1].autocast = ctx.events, lambda: autocast_for(cfg, ctx.device)
    stepper = build_stepper(stages, [st.submod for st in stages], cfg, ctx)
    stepper.partition, stepper.tied = part, tied
    stepper.cut_blocks = [model.get_submodule(n) for n in names]
    return stepper
