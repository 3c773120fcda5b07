"""Blocks for a plain ``nn.Module``, cut by ``torch.distributed.pipelining``'s own tracer.

A model that is neither an ``nn.Sequential`` nor given with its blocks has its glue in
``forward`` (residuals, loops, reshapes), so it cannot be cut by running its submodules one
after the other. ``pipeline(model, example, split_spec={name: SplitPoint.BEGINNING})``
traces it whole with ``torch.export`` and splits the graph before the named submodules.

Here it splits before every candidate: the submodules ``forward`` calls, in call order, one
level down (the elements of a ``ModuleList`` or ``Sequential`` child count one by one), each
called once. Each piece of the split graph becomes a block (``TracedSpan``): it takes what is
live at its cut and returns what is live at the next, so a value a later piece reads (a
residual's input) passes through the pieces between. From there a plain module is a model
with blocks like any other: the pipeline strategies cut it over the blocks' measured times
(``partition.py``), every stage boundary, tied weight and replica works as for blocks, and
the profiler measures the same blocks, so the predictor cuts where the run will.

Costs: one trace (about a second for a small model) on every worker, and on the first stage
of a cut that a residual crosses, the residual's bytes sent once more per stage it skips
(the tracer's own stages would send it straight to its reader).

What differs from a model with blocks: the trace records dropout and BatchNorm as they run
in training, and ``eval()`` does not reach inside the graph, so a pipeline's evaluation of
such a module runs them as in training (dropout on, batch statistics). The probes before
training leave no trace (``boundary.leaves_no_trace``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import operator

import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

from partrain.errors import PartrainError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # their children can begin blocks


@torch.no_grad()
def split_candidates(model: nn.Module, sample) -> list[str]:
    """The names of the submodules a block may begin at, in the order ``forward`` calls them."""
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
    return [n for n in dict.fromkeys(calls) if calls.count(n) == 1]


def untraceable(model: nn.Module, err: Exception) -> PartrainError:
    cause = str(err.__cause__ or err).strip().splitlines()
    return PartrainError(
        f"{type(model).__name__} is a plain nn.Module and torch.export cannot trace it whole "
        f"({cause[0][:160] if cause else type(err).__name__}): return (model, blocks) from the factory so the "
        "pipeline cuts between blocks, or use a data-parallel strategy (ddp, fsdp, local-sgd)"
    )


class TracedSpan(nn.Module):
    """One piece of a traced module's graph as a block: what is live at its cut in, what is live at the next out.

    ``args`` picks the piece's arguments from the values it receives; ``out`` lists what it
    returns, each ``("in", i)`` (received value i, passed through) or ``("made", k)`` (the
    piece's output k, or its only output for k None). One value travels bare, several as a
    tuple: the first span takes the model's input, the last returns the model's output when
    that is one tensor (what a pipeline's last block must return).
    """

    begins = ""  # the submodule it begins at, for people reading a profile

    def __init__(self, graph: nn.Module, args: list[int], out: list[tuple[str, int | None]]):
        super().__init__()
        self.graph = graph
        self.args, self.out = args, out

    def forward(self, x):
        received = x if isinstance(x, tuple) else (x,)
        made = self.graph(*(received[i] for i in self.args))
        values = tuple(received[k] if src == "in" else (made if k is None else made[k]) for src, k in self.out)
        return values[0] if len(values) == 1 else values


def _spans(split_gm: torch.fx.GraphModule, model: nn.Module) -> list[TracedSpan]:
    """The blocks of a split graph: each call of a piece, with the live values around it."""
    nodes = list(split_gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_module"]
    output = next(n for n in nodes if n.op == "output")
    index = {n: i for i, n in enumerate(calls)}

    def made_by(call) -> list[tuple[torch.fx.Node, int | None]]:
        users = list(call.users)
        if users and all(u.op == "call_function" and u.target is operator.getitem for u in users):
            return sorted(((u, u.args[1]) for u in users), key=lambda pair: pair[1])  # a piece returning several values
        return [(call, None)]

    def read_after(value: torch.fx.Node, i: int) -> bool:
        return any(u is output or (u in index and index[u] > i) for u in value.users)

    live = [n for n in nodes if n.op == "placeholder"]
    spans = []
    for i, call in enumerate(calls):
        if call.kwargs or not all(a in live for a in call.args):
            raise PartrainError(f"the tracer's pieces of {type(model).__name__} pass values other than tensors between "
                                "them: return (model, blocks) from the factory, or use a data-parallel strategy")
        made = made_by(call)
        keep = [v for v in live if read_after(v, i)]
        new = [(v, k) for v, k in made if read_after(v, i)]
        out = [("in", live.index(v)) for v in keep] + [("made", k) for _, k in new]
        spans.append(TracedSpan(getattr(split_gm, call.target), [live.index(a) for a in call.args], out))
        live = keep + [v for v, _ in new]
    return spans


def _compiled_submodules():
    """The submodules the trace rebuilds run their graphs' generated Python code, not an
    ``fx.Interpreter`` walking the graph node by node (torch's default for them). The gallery's
    traced model at batch 32: a forward over its pieces 6.1-7.0 ms interpreted, 1.6-1.8 ms
    generated, 1.1-1.2 ms the module itself; its 2-stage 1F1B at batch 128, three runs each
    alternated, 32.8-41.3 ms a step interpreted, 22.3-27.8 generated. Where torch lacks the
    switch they are interpreted: slower, the same numbers."""
    unflatten = importlib.import_module("torch.export.unflatten")  # the module: torch.export.unflatten is a function
    return getattr(unflatten, "_disable_interpreter", contextlib.nullcontext)()


def traced_blocks(model: nn.Module, sample) -> list[nn.Module]:
    """``model`` traced on ``sample`` and split before every candidate: its blocks.

    The blocks hold ``model``'s own parameters (a tied one too: ``_tie_again``).
    ``torch.export`` may bake the sample's batch size into a reshape, so the blocks are for
    batches of ``sample``'s size. A model that cannot be traced gets one line saying why and
    what to do.
    """
    names = split_candidates(model, sample)
    spec = {name: SplitPoint.BEGINNING for name in names[1:]}
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)  # export logs a failed trace at length; the error says it in one line
    try:
        with contextlib.redirect_stderr(io.StringIO()), _compiled_submodules():  # stderr: the graph it gave up on
            pipe = pipeline(model, (sample,), split_spec=spec)
    except Exception as err:  # torch.export fails in many types; each is one reason
        raise untraceable(model, err) from None
    finally:
        torch_log.setLevel(level)
        for name in spec:  # pipeline() patched these forwards to mark the cut: undo it
            m = model.get_submodule(name)
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_orig_forward", None)
    _tie_again(pipe, model)
    spans = _spans(pipe.split_gm, model)
    for i, span in enumerate(spans):  # pieces that do not depend on each other may come in another order
        held = dict(span.graph.named_modules())
        span.begins = next((n for n in names if n in held), f"piece {i}")
    return spans


def _tie_again(pipe, model: nn.Module) -> None:
    """A parameter two pieces use (an embedding tied to the head) is one parameter again.

    ``Pipe`` gives each piece its own deep copy of it, so that its pipelines' stages each
    count their own gradient; as blocks of one model the pieces must share it, as the model
    does: every user gets the model's own parameter back (the name a piece holds it under is
    the model's), or where no name finds it, the first piece's copy. ``tied.py`` then sums its
    gradients over the stages that hold it, as for any model's blocks.
    """
    models = dict(model.named_parameters(remove_duplicate=False))  # a tie under each of its names
    for users in pipe.replicated_params:  # each: {piece: the parameter's name inside it}
        holders = [(pipe.split_gm.get_submodule(piece), qualname) for piece, qualname in users.items()]
        first_piece, first_name = holders[0]
        own = next((models[q] for _, q in holders if q in models), None)
        own = first_piece.get_parameter(first_name) if own is None else own
        for piece, qualname in holders:
            path, _, leaf = qualname.rpartition(".")
            setattr(piece.get_submodule(path), leaf, own)
