"""Pipeline strategies on ``torch.distributed.pipelining``: model-parallel, gpipe, 1f1b, hybrid.

The model's ordered blocks are cut into stages (``partition.py``); worker ``r`` of the
pipeline group holds stage ``r`` (or stages ``r, r+P, ...`` for interleaved schedules)
as a ``PipelineStage``, and a PyTorch schedule drives forwards, backwards and the
activation send/recv between neighbours:

- ``model-parallel``: ``ScheduleGPipe`` with one micro-batch: one stage busy at a time.
- ``gpipe``: ``ScheduleGPipe``, all M forwards then all M backwards (Huang et al., 2019);
  keeps M micro-batches of activations per stage.
- ``1f1b``: ``Schedule1F1B`` (PipeDream-Flush; Narayanan et al., 2021): same bubble
  (P-1)/(M+P-1), at most P micro-batches of activations in flight.
- ``interleaved-1f1b``: ``ScheduleInterleaved1F1B`` with V stages per worker, bubble / V.
- ``hybrid``: the same pipelines, each replicated dp times on the (pp, dp) mesh. Each
  stage is replicated over its dp group with ``fully_shard`` on a (replicate=dp, shard=1)
  mesh: full parameters on every replica and one gradient allreduce per step, i.e. DDP's
  semantics, through the data-parallel wrapper the pipelining runtime drives natively (it
  syncs only after the last micro-batch's backward). DDP itself trips an internal reducer
  assertion when a schedule runs several micro-batch forwards before their backwards.

Each micro-batch loss is a mean and the schedules divide gradients by M
(``scale_grads``), so a step equals the serial step on the whole batch.

What crosses a stage boundary (tensors of any dtype and rank, tuples of them; views made
contiguous) is ``boundary.py``'s business; weights tied across stages are summed over
their holders (``tied.py``); a plain ``nn.Module`` without blocks is split into blocks by
pipelining's own tracer (``traced.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.utils.checkpoint import checkpoint

from partrain.config import RunConfig
from partrain.distributed.context import DistContext
from partrain.errors import PartrainError
from partrain.events import EventLog
from partrain.strategies.base import Stepper, compile_forward, loss_fn, make_optimizer, shard_rows
from partrain.strategies.boundary import Stage, probe_boundaries, stage_examples
from partrain.strategies.partition import Partition, partition, pipeline_refusal
from partrain.strategies.precision import (
    autocast_for,
    batchnorms,
    fsdp_policy,
    low_dtype,
    no_autocast,
    shard_norms_in_float32,
)
from partrain.strategies.tied import sum_tied_gradients, tied_groups

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class Recompute(nn.Module):
    """Activation checkpointing of one block: keep its input, recompute inside backward.

    Costs one extra forward of the block per backward; saves its internal activations.
    The recomputation leaves the block's buffers as the one forward left them (BatchNorm
    counts each micro-batch once), and the wrapper adds no level to state_dict keys: a
    checkpoint loads with or without ``--recompute``.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.register_state_dict_post_hook(_unwrapped_keys)
        self.register_load_state_dict_pre_hook(_wrapped_keys)

    def forward(self, x):
        if torch.compiler.is_compiling():
            # compiled, the recomputation is a traced graph that mutates no buffer (and dynamo
            # takes no context_fn but selective checkpointing's)
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self):
        # checkpoint restores the RNG state for the recomputation, not module buffers: without
        # this, BatchNorm's running statistics and num_batches_tracked move twice per micro-batch
        return contextlib.nullcontext(), _buffers_kept(self.block)


@contextlib.contextmanager
def _buffers_kept(module: nn.Module):
    """Put ``module``'s buffers back as they were on entry. Costs a copy of the block's
    buffers (BatchNorm's: 2 floats a channel and a count) per recomputed micro-batch, nothing
    for a block without buffers."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:  # also when checkpoint stops the recomputation early (it raises to stop)
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


_WRAPPED = "block."


def _unwrapped_keys(module, state_dict, prefix, local_metadata) -> None:
    """state_dict hook: ``<prefix>block.x`` -> ``<prefix>x``, the key the block has unwrapped."""
    for key in [k for k in state_dict if k.startswith(prefix + _WRAPPED)]:
        state_dict[prefix + key[len(prefix + _WRAPPED):]] = state_dict.pop(key)


def _wrapped_keys(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: the inverse (every key under ``prefix`` is the block's)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + _WRAPPED + key[len(prefix):]] = state_dict.pop(key)


class SpanStage:
    """Mixin for a pipelining stage: a span per micro-batch forward and backward, and the
    forward under the run's autocast (``--precision``; backward is not autocast, as PyTorch advises)."""

    events: EventLog
    autocast = staticmethod(no_autocast)  # the run's precision.autocast_for, set per stage

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self.events.span("forward", stage=self.stage_index, mb=fwd_chunk_id), self.autocast():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self.events.span("backward", stage=self.stage_index, mb=bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


class TracedStage(SpanStage, PipelineStage):
    def __init__(self, *args, events: EventLog, autocast, **kwargs):
        super().__init__(*args, **kwargs)
        self.events, self.autocast = events, autocast


class PipelineStepper(Stepper):
    autocasts_itself = True  # each stage's forward (SpanStage), or FSDP's policy in hybrid

    def __init__(self, stages, modules, optimizer, rows, events, schedule_cls, microbatches: int):
        super().__init__(nn.ModuleList(modules), optimizer, rows, events)
        self.stages = stages
        self.schedule = schedule_cls(stages if len(stages) > 1 else stages[0], microbatches,
                                     loss_fn=self._stage_loss, scale_grads=True)
        self.is_first = any(s.is_first for s in stages)
        self.has_loss = any(s.is_last for s in stages)
        self.loads_data = self.is_first or self.has_loss
        self.partition: Partition | None = None
        self.cut_blocks: list[nn.Module] = []  # the blocks ``partition`` indexes (a plain module's: the tracer's pieces)
        self.tied = []  # TiedGroups this worker belongs to
        self._losses: list[torch.Tensor] = []

    def _stage_loss(self, out, y):
        """The schedule's loss of one micro-batch, on the last stage: float32, scaled for fp16."""
        loss = loss_fn(out.float(), y)
        self._losses.append(loss.detach())
        return self.amp.scale(loss)

    def _forward_backward(self, x, y):
        self._losses = []
        # return_outputs=False: the loop keeps the losses, not the outputs. By default the last
        # stage holds every micro-batch's output to the step's end and concatenates them (the
        # gallery's tuple_out at batch 128: 8 MB of logits a step, 1F1B 12.8-13.5 ms a step
        # against 14.5-15.6 ms with them, three pairs side by side)
        self.schedule.step(*self._inputs(x), target=y if self.has_loss else None, return_outputs=False)
        sum_tied_gradients(self.tied)
        return torch.stack(self._losses).mean() if self.has_loss else None

    def _inputs(self, x) -> list:
        # the first stage's input as its example recorded it: contiguous (a token window is a
        # strided view, a --channels-last batch NHWC; torch 2.11 checks the strides). A no-op
        # for a contiguous batch
        return [x.contiguous()] if self.is_first else []

    def compile(self) -> None:
        """``torch.compile`` per stage (a stage's module is what its ``PipelineStage`` calls)."""
        for module in self.module:
            compile_forward(module)

    def _eval_forward(self, x, y):
        with self.events.paused():  # 313 test batches x 4 micro-batches read as training spans, before
            return self.schedule.eval(*self._inputs(x), target=y if self.has_loss else None)


def stage_module(blocks: list[nn.Module], recompute: bool, receives, sends: torch.dtype | None = None) -> Stage:
    return Stage([Recompute(b) if recompute else b for b in blocks], receives, sends)


def choose_partition(blocks: list[nn.Module], n_stages: int, cfg: RunConfig, ctx: DistContext, sample) -> Partition:
    """Rank 0 cuts (timing the blocks if balancing by time) and tells everyone else.

    Timing on every rank could give different cuts on noisy machines; one decision,
    broadcast, cannot.
    """
    box = [None]
    if ctx.rank == 0:
        box[0] = partition(blocks, n_stages, cfg.balance, cfg.split_points, sample)
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def check_pipeline(model: nn.Module, build, cfg: RunConfig, sample) -> None:
    """Refuse, before any worker starts, a pipeline ``cfg`` cannot cut (one line, with the fix).

    ``model`` is the launcher's checked model, on the meta device where it builds there
    (shapes and types, no arithmetic, nothing allocated); ``build()`` makes a real one when
    needed. Blocks: the cut's arithmetic and what every block returns, probed on ``model``'s
    device (on a real model where an op has no meta kernel or reads values). A plain
    module: the same, over the blocks ``torch.export``'s trace of a real model splits it into
    (about a second for a small one).
    """
    from partrain.models import model_blocks

    n_stages = cfg.dims.pp * cfg.stages_per_worker
    blocks = model_blocks(model)
    traced = len(blocks) == 1 and n_stages > 1
    if traced:  # a plain module: its blocks are the tracer's pieces of a real one
        from partrain.strategies.traced import traced_blocks

        blocks = traced_blocks(build(), sample)
    if reason := pipeline_refusal(cfg, len(blocks)):
        raise PartrainError(reason)
    if traced:  # traced for the sample's batch: probed on it
        probe_boundaries(blocks, sample)
        return
    try:
        probe_boundaries(blocks, sample.to(next(model.parameters(), sample).device))
    except PartrainError:
        raise
    except Exception:  # noqa: BLE001 - no meta kernel, or an op that reads values: probe for real
        probe_boundaries(model_blocks(build()), sample)


def parallelize_pipeline(
    model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample: torch.Tensor
) -> PipelineStepper:
    """model-parallel, gpipe, 1f1b and hybrid: ``cfg`` decides the schedule, M and (pp, dp)."""
    pp, v = ctx.dims.pp, cfg.stages_per_worker
    n_stages = pp * v
    micro = cfg.num_microbatches
    mb_sample = sample[: max(1, cfg.batch_size // ctx.dims.dp // micro)]
    probe = sample[:2]
    traced = len(blocks) == 1 and n_stages > 1
    if traced:  # a plain module: pipelining's tracer cuts it into blocks
        from partrain.strategies.traced import traced_blocks

        blocks = traced_blocks(model, mb_sample)  # every rank traces the same model the same way
        probe = mb_sample  # the trace may have fixed the batch size
    crossings = probe_boundaries(blocks, probe)  # every rank: each stage unpacks what it receives
    part = choose_partition(blocks, n_stages, cfg, ctx, mb_sample)
    tied = tied_groups([blocks[a:b] for a, b in part.bounds], pp, ctx.dims.dp, ctx.pp_rank, ctx.dp_rank) if pp > 1 else []
    pp_group = ctx.group("pp")
    stage_ids = [ctx.pp_rank + k * pp for k in range(v)]  # looped placement for interleaving
    # bf16/fp16: activations cross in the forward's precision (half the bytes); the last stage's
    # logits leave in float32, for the loss (and the dtype its example recorded: torch checks it)
    low = low_dtype(cfg)
    every = [stage_module(blocks[a:b], cfg.recompute, crossings[a - 1] if a else None,
                          low if b < len(blocks) or low is None else torch.float32) for a, b in part.bounds]
    examples = stage_examples(every, mb_sample)
    # hybrid replicas cast by FSDP's policy, keeping BatchNorm float32 in units of its own; the
    # tracer folds a plain module's BatchNorms into its graphs, out of any unit's reach, so such
    # replicas gather float32 parameters (twice the bytes) and autocast, as one replica does
    folded_norms = traced and bool(batchnorms(model))
    policy = fsdp_policy(cfg) if ctx.dims.dp > 1 and not folded_norms else None
    autocast = (lambda: autocast_for(cfg, ctx.device)) if policy is None else no_autocast
    modules, stages = [], []
    for s in stage_ids:
        module = every[s].to(ctx.device)
        if ctx.dims.dp > 1:  # hybrid: replicate this stage over its dp group
            module.to(memory_format=torch.contiguous_format)  # FSDP takes contiguous parameters only (--channels-last)
            shard_norms_in_float32(module, ctx.mesh["dp", "shard"], policy, reshard_after_forward=False)
            fully_shard(module, mesh=ctx.mesh["dp", "shard"], reshard_after_forward=False,
                        **({"mp_policy": policy} if policy is not None else {}))
        modules.append(module)
        inputs, outputs = examples[s]
        stages.append(TracedStage(module, s, n_stages, ctx.device, input_args=inputs, output_args=outputs,
                                  group=pp_group, events=ctx.events, autocast=autocast))
    stepper = build_stepper(stages, modules, cfg, ctx)
    stepper.partition, stepper.cut_blocks, stepper.tied = part, blocks, tied
    # hybrid: fully_shard never communicates buffers: averaged over the stage's replicas (Stepper.sync_replicas)
    stepper.replica_group = ctx.group("dp") if ctx.dims.dp > 1 else None
    return stepper


def build_stepper(stages, modules, cfg: RunConfig, ctx: DistContext) -> PipelineStepper:
    """The schedule over this worker's stages, and one optimizer over their parameters."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())  # a tie within a worker counts once
    rows = shard_rows(cfg.batch_size, ctx.dims.dp, ctx.dp_rank)
    return PipelineStepper(stages, modules, make_optimizer(params, cfg), rows, ctx.events,
                           SCHEDULE_CLASSES[cfg.pipeline_schedule], cfg.num_microbatches)

