"""Peak memory per worker: model state, optimizer state, activations, communication buffers.

Model state per trained parameter byte (Rajbhandari et al., "ZeRO", SC 2020, section 3.1,
for the accounting; the state each optimizer keeps is torch's):

- parameters: 1x (already part of the measured baseline: every worker builds the model);
- gradients: 1x;
- ``torch.optim.SGD``: a ``momentum_buffer`` (1x) per parameter when momentum != 0, none
  without momentum;
- ``torch.optim.Adam``: ``exp_avg`` and ``exp_avg_sq`` (2x) plus a 0-d float32 ``step`` tensor
  per parameter tensor.

Activations are the bytes autograd keeps for backward, measured per block, times the
micro-batches a schedule keeps in flight (from the pipeline simulation: M for GPipe, at most
P - s on stage s for 1F1B), or only each block's input with recomputation (Chen et al. 2016).
On CPU the result is comparable with ``ru_maxrss`` because the measured baseline (a fresh
process with torch imported, the data loaded and the model built) is added, and what a
step holds beyond state and activations (``transient_bytes``) is measured in that process.
"""

from __future__ import annotations

from dataclasses import dataclass

from partrain.predict.compute import at
from partrain.predict.profiles import ModelProfile

ADAM_STEP_BYTES = 4  # torch.optim.Adam's per-parameter 'step': a 0-d float32 tensor (capturable=False)


def optimizer_state_bytes(param_bytes: int, param_tensors: int, optimizer: str, momentum: float) -> int:
    """Bytes of optimizer state for parameters of ``param_bytes`` in ``param_tensors`` tensors."""
    if optimizer == "adam":
        return 2 * param_bytes + ADAM_STEP_BYTES * param_tensors
    return param_bytes if momentum != 0 else 0


@dataclass(frozen=True)
class MemoryBreakdown:
    """One worker's peak, in bytes."""

    baseline: int  # measured process: torch, data, the model's parameters
    baseline_peak: int  # the same process's peak while loading (can exceed what stays resident)
    process_group: int
    gradients: int
    optimizer: int
    buffers: int  # DDP gradient buckets, pipeline receive buffers, FSDP gathered parameters
    activations: int
    transient: int  # gradients of activations, kernel workspaces, what the allocator keeps (measured)

    @property
    def total(self) -> int:
        training = (self.baseline + self.process_group + self.gradients + self.optimizer + self.buffers
                    + self.activations + self.transient)
        return max(self.baseline_peak, training)


def block_input_bytes(profile: ModelProfile, i: int, b: float) -> float:
    if i == 0:
        return profile.input_bytes * b
    return at(profile, profile.blocks[i - 1].out_bytes, b)


def activation_bytes(profile: ModelProfile, lo: int, hi: int, b: float, recompute: bool = False) -> float:
    """Bytes blocks ``lo..hi-1`` keep for backward on a (micro-)batch of ``b``.

    A block's input is the previous block's output: it is counted once, by whichever of the
    two saves it. The stage's own input is not counted (it is the data batch or a receive
    buffer, counted there). With recomputation a block keeps only its input, plus, during its
    backward, its recomputed activations: one block's worth at a time.
    """
    blocks = profile.blocks
    if recompute:
        inputs = sum(block_input_bytes(profile, i, b) for i in range(lo + 1, hi))
        return inputs + max(at(profile, blocks[i].saved_bytes, b) for i in range(lo, hi))
    total = 0.0
    for i in range(lo, hi):
        total += at(profile, blocks[i].saved_bytes, b)
        if i > lo and blocks[i].saves_input and not blocks[i - 1].saves_output:
            total += block_input_bytes(profile, i, b)
    return total


def stage_state(profile: ModelProfile, lo: int, hi: int, optimizer: str, momentum: float, shards: int = 1) -> tuple[int, int]:
    """(gradient bytes, optimizer bytes) for blocks ``lo..hi-1``, split over ``shards`` workers (FSDP)."""
    blocks = profile.blocks[lo:hi]
    params = sum(b.param_bytes for b in blocks)
    tensors = sum(b.param_tensors for b in blocks)
    return params // shards, optimizer_state_bytes(params, tensors, optimizer, momentum) // shards


def transient_bytes(profile: ModelProfile, activations: float, computing: float | None = None) -> int:
    """What a training step holds beyond model state and saved activations, for a worker that
    keeps ``activations`` bytes: the gradients flowing back through the activations, kernel
    workspaces, and memory the allocator keeps without returning it to the system.

    Measured, not modelled: the profile's probe process peaks after serial steps at each batch
    size; less its baseline, gradients, momentum and saved activations, what is left is fitted
    as a fixed part plus a part per byte of activations (a least-squares line through the
    batch sizes; proportional with one).

    Up to one byte per byte of activations is what flows back through the ones kept: it grows
    with every micro-batch a pipeline stage holds. Beyond that it is the computation's own
    workspace (the loss over a wide head's logits, say), held for the one micro-batch a stage
    computes at a time, whose activations ``computing`` are (default: all of ``activations``).
    Issue 17's gallery ``tuple_out`` model (token logits over small saved activations) reads
    26.5 bytes per byte, the zoo and the other gallery models 0-1.3; scaled by all it held,
    its GPipe cells at batch 128 were predicted 534 MiB against 344-358 measured (run66u).
    """
    n = len(profile.blocks)
    grads, momentum = stage_state(profile, 0, n, "sgd", 0.9)
    acts = [activation_bytes(profile, 0, n, b) + block_input_bytes(profile, 0, b) for b in profile.batch_sizes]
    extra = [max(0.0, peak - profile.baseline_rss_bytes - grads - momentum - a)
             for peak, a in zip(profile.train_peak_rss_bytes, acts)]
    if len(acts) == 1 or max(acts) == min(acts):
        per_byte, fixed = extra[0] / acts[0] if acts[0] else 0.0, 0.0
    else:
        mean_a, mean_e = sum(acts) / len(acts), sum(extra) / len(extra)
        per_byte = sum((a - mean_a) * (e - mean_e) for a, e in zip(acts, extra)) / sum((a - mean_a) ** 2 for a in acts)
        per_byte = max(0.0, per_byte)
        fixed = max(0.0, mean_e - per_byte * mean_a)
    computing = activations if computing is None else computing
    return int(fixed + min(per_byte, 1.0) * activations + max(0.0, per_byte - 1.0) * computing)
