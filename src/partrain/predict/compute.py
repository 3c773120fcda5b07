"""Compute time from the measured blocks: per batch size, per stage, under CPU contention.

The thesis's statistical method: a quantity measured at a few batch sizes is extrapolated to
any other by fitting it piecewise-linearly in the batch size, t(b) = t0 + c*b between two
profiled sizes (a fixed per-call cost plus a per-sample cost), the nearest segment's line
beyond them; a model, a stage or a step is the sum of its measured parts. (A whole serial
step timed inside the profiler ran 10-30% slower than the same step in the training loop at
large batches, while the block sums matched the loop: the sum is the better measurement.)
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left

from partrain.predict.profiles import HardwareProfile, ModelProfile


def interpolate(sizes: list[int], values: list[float], b: float) -> float:
    """Piecewise-linear value at batch size ``b`` (never below zero); one point scales proportionally."""
    if len(sizes) == 1:
        return values[0] * b / sizes[0]
    i = min(max(bisect_left(sizes, b), 1), len(sizes) - 1)
    (b0, v0), (b1, v1) = (sizes[i - 1], values[i - 1]), (sizes[i], values[i])
    return max(0.0, v0 + (v1 - v0) * (b - b0) / (b1 - b0))


def at(profile: ModelProfile, values: list[float], b: float) -> float:
    return interpolate(profile.batch_sizes, values, b)


def contention(busy_threads: float, cores: float) -> float:
    """Slow-down when more threads compute than there are cores: each gets cores / threads of one
    (processor sharing; Kleinrock 1976). 1 when the cores suffice."""
    return max(1.0, busy_threads / cores)


def with_model_sharing(profile: ModelProfile, hw: HardwareProfile, threads: int, local: int) -> tuple[HardwareProfile, str]:
    """``hw`` with its compute sharing replaced, for every k the model profile measured, by the
    model's own (``profile.sharing``: k copies of this model's step side by side), and where the
    factor of ``local`` workers now comes from, in words.

    The hardware profile's factor times one fixed convolution: issue 17's token model ran its
    2-worker data-parallel cells 13-28% faster than that factor said. The model's is used only
    where it applies: measured on this hardware (a cluster file is another machine) with the
    threads the plan's workers run."""
    own = profile.compute_sharing if profile.fingerprint == hw.fingerprint and profile.threads == threads else {}
    if own:
        # beyond the workers the model measured (up to the cores), the hardware profile's growth from
        # there (the cores time-sliced: ``profile.hardware.fit_compute_sharing``) on the model's own factor
        top = max(own)
        rescale = own[top] / hw.compute_sharing[top] if top in hw.compute_sharing else 1.0
        beyond = {k: f * rescale for k, f in hw.compute_sharing.items() if k > top}
        where = ("measured for this model" if local in own else
                 f"the model's at {top} workers times the hardware profile's growth beyond" if local in beyond else
                 "processor sharing of the cores: no probe measured it")
        return dataclasses.replace(hw, compute_sharing={**hw.compute_sharing, **own, **beyond}), where
    if local in hw.compute_sharing:
        why = "not measured for this model" if not profile.compute_sharing else "the model's was measured elsewhere"
        return hw, f"the hardware probe's convolution: {why}"
    return hw, "processor sharing of the cores: no probe measured it"


def block_times(profile: ModelProfile, b: float, cold: bool = False) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of every block at batch ``b``: back to back, or ``cold``, each
    from caches another worker wrote over (``BlockProfile.fwd_cold_s``; never less than back to
    back, and back to back where not measured)."""
    def time(hot: list[float], measured_cold: list[float]) -> float:
        return max(at(profile, hot, b), at(profile, measured_cold, b) if cold and measured_cold else 0.0)

    return ([time(blk.fwd_s, blk.fwd_cold_s) for blk in profile.blocks],
            [time(blk.bwd_s, blk.bwd_cold_s) for blk in profile.blocks])


def loss_time(profile: ModelProfile, b: float) -> float:
    return at(profile, profile.loss_s, b)


def stage_times(profile: ModelProfile, bounds: list[tuple[int, int]], b: float, recompute: bool = False,
                cold: bool = False) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds per stage on a micro-batch of ``b``, its blocks ``cold`` or not
    (``block_times``), less what running them as one chain saves (``chain_saving``); the last
    stage adds the loss.

    With recomputation each block's forward runs again inside its backward (Chen et al.,
    "Training Deep Nets with Sublinear Memory Cost", 2016): backward costs fwd + bwd.
    """
    fwd, bwd = block_times(profile, b, cold)
    save_f, save_b = chain_saving(profile, b)

    def joined(times: list[float], saving: float) -> float:
        return max(max(times), sum(times) - (len(times) - 1) * saving)

    f = [joined(fwd[a:e], save_f) for a, e in bounds]
    g = [joined(bwd[a:e], save_b) + (f[s] if recompute else 0.0) for s, (a, e) in enumerate(bounds)]
    half = loss_time(profile, b) / 2  # the loss's forward and its backward
    f[-1] += half
    g[-1] += half
    return f, g


def chain_saving(profile: ModelProfile, b: float) -> tuple[float, float]:
    """What one more block in a stage saves, forward and backward, at batch ``b``, over its time
    measured alone: the blocks' sum less their run as one chain (``ModelProfile.chain_s``), per
    join. A block timed alone pays a backward call of its own (autograd's engine starting and
    ending) and its input cut from the graph; in a stage, its blocks pay one. Issue 17's small
    gallery models at 8 rows: a 3-block stage ran its backward in 0.50 ms where its blocks
    summed to 0.60 (0.04-0.06 ms a join, in all three), and their 2-stage pipelines read 18-24%
    over their measure. (0, 0) where not measured."""
    n = len(profile.blocks)
    if n < 2 or len(profile.chain_s) != len(profile.batch_sizes):
        return 0.0, 0.0
    per = [[(sum(getattr(blk, kind)[i] for blk in profile.blocks) - chain[j]) / (n - 1)
            for i, chain in enumerate(profile.chain_s)] for j, kind in enumerate(("fwd_s", "bwd_s"))]
    return at(profile, per[0], b), at(profile, per[1], b)


def optimizer_time(profile: ModelProfile, kind: str, blocks: range | None = None) -> float:
    """One optimizer step over all parameters, or over ``blocks`` only (the whole-model step
    apportioned by the blocks' own measured steps, so the per-call overhead is not counted twice)."""
    whole = profile.optimizer_s[kind]
    if blocks is None:
        return whole
    own = [blk.optimizer_s[kind] for blk in profile.blocks]
    return whole * sum(own[i] for i in blocks) / sum(own) if sum(own) > 0 else 0.0


def gradient_pass_time(profile: ModelProfile, blocks: range) -> float:
    """Autograd adding a micro-batch's gradient of ``blocks``' parameters into an existing
    ``.grad`` (AccumulateGrad): the model's backward into gradients already there over its
    backward into none (``ModelProfile.accumulate_s``), shared by parameter bytes. Where not
    measured, the memory traffic of a plain SGD step on those blocks (``p.add_(grad,
    alpha=-lr)``: it also reads two tensors and writes one), which holds the optimizer call's
    own fixed cost too: a small model's SGD step took 0.13 ms where its accumulation took 0.02."""
    if profile.accumulate_s is None:
        return optimizer_time(profile, "sgd", blocks)
    total = sum(blk.param_bytes for blk in profile.blocks)
    return profile.accumulate_s * sum(profile.blocks[i].param_bytes for i in blocks) / total if total else 0.0


def optimizer_kind(optimizer: str, momentum: float) -> str:
    if optimizer == "adam":
        return "adam"
    return "sgd-momentum" if momentum > 0 else "sgd"


def serial_step(profile: ModelProfile, b: float, kind: str) -> float:
    """A serial step (``train.py``): load the batch, forward and backward every block and the
    loss, one ``kind`` optimizer step: the sum of their measured times, and the loop's own."""
    return parts_step(profile, b, kind) + loop_time(profile, b)


def parts_step(profile: ModelProfile, b: float, kind: str) -> float:
    """The measured parts of a serial step: data, every block's forward and backward, the loss,
    the optimizer."""
    fwd, bwd = stage_times(profile, [(0, len(profile.blocks))], b)  # the blocks as one chain, and the loss
    return at(profile, profile.data_s, b) + fwd[0] + bwd[0] + profile.optimizer_s[kind]


def loop_time(profile: ModelProfile, b: float | None = None) -> float:
    """What the training loop itself adds to every step beyond its measured parts (zeroing
    gradients, the step's Python, returning the loss): partrain's serial loop timed by the
    profile on a world of one (SGD with momentum, its default), less the sum of the parts at
    that batch size. 0 when not measured.

    Where the loop was timed at every profiled batch size (``ModelProfile.loop_s``) the
    difference is interpolated at ``b``. On a CPU it grows with the batch: the whole step's
    activations outgrow the cache that each block, timed alone, ran in. On a GPU it may be
    negative: separately synchronised blocks each pay a launch latency that the loop
    overlaps, and the loop's data path (data kept on the device) is cheaper than the
    profile's host batch copied over. A serial step is then the measured loop itself,
    interpolated. Without ``b`` (a pipeline stage's share) it is the world-of-one constant."""
    if profile.loop_s and b is not None:
        return at(profile, profile.loop_s, b) - parts_step(profile, b, "sgd-momentum")
    ran = profile.world_of_one_s.get("serial")
    if ran is None:
        return 0.0
    return max(0.0, ran - parts_step(profile, profile.world_of_one_batch, "sgd-momentum"))


def in_step_factor(profile: ModelProfile, b: float) -> float:
    """How much longer a pipeline stage's blocks take on a micro-batch of ``b`` inside a training
    step than timed alone (``stage_times``): the serial loop's excess over its parts at ``b``
    (``loop_time``) beyond that excess at the smallest profiled batch (the per-step constant, paid
    once a step, not per micro-batch), over those parts' blocks and loss. Where the whole step's
    activations outgrow the cache its blocks ran in alone, every micro-batch pass pays it, as a
    serial step does once at its batch. Issue 17's tuple_out (an 8 MB head): its loop ran 0.8-1.0
    ms over its parts at 64 rows in three profiles, 0.1-0.2 at 4; its one-worker hybrid at batch
    128 (two micro-batches of 64) was predicted 20-25% under its measure in all three passes and
    2-13% under its serial twin, which it ran as fast as. Never below 1 (on a CPU a loop faster
    than its parts is noise); 1 where the loop was not timed, and on a GPU, whose loop overlaps
    the launches its separately synchronised parts each paid (``loop_time``), a saving no stage
    was measured to share."""
    if not profile.loop_s or profile.on_gpu:
        return 1.0
    fwd, bwd = stage_times(profile, [(0, len(profile.blocks))], b)
    blocks_and_loss = fwd[0] + bwd[0]
    if blocks_and_loss <= 0:
        return 1.0
    excess = loop_time(profile, b) - loop_time(profile, profile.batch_sizes[0])
    return 1.0 + max(0.0, excess) / blocks_and_loss


def world_of_one_pipeline_time(profile: ModelProfile, microbatches: int = 2) -> float:
    """What the pipelining runtime adds to a step of this model whose stages all run on one
    worker (a one-worker hybrid: no messages, no other rank): partrain's hybrid loop on a world
    of one (``world_of_one_s["hybrid"]``: pp 1, its default 2 micro-batches, at the smallest
    profiled batch) over its serial loop, less what the prediction counts apart at that point:
    the gradient accumulation of the second micro-batch and the scaling by 2 (a pass and 2/3 of
    one over the gradients), and the blocks and the loss run twice on half the rows instead of
    once (each call's fixed cost paid again), which the prediction's micro-batch times hold.
    The hardware profile's pipeline constants are a 2-stage probe between processes; on one
    worker they were 0 and such plans ran 10-25% over their predictions (issue 17). Without
    the second item the small gallery models' one-worker hybrids read 16% over on average,
    every one of 15 cells over, in five suites (session 61): at batch 4 a block's time is
    mostly its fixed cost, which the difference of the two loops held and the micro-batch
    times counted again. 0 when not measured."""
    b = profile.world_of_one_batch

    def blocks_and_loss(rows: float) -> float:
        fwd, bwd = stage_times(profile, [(0, len(profile.blocks))], rows)
        return fwd[0] + bwd[0]

    split = microbatches * blocks_and_loss(b / microbatches) - blocks_and_loss(b)
    counted = gradient_pass_time(profile, range(len(profile.blocks))) * (1 + 2 / 3) + max(0.0, split)
    return max(0.0, profile.overhead_s("hybrid") - counted)
