"""Timing a model's blocks on one worker: each alone (forward, backward, and on a CPU from cold
caches), with its output and saved bytes and its FLOPs, and every block as one chain, as a
pipeline stage runs them (``ModelProfile.chain_s``). ``profile.model`` puts them together."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from partrain.profile import outputs
from partrain.profile.timing import CUDA_TARGET_S, TARGET_S, Stopwatch, cold_run, median_times

COLD_REPEATS = 20  # a block's cold forward and backward: each waits for two cache evictions (~1 ms)


def profile_blocks(blocks: list[nn.Module], x, watch: Stopwatch, amp) -> list[dict]:
    """Per block at one batch size: times, bytes and FLOPs, each block fed the previous one's output."""
    rows = []
    for i, block in enumerate(blocks):
        needs_grad = i > 0  # the data does not need a gradient: block 0 skips its input gradient
        out, saved, saves_in, saves_out, flops = _inspect_block(block, outputs.detached(x, needs_grad), amp)
        fwd, bwd = _time_block(block, x, needs_grad, watch, amp)
        cold = [] if watch.cuda else _time_block_cold(block, x, needs_grad, amp)  # a GPU's host does not compute
        rows.append({"fwd_s": fwd, "bwd_s": bwd, "cold": cold, "out_bytes": outputs.nbytes(out),
                     "out_tensors": len(outputs.tensors(out)),
                     "out_floats": sum(t.is_floating_point() for t in outputs.tensors(out)),
                     "saved_bytes": saved, "saves_input": saves_in, "saves_output": saves_out, "flops": flops})
        block.zero_grad(set_to_none=True)
        x = out
    return rows


def time_chain(blocks: list[nn.Module], x, watch: Stopwatch, amp, accumulate: bool) -> list[float]:
    """Median [forward, backward] seconds of ``blocks`` run as a pipeline stage runs them: each
    fed the last one's output, one backward call (``ModelProfile.chain_s``), the data wanting
    no gradient; with ``accumulate``, a second forward and a backward that sums into the
    gradients the first left, as a stage's later micro-batches do, and its seconds third."""
    grads = None

    def run() -> list[float]:
        nonlocal grads
        for block in blocks:
            block.zero_grad(set_to_none=True)
        watch.start()
        for _ in range(2 if accumulate else 1):
            out = outputs.detached(x, False)
            with amp():
                for block in blocks:
                    out = block(out)
            watch.mark()
            grads = outputs.backward(out, grads)
            watch.mark()
        laps = watch.laps()
        return [laps[0], laps[1], laps[3]] if accumulate else list(laps)

    times = median_times(run, target_s=CUDA_TARGET_S if watch.cuda else TARGET_S)
    for block in blocks:
        block.zero_grad(set_to_none=True)
    return times


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _inspect_block(block: nn.Module, x, amp) -> tuple[torch.Tensor, int, bool, bool, int]:
    """One instrumented forward (under ``amp``, the run's autocast) + backward: (output, saved
    bytes, saves input, saves output, FLOPs). Under autocast the saved tensors include the
    weights' bf16/fp16 copies: memory the step really holds."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr, nbytes = _storage(t)
        saved[ptr] = nbytes
        return t

    with FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with amp():
            out = block(x)
        outputs.backward(out)  # a tensor, or a tuple of them (profile.outputs)
    owned = {_storage(t)[0] for t in [*block.parameters(), *block.buffers()]}
    in_ptrs, out_ptrs = {_storage(t)[0] for t in outputs.tensors(x)}, {_storage(t)[0] for t in outputs.tensors(out)}
    activations = sum(n for ptr, n in saved.items() if ptr not in owned and ptr not in in_ptrs | out_ptrs)
    saves_output = any(ptr in saved for ptr in out_ptrs)
    activations += sum(saved[ptr] for ptr in out_ptrs if ptr in saved)
    return (outputs.detached(out, False), activations, any(ptr in saved for ptr in in_ptrs), saves_output,
            flops.get_total_flops())


def _time_block(block: nn.Module, x, needs_grad: bool, watch: Stopwatch, amp) -> list[float]:
    """Median [forward, backward] seconds of ``block`` on ``x``, with fresh gradients each time
    (the training loop zeroes them to None every step), on ``watch``'s device. No warm-up of
    its own: the caller has just run the block forward and backward once to count its FLOPs
    and saved bytes."""
    grad = None

    def run() -> tuple[float, float]:
        nonlocal grad
        block.zero_grad(set_to_none=True)
        inp = outputs.detached(x, needs_grad)
        watch.start()
        with amp():
            out = block(inp)
        watch.mark()
        grad = outputs.backward(out, grad)
        return watch.laps()

    return median_times(run, warm_up=False, target_s=CUDA_TARGET_S if watch.cuda else TARGET_S)


def _time_block_cold(block: nn.Module, x, needs_grad: bool, amp) -> list[float]:
    """Median [forward, backward] seconds of ``block`` on ``x`` on a CPU, each started with the
    core's caches written over (``timing.evict_caches``): where a node's workers outnumber its
    cores, another worker runs on the core while a pipeline stage waits for its next message,
    and the stage's next action starts cold. Small blocks feel it most: on a 2-core VM a
    LayerNorm/GELU block at 4 samples ran 2.6x its back-to-back forward and 2.1x its backward,
    the probes' 64-wide linear layers over 2 rows 4.3x, a gpt block 1.1x; inside 4-stage
    pipelines on 4 workers, the gallery's models ran 13-29% slower than predicted from the
    back-to-back times. Fewer repeats than ``_time_block``: what is cold is small."""
    grad = inp = None

    def prepare() -> None:
        nonlocal inp
        block.zero_grad(set_to_none=True)
        inp = outputs.detached(x, needs_grad)

    def forward():
        with amp():
            return block(inp)

    def backward(out) -> None:
        nonlocal grad
        grad = outputs.backward(out, grad)

    run = cold_run(forward, backward, prepare)
    return median_times(run, warm_up=False, max_repeats=COLD_REPEATS, target_s=TARGET_S / 2)
