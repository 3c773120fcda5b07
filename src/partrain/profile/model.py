"""The model profile: what one worker measures about a model, block by block.

For every pipeline block (``models.model_blocks``) and every profiled batch size:
forward and backward seconds, output bytes (what a stage boundary sends), the bytes
autograd keeps for backward, and FLOPs (``torch.utils.flop_counter``); once per model:
the optimizer step (SGD with and without momentum, Adam), the loss, the data loading time
per batch, and the
resident memory of a fresh process that has imported torch, loaded the data and built
the model (the baseline every worker's ``ru_maxrss`` starts from), and its peak after a few
serial training steps at each batch size (what the allocator really holds for a step).

Profiles are cached as JSON in the profile directory (``profile.cache``),
keyed by model, dataset, batch sizes, threads and the hardware fingerprint, and reused by
every later prediction. Cost: about four forward/backward passes of the model per batch
size (an instrumented one, which also warms the block up, then at least three timed), as
many again of the blocks as one chain (``profile.blocks``: what a stage of several costs), plus
the memory probe (``profile.probe``): a fresh process (it imports torch) taking two serial steps per batch
size, then 3 to 65 steps (about 0.1 s measured after 1 of warm-up) of partrain's own
training loop per strategy on a world of one at the smallest batch size (``world_of_one_s``:
what DDP and the averager cost beyond the serial loop, measured rather than modelled), and
half as many steps of the bare model against the same model inside a hybrid's replica wrapper
(``replica_wrapper_s``).

On a GPU (``--device cuda``, the default where CUDA is) the same measurements are taken on the
GPU, timed with CUDA events (``timing.Stopwatch``), under the run's autocast precision and
memory format (``profile.numerics``); the memory probe reads the CUDA caching allocator
instead of the resident set, in this process (its peaks are reset and counted from what is
held; no second CUDA start), and also times partrain's serial loop at every profiled batch
size (``ModelProfile.loop_s``), since the allocator peaks need those runs anyway.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from partrain.data import load_dataset
from partrain.distributed.launch import (
    keep_freed_memory,
)
from partrain.errors import PartrainError
from partrain.models import build_model, model_blocks
from partrain.predict.machine import fingerprint
from partrain.predict.profiles import BlockProfile, ModelProfile
from partrain.profile import outputs
from partrain.profile.blocks import profile_blocks, time_chain
from partrain.profile.numerics import (
    autocast,
    device_name,
    place,
    place_input,
    resolve_device,
)
from partrain.profile.pace import Pace, at_pace, probe_pace
from partrain.profile.probe import measure_memory, world_of_one_steps
from partrain.profile.sharing import profile_sharing, start_corunners
from partrain.profile.timing import (
    Stopwatch,
    cpu_seconds,
    median_times,
    others_share,
    timed,
)
from partrain.progress import phase
from partrain.strategies.base import (
    loss_fn,  # class or per-token cross-entropy, as training scores it
)
from partrain.strategies.fsdp import scalar_parameter
from partrain.strategies.traced import TracedSpan, traced_blocks

OPTIMIZERS = ("sgd", "sgd-momentum", "adam")
OPTIMIZER_REPEATS = 10


# ---- measuring ----------------------------------------------------------------------------


def _time_optimizer(params: list[nn.Parameter], kind: str, device: torch.device) -> float:
    """Median seconds of one ``kind`` optimizer step over ``params``, each on fresh gradients
    (as after a backward: newly written memory, not the cache-warm tensors of the last step)."""
    if not params:
        return 0.0
    if kind == "adam":
        opt = torch.optim.Adam(params, lr=1e-12)
    else:
        opt = torch.optim.SGD(params, lr=1e-12, momentum=0.9 if kind == "sgd-momentum" else 0.0)

    watch = Stopwatch(device)

    def run() -> tuple[float]:
        for p in params:
            p.grad = torch.ones_like(p)
        watch.start()
        opt.step()
        return watch.laps()

    # the warm-up step allocates the optimizer state; a median of at most OPTIMIZER_REPEATS
    # steps (a few percent of a training step) is plenty
    seconds = median_times(run, max_repeats=OPTIMIZER_REPEATS)[0]
    for p in params:
        p.grad = None
    return seconds


def _time_loss_and_data(model: nn.Module, train_set, batch: int, device: torch.device, amp,
                        channels_last: bool) -> dict[str, float]:
    """The loss's forward + backward on the model's logits, and loading a batch of random rows
    onto the device (on a GPU: indexing the host copy and the copy over)."""
    n = len(train_set)
    x, y = train_set.get(torch.randint(0, n, (batch,)))
    x, y = place_input(x, device, channels_last), y.to(device)
    with amp():
        logits = model(x).detach().requires_grad_()

    def loss_step() -> None:
        with amp():
            loss = loss_fn(logits, y)
        loss.backward()

    loss = median_times(timed(loss_step, device))[0]
    data = median_times(timed(lambda: place_input(train_set.get(torch.randint(0, n, (batch,)))[0], device, channels_last),
                              device))[0]
    return {"loss_s": loss, "data_s": data}


def profile_model(model: str, dataset: str, batch_sizes: list[int], threads: int = 1, data_dir=None,
                  synthetic: bool = False, options: dict | None = None, seed: int = 0, device: str | None = None,
                  precision: str = "fp32", channels_last: bool = False, compile: bool = False) -> ModelProfile:
    """Measure ``model`` on ``dataset`` at each batch size with ``threads`` intra-op threads, on
    ``device`` (default: the GPU when there is one) at ``precision`` and memory format. The
    blocks run eagerly even with ``compile``: the memory probe's loop runs compiled."""
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise PartrainError(f"--batch-sizes must be positive integers, got {batch_sizes}")
    batch_sizes, options = sorted(set(batch_sizes)), options or {}
    dev = resolve_device(device)
    amp, watch = (lambda: autocast(dev, precision)), Stopwatch(dev)
    started, saved_threads, load_before = time.perf_counter(), torch.get_num_threads(), cpu_seconds()
    keep_freed_memory()  # the allocator a training worker runs with
    torch.set_num_threads(threads)
    try:
        train_set = load_dataset(dataset, "train", data_dir=data_dir, synthetic=synthetic, seed=seed)
        spec = train_set.spec
        torch.manual_seed(seed)
        net = place(build_model(model, spec.input_shape, spec.num_classes, **options), dev, channels_last)
        blocks = model_blocks(net)
        # the machine's pace, sampled at each phase below (profile.pace); the windows leave no gradient behind
        pace = Pace.of(net, train_set, batch_sizes[0], dict(device=dev.type, precision=precision,
                                                           channels_last=channels_last)) if dev.type == "cpu" else None
        plain = len(blocks) == 1  # one block: the pipelines run the tracer's pieces (strategies.traced)
        per_batch, chain = [], []  # chain: the blocks as one stage, per batch size (_time_chain)
        for i, b in enumerate(batch_sizes):
            _sample(pace)
            x = place_input(train_set.get(torch.arange(b) % len(train_set))[0], dev, channels_last)
            if plain:
                blocks = _traced_pieces(net, x, blocks if i else None)
            phase(f"profile {model}", f"timing {len(blocks)} blocks forward and backward at batch {b} ({i + 1} of {len(batch_sizes)})")
            per_batch.append((profile_blocks(blocks, x, watch, amp),
                              _time_loss_and_data(net, train_set, b, dev, amp, channels_last)))
            chain.append(time_chain(blocks, x, watch, amp, accumulate=not i))
        block_profiles = [
            _block_profile(_name_of(net, blk), blk, [rows[i] for rows, _ in per_batch], dev) for i, blk in enumerate(blocks)
        ]
        params = [p for p in net.parameters() if p.requires_grad]
        phase(f"profile {model}", "timing the optimizer steps")
        optimizer_s = {kind: _time_optimizer(params, kind, dev) for kind in OPTIMIZERS}
        _sample(pace)
    finally:
        torch.set_num_threads(saved_threads)
    scalar = scalar_parameter(net) or ""  # fsdp and a hybrid's replicas refuse such a model (plan.check_plan)
    if dev.type == "cuda":  # the probe process measures its own allocator: give it the memory back
        del net, blocks, params
        torch.cuda.empty_cache()
    others = others_share(load_before, cpu_seconds(), time.perf_counter() - started)
    first = per_batch[0]  # the smallest batch size: the world-of-one runs' estimated step sets their length
    step_s = sum(r["fwd_s"] + r["bwd_s"] for r in first[0]) + sum(first[1].values()) + optimizer_s["sgd-momentum"]
    sharing_batch = batch_sizes[len(batch_sizes) // 2]  # the middle profiled size (profile.sharing)
    # CPU workers share a node's cores: the sharing probe's co-runners start now, beside the memory
    # probe's start-up (GPU workers each have their own device: nothing to measure)
    corunners = start_corunners(dict(model=model, dataset=dataset, input_shape=list(spec.input_shape),
                                     num_classes=spec.num_classes, threads=threads, data_dir=None if data_dir is None
                                     else str(data_dir), synthetic=synthetic, options=options, seed=seed),
                                sharing_batch) if dev.type == "cpu" else None
    try:
        phase(f"profile {model}", "memory and the training loop of serial, DDP, local SGD, FSDP and a hybrid on a world of one "
                                  + ("(on the GPU, in this process)" if dev.type == "cuda" else "(a fresh process)"))
        memory = measure_memory(model, dataset, spec.input_shape, spec.num_classes, batch_sizes, threads, data_dir, synthetic,
                                options, world_of_one_steps(step_s), step_s=step_s,
                                run={"device": dev.type, "precision": precision, "channels_last": channels_last,
                                     "compile": compile})
        _sample(pace, warm=True)  # this process waited on the probe's: past its wake-up (pace.WAKE_S)
        sharing = {}
        if corunners is not None:
            phase(f"profile {model}", f"its compute with 2..{corunners.n + 1} workers side by side (fresh processes)")
            torch.set_num_threads(threads)
            sharing = profile_sharing(net, train_set, sharing_batch, corunners)
        _sample(pace)
    finally:
        torch.set_num_threads(saved_threads)
        if corunners is not None:
            corunners.close()
    # the probe's timings, taken in a second or two of their own, at the machine's pace over the whole profile
    probe_factor, windows = 1.0, []
    if pace is not None:
        probe_factor, windows = probe_pace(pace.windows, memory.get("pace", [])), pace.windows + memory.get("pace", [])
        memory = at_pace(memory, probe_factor)
    whole = {key: [w[key] for _, w in per_batch] for key in per_batch[0][1]}
    loop = memory.get("loop") or _cpu_loop(memory)
    return ModelProfile(
        model=model, dataset=dataset, synthetic=synthetic, batch_sizes=batch_sizes, threads=threads,
        fingerprint=fingerprint().hash, input_shape=list(spec.input_shape),
        input_bytes=outputs.nbytes(train_set.get(torch.arange(1))[0]), train_samples=len(train_set),  # int64 ids: 8 each
        blocks=block_profiles, loss_s=whole["loss_s"], data_s=whole["data_s"],
        optimizer_s=optimizer_s, baseline_rss_bytes=memory["rss"], baseline_peak_rss_bytes=memory["peak"],
        train_peak_rss_bytes=memory["train_peaks"], replica_wrapper_s=memory["replica_wrapper"], profile_seconds=time.perf_counter() - started,
        other_load=others, options=options, world_of_one_s=memory["world_of_one"],
        world_of_one_batch=min(batch_sizes), device=device_name(dev), precision=precision,
        channels_last=channels_last, compile=compile, train_peak_reserved_bytes=memory.get("train_peaks_reserved", []),
        loop_s=loop, probe_pace=probe_factor, compute_sharing=sharing, sharing_batch=sharing_batch, scalar_parameter=scalar,
        pace_s=windows, chain_s=[c[:2] for c in chain], accumulate_s=max(0.0, chain[0][2] - chain[0][1]),
    )


def _sample(pace: Pace | None, warm: bool = False) -> None:
    if pace is not None:
        pace.sample(warm)


def _traced_pieces(net: nn.Module, x, first: list[nn.Module] | None) -> list[nn.Module]:
    """A plain module's blocks at ``x``'s batch size, as the pipelines cut it: the pieces of its
    trace, traced again at every batch size (``torch.export`` may fix it in a reshape), as many
    as at the first (``first``, the first batch's pieces). A module the tracer cannot split stays
    one block: its pipelines are refused, by the run and by the predictor."""
    try:
        pieces = traced_blocks(net, x)
    except PartrainError:
        pieces = [net]
    if first is not None and len(pieces) != len(first):
        raise PartrainError(f"{type(net).__name__} traced into {len(first)} pieces at one batch size and "
                            f"{len(pieces)} at another: return (model, blocks) from the factory")
    return pieces


def _cpu_loop(memory: dict) -> list[float]:
    """partrain's serial loop at every profiled batch size on a CPU: its time on a world of one
    at the smallest size, grown as the probe's bare loop grows (load a new batch, forward,
    loss, backward, SGD step). The loop is not the sum of its parts: a block timed alone runs
    on a warm cache, the whole step's activations do not fit in one (gpt at batch 128: a 105.3
    ms loop where its parts summed to 90.7; at batch 4, 4.05 against 3.55), and a new batch
    read each step evicts part of what the last one left (MNIST at batch 128: 1.3 ms over a
    step on one batch, where loading it alone took 1.0). Empty when the probe did not time
    them."""
    bare, ran = memory.get("bare_loop") or [], memory.get("world_of_one", {}).get("serial")
    if ran is None or not bare:
        return []
    # never below the smallest batch's loop: a bare loop timed slow at the smallest size (another
    # process took the core) made the larger sizes' negative, and a serial step of 0 s
    return [ran + max(0.0, t - bare[0]) for t in bare]


def _name_of(model: nn.Module, block: nn.Module) -> str:
    if isinstance(block, TracedSpan):
        return block.begins
    return next((name for name, m in model.named_modules() if m is block), "") or type(block).__name__


def _block_profile(name: str, block: nn.Module, rows: list[dict], device: torch.device) -> BlockProfile:
    params = [p for p in block.parameters()]
    return BlockProfile(
        name=name,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        param_tensors=len(params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in block.buffers()),
        fwd_s=[r["fwd_s"] for r in rows],
        bwd_s=[r["bwd_s"] for r in rows],
        fwd_cold_s=[r["cold"][0] for r in rows if r["cold"]],
        bwd_cold_s=[r["cold"][1] for r in rows if r["cold"]],
        out_bytes=[r["out_bytes"] for r in rows],
        out_tensors=rows[0]["out_tensors"],
        out_floats=rows[0]["out_floats"],
        saved_bytes=[r["saved_bytes"] for r in rows],
        saves_input=rows[0]["saves_input"],
        saves_output=rows[0]["saves_output"],
        flops=[r["flops"] for r in rows],
        optimizer_s={kind: _time_optimizer([p for p in params if p.requires_grad], kind, device) for kind in OPTIMIZERS},
    )
