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
size (an instrumented one, which also warms the block up, then at least three timed), plus
the memory probe: a fresh process (it imports torch) taking two serial steps per batch
size, then 3 to 65 steps (about 0.1 s measured after 1 of warm-up) of partrain's own
training loop per strategy on a world of one at the smallest batch size (``world_of_one_s``:
what DDP and the averager cost beyond the serial loop, measured rather than modelled), and
half as many steps of the bare model against the same model inside a hybrid's replica wrapper
(``replica_wrapper_s``).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from partrain.data import load_dataset
from partrain.distributed.launch import (
    LaunchInfo,
    init_process_group,
    keep_freed_memory,
    leave_process_group,
)
from partrain.distributed.spawn import child_env, python_command
from partrain.errors import PartrainError
from partrain.models import build_model, model_blocks
from partrain.predict.machine import fingerprint
from partrain.predict.profiles import BlockProfile, ModelProfile
from partrain.progress import phase
from partrain.spec import SPECS
from partrain.strategies.base import (
    loss_fn,  # class or per-token cross-entropy, as training scores it
)

OPTIMIZERS = ("sgd", "sgd-momentum", "adam")
MIN_REPEATS, MAX_REPEATS, TARGET_S = 3, 50, 0.25  # timed runs per measurement: at least 3, about 0.25 s
OPTIMIZER_REPEATS = 10


# ---- measuring ----------------------------------------------------------------------------


def _median_times(run: Callable[[], tuple[float, ...]], warm_up: bool = True,
                  max_repeats: int = MAX_REPEATS) -> list[float]:
    """Per component, the median seconds ``run`` reports, after one warm-up call (unless the
    caller has just run the same work).

    The samples are split in their first and second half and the lower median is kept: a
    burst of work from another process during one half does not move the result.
    """
    if warm_up:
        run()
    samples: list[tuple[float, ...]] = []
    while len(samples) < MIN_REPEATS or (sum(map(sum, samples)) < TARGET_S and len(samples) < max_repeats):
        samples.append(run())
    return [_lower_half_median([s[i] for s in samples]) for i in range(len(samples[0]))]


def _lower_half_median(samples: list[float]) -> float:
    """The lower of the medians of the first and the second half of ``samples``: a burst of
    other work in one half does not move it. Of three, the median; of two, the lower: a big
    model's world-of-one run times 2 steps, and their mean would take half of one slow step
    into the loop's overhead (resnet18 at batch 4 ran 161 ms a step in one profile, 245 in
    the next)."""
    if len(samples) < 4:
        return statistics.median(samples) if len(samples) == 3 else min(samples)
    half = len(samples) // 2
    return min(statistics.median(samples[:half]), statistics.median(samples[half:]))


def _timed(fn: Callable[[], object]) -> Callable[[], tuple[float]]:
    def run() -> tuple[float]:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start,)

    return run


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _inspect_block(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int, bool, bool, int]:
    """One instrumented forward + backward: (output, saved bytes, saves input, saves output, FLOPs)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr, nbytes = _storage(t)
        saved[ptr] = nbytes
        return t

    with FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
        out.backward(torch.ones_like(out))
    owned = {_storage(t)[0] for t in [*block.parameters(), *block.buffers()]}
    in_ptr, out_ptr = _storage(x)[0], _storage(out)[0]
    activations = sum(n for ptr, n in saved.items() if ptr not in owned and ptr not in (in_ptr, out_ptr))
    saves_output = out_ptr in saved
    activations += saved[out_ptr] if saves_output else 0
    return out.detach(), activations, in_ptr in saved, saves_output, flops.get_total_flops()


def _time_block(block: nn.Module, x: torch.Tensor, needs_grad: bool) -> list[float]:
    """Median [forward, backward] seconds of ``block`` on ``x``, with fresh gradients each time
    (the training loop zeroes them to None every step). No warm-up of its own: the caller has
    just run the block forward and backward once to count its FLOPs and saved bytes."""
    grad = None

    def run() -> tuple[float, float]:
        nonlocal grad
        block.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_(needs_grad)
        start = time.perf_counter()
        out = block(inp)
        mid = time.perf_counter()
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)
        return mid - start, time.perf_counter() - mid

    return _median_times(run, warm_up=False)


def _time_optimizer(params: list[nn.Parameter], kind: str) -> float:
    """Median seconds of one ``kind`` optimizer step over ``params``, each on fresh gradients
    (as after a backward: newly written memory, not the cache-warm tensors of the last step)."""
    if not params:
        return 0.0
    if kind == "adam":
        opt = torch.optim.Adam(params, lr=1e-12)
    else:
        opt = torch.optim.SGD(params, lr=1e-12, momentum=0.9 if kind == "sgd-momentum" else 0.0)

    def run() -> tuple[float]:
        for p in params:
            p.grad = torch.ones_like(p)
        start = time.perf_counter()
        opt.step()
        return (time.perf_counter() - start,)

    # the warm-up step allocates the optimizer state; a median of at most OPTIMIZER_REPEATS
    # steps (a few percent of a training step) is plenty
    seconds = _median_times(run, max_repeats=OPTIMIZER_REPEATS)[0]
    for p in params:
        p.grad = None
    return seconds


def _profile_blocks(blocks: list[nn.Module], x: torch.Tensor) -> list[dict]:
    """Per block at one batch size: times, bytes and FLOPs, each block fed the previous one's output."""
    rows = []
    for i, block in enumerate(blocks):
        needs_grad = i > 0  # the data does not need a gradient: block 0 skips its input gradient
        out, saved, saves_in, saves_out, flops = _inspect_block(block, x.detach().requires_grad_(needs_grad))
        fwd, bwd = _time_block(block, x, needs_grad)
        rows.append({"fwd_s": fwd, "bwd_s": bwd, "out_bytes": out.numel() * out.element_size(),
                     "saved_bytes": saved, "saves_input": saves_in, "saves_output": saves_out, "flops": flops})
        block.zero_grad(set_to_none=True)
        x = out
    return rows


def _time_loss_and_data(model: nn.Module, train_set, batch: int) -> dict[str, float]:
    """The loss's forward + backward on the model's logits, and loading a batch of random rows."""
    n = len(train_set)
    x, y = train_set.get(torch.randint(0, n, (batch,)))
    logits = model(x).detach().requires_grad_()
    loss = _median_times(_timed(lambda: loss_fn(logits, y).backward()))[0]
    data = _median_times(_timed(lambda: train_set.get(torch.randint(0, n, (batch,)))))[0]
    return {"loss_s": loss, "data_s": data}


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process has used, CPU seconds this one and its children have), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
    # this process and the children it waited for (the memory probe): what is left is the others'
    children = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time() + children.children_user + children.children_system


def _others_share(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """The share of all cores that other processes kept busy over ``wall`` seconds: time
    measured while they ran is inflated, and the profile says so."""
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / (wall * (os.cpu_count() or 1)))


def _status_bytes(key: str) -> int:
    """A /proc/self/status memory figure. VmHWM, not ru_maxrss, for peaks: Linux carries
    ru_maxrss over exec from the parent process (here, the profiler)."""
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def baseline_probe() -> None:
    """Entry point of the memory probe: a fresh process set up as a training worker is.

    Prints its resident set after the set-up (and the peak of it), then the peak resident
    set of two serial training steps (SGD with momentum) at each batch size, ascending.
    """
    args = json.loads(sys.argv[1])
    import partrain.runner  # noqa: F401  (a worker imports the training machinery)

    keep_freed_memory()  # as a training worker does
    torch.set_num_threads(args["threads"])
    data = dict(data_dir=args["data_dir"], synthetic=args["synthetic"])
    train_set = load_dataset(args["dataset"], "train", **data)
    load_dataset(args["dataset"], "test", **data)
    net = build_model(args["model"], tuple(args["input_shape"]), args["num_classes"], **args["options"])
    torch.ones(64, 64) @ torch.ones(64, 64)  # start the intra-op thread pool
    out = {"rss": _status_bytes("VmRSS"), "peak": _status_bytes("VmHWM"), "train_peaks": []}
    opt = torch.optim.SGD(net.parameters(), lr=1e-12, momentum=0.9)
    for b in sorted(args["batch_sizes"]):
        x, y = train_set.get(torch.arange(b) % len(train_set))
        for _ in range(2):  # the first step allocates the momentum, the second runs with it
            opt.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            opt.step()
        out["train_peaks"].append(_status_bytes("VmHWM"))
    steps = args["world_of_one_steps"]
    out["world_of_one"] = _time_world_of_one(args) if steps else {}
    x, y = train_set.get(torch.arange(min(args["batch_sizes"])) % len(train_set))
    out["replica_wrapper"] = _time_replica_wrapper(args, x, y, max(2, steps // 2)) if steps else 0.0
    print(json.dumps(out))


WORLD_OF_ONE = tuple(name for name, spec in SPECS.items() if spec.world_of_one_probe)
# the first step is left out (the median shrugs off a second slow one); the measured ones take
# about 0.1 s: 2 steps of a big model, up to 64 of a millisecond one, whose overheads are small
# differences of short steps that a burst of other work can swamp in a few samples
WORLD_OF_ONE_WARMUP, WORLD_OF_ONE_TARGET_S, WORLD_OF_ONE_MAX_STEPS = 1, 0.1, 64


def world_of_one_steps(step_s: float) -> int:
    """Measured steps per strategy for a serial step of about ``step_s``: 2 to 64."""
    return min(WORLD_OF_ONE_MAX_STEPS, max(2, round(WORLD_OF_ONE_TARGET_S / max(step_s, 1e-9))))


def _time_world_of_one(args: dict) -> dict[str, float]:
    """Step time (the lower of its halves' medians) of partrain's own training loop (``train.train_worker``, as a
    benchmark cell runs it) on a world of one, per strategy in ``WORLD_OF_ONE``, at the
    smallest profiled batch size: what each strategy's machinery costs beyond the serial
    loop, which the blocks' times cannot show. Runs in the probe process, after the memory
    figures were taken."""
    from partrain.config import RunConfig
    from partrain.train import train_worker

    batch = min(args["batch_sizes"])
    base = dict(model=args["model"], dataset=args["dataset"], data_dir=args["data_dir"], synthetic=args["synthetic"],
                model_options=args["options"], batch_size=batch, steps=WORLD_OF_ONE_WARMUP + args["world_of_one_steps"],
                evaluate=False, threads=args["threads"], workers=1)
    out = {}
    for strategy in WORLD_OF_ONE:
        result = train_worker(RunConfig(strategy=strategy, **base), LaunchInfo("none"), show_progress=False)
        out[strategy] = _lower_half_median(result.step_seconds[WORLD_OF_ONE_WARMUP:])
    torch.set_num_threads(args["threads"])
    return out


def _time_replica_wrapper(args: dict, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Seconds a step of the whole model gains inside the replica wrapper a ``hybrid`` puts on
    each stage when dp > 1 (``strategies.pipeline``: ``fully_shard`` on a (replicate, shard=1)
    mesh, parameters unsharded once per step): DTensor parameters, the hooks, the gradients'
    copy into the reduction buffer and out of it, the optimizer stepping DTensors. Timed on a
    world of one, a new model bare and then wrapped in place, ``steps`` SGD-momentum steps each
    after a warm-up; the allreduce between replicas is the hardware profile's. A world-of-one
    hybrid cannot show this: with one replica the stage is not wrapped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net, mesh = build_model(args["model"], tuple(args["input_shape"]), args["num_classes"], **args["options"]), None
    init_process_group(LaunchInfo("none"), "gloo", timeout_s=300.0)
    try:
        bare = _loop_step_s(net, x, y, steps)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "shard"))
        fully_shard(net, mesh=mesh, reshard_after_forward=False)
        return max(0.0, _loop_step_s(net, x, y, steps) - bare)
    finally:
        # the wrapped module holds the mesh, which holds the group: free them before the group
        # goes (see train.train_worker)
        net = mesh = None
        leave_process_group()


def _loop_step_s(net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """A plain SGD-momentum training step of ``net`` on (x, y): the lower of its halves' medians
    over ``steps`` steps after the warm-up (a fresh optimizer: ``fully_shard`` replaces the parameters)."""
    opt = torch.optim.SGD(net.parameters(), lr=1e-12, momentum=0.9)
    samples = []
    for _ in range(WORLD_OF_ONE_WARMUP + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()
        samples.append(time.perf_counter() - start)
    return _lower_half_median(samples[WORLD_OF_ONE_WARMUP:])


def measure_memory(model: str, dataset: str, input_shape, num_classes: int, batch_sizes: list[int], threads: int,
                   data_dir, synthetic: bool, options: dict, world_of_one_steps: int = 0) -> dict:
    """``baseline_probe``'s figures: {"rss", "peak", "train_peaks" (one per batch size),
    "world_of_one" (step per strategy, the lower of its halves' medians, over ``world_of_one_steps`` steps after warm-up;
    not measured when 0), "replica_wrapper" (``_time_replica_wrapper``; 0 when not measured)}."""
    args = {"model": model, "dataset": dataset, "input_shape": list(input_shape), "num_classes": num_classes,
            "batch_sizes": batch_sizes, "threads": threads, "data_dir": None if data_dir is None else str(data_dir),
            "synthetic": synthetic, "options": options, "world_of_one_steps": world_of_one_steps}
    proc = subprocess.run([*python_command(), "-c", "from partrain.profile.model import baseline_probe; baseline_probe()",
                           json.dumps(args)], capture_output=True, text=True, env=child_env(), timeout=600)
    if proc.returncode != 0:
        raise PartrainError(f"measuring the baseline memory failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile_model(model: str, dataset: str, batch_sizes: list[int], threads: int = 1, data_dir=None,
                  synthetic: bool = False, options: dict | None = None, seed: int = 0) -> ModelProfile:
    """Measure ``model`` on ``dataset`` at each batch size with ``threads`` intra-op threads."""
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise PartrainError(f"--batch-sizes must be positive integers, got {batch_sizes}")
    batch_sizes, options = sorted(set(batch_sizes)), options or {}
    started, saved_threads, load_before = time.perf_counter(), torch.get_num_threads(), _cpu_seconds()
    keep_freed_memory()  # the allocator a training worker runs with
    torch.set_num_threads(threads)
    try:
        train_set = load_dataset(dataset, "train", data_dir=data_dir, synthetic=synthetic, seed=seed)
        spec = train_set.spec
        torch.manual_seed(seed)
        net = build_model(model, spec.input_shape, spec.num_classes, **options)
        blocks = model_blocks(net)
        per_batch = []
        for i, b in enumerate(batch_sizes):
            phase(f"profile {model}", f"timing {len(blocks)} blocks forward and backward at batch {b} ({i + 1} of {len(batch_sizes)})")
            x = train_set.get(torch.arange(b) % len(train_set))[0]
            per_batch.append((_profile_blocks(blocks, x), _time_loss_and_data(net, train_set, b)))
        block_profiles = [
            _block_profile(_name_of(net, blk), blk, [rows[i] for rows, _ in per_batch]) for i, blk in enumerate(blocks)
        ]
        params = [p for p in net.parameters() if p.requires_grad]
        phase(f"profile {model}", "timing the optimizer steps")
        optimizer_s = {kind: _time_optimizer(params, kind) for kind in OPTIMIZERS}
    finally:
        torch.set_num_threads(saved_threads)
    others = _others_share(load_before, _cpu_seconds(), time.perf_counter() - started)
    first = per_batch[0]  # the smallest batch size: the world-of-one runs' estimated step sets their length
    step_s = sum(r["fwd_s"] + r["bwd_s"] for r in first[0]) + sum(first[1].values()) + optimizer_s["sgd-momentum"]
    phase(f"profile {model}", "memory and the training loop of serial, DDP and local SGD on a world of one (a fresh process)")
    memory = measure_memory(model, dataset, spec.input_shape, spec.num_classes, batch_sizes, threads, data_dir, synthetic,
                            options, world_of_one_steps(step_s))
    whole = {key: [w[key] for _, w in per_batch] for key in per_batch[0][1]}
    return ModelProfile(
        model=model, dataset=dataset, synthetic=synthetic, batch_sizes=batch_sizes, threads=threads,
        fingerprint=fingerprint().hash, input_shape=list(spec.input_shape),
        input_bytes=4 * int(torch.tensor(spec.input_shape).prod()), train_samples=len(train_set),
        blocks=block_profiles, loss_s=whole["loss_s"], data_s=whole["data_s"],
        optimizer_s=optimizer_s, baseline_rss_bytes=memory["rss"], baseline_peak_rss_bytes=memory["peak"],
        train_peak_rss_bytes=memory["train_peaks"], replica_wrapper_s=memory["replica_wrapper"], profile_seconds=time.perf_counter() - started,
        other_load=others, options=options, world_of_one_s=memory["world_of_one"],
        world_of_one_batch=min(batch_sizes),
    )


def _name_of(model: nn.Module, block: nn.Module) -> str:
    return next((name for name, m in model.named_modules() if m is block), "") or type(block).__name__


def _block_profile(name: str, block: nn.Module, rows: list[dict]) -> BlockProfile:
    params = [p for p in block.parameters()]
    return BlockProfile(
        name=name,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        param_tensors=len(params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in block.buffers()),
        fwd_s=[r["fwd_s"] for r in rows],
        bwd_s=[r["bwd_s"] for r in rows],
        out_bytes=[r["out_bytes"] for r in rows],
        saved_bytes=[r["saved_bytes"] for r in rows],
        saves_input=rows[0]["saves_input"],
        saves_output=rows[0]["saves_output"],
        flops=[r["flops"] for r in rows],
        optimizer_s={kind: _time_optimizer([p for p in params if p.requires_grad], kind) for kind in OPTIMIZERS},
    )
