"""The memory probe: a fresh process set up as a training worker is, measuring what only a
fresh process can show (its resident memory after set-up and after a few steps) and what
partrain's own loop costs on a world of one, per strategy, and inside a hybrid's replica
wrapper; on a CPU it also times a bare serial loop at every profiled batch size ("bare_loop":
load a batch, forward, loss, backward, SGD step), each larger size as a multiple of the
smallest's step, paired step by step in rounds spread over the probe, which ``profile.model``
turns into the loop's step time there. Its times are multiples of the bare step at the smallest
size, timed in windows between its rounds (``profile.pace``), times the median window.
``profile.model`` starts it (``measure_memory``) and folds its figures into the profile.

On a GPU (``cuda_probe``, run in the profiler's own process: the allocator's peaks reset, and
count from what that process holds) the memory is the CUDA caching allocator's: the bytes the model's
parameters and buffers take once placed, and the peaks (allocated, what ``train`` reports, and
reserved) of partrain's own serial loop at every profiled batch size, whose step times are kept
too (``loop``): on a GPU the whole loop, data path and launch overlap included, is the better
measurement of a serial step than the sum of separately synchronised blocks.
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from partrain.data import load_dataset
from partrain.data.load import reused_splits
from partrain.distributed.launch import (
    LaunchInfo,
    init_process_group,
    keep_freed_memory,
    leave_process_group,
)
from partrain.distributed.spawn import child_env, leave_at_once, python_command
from partrain.errors import PartrainError
from partrain.models import build_model
from partrain.profile.numerics import autocast, place, place_input
from partrain.profile.pace import Pace, bare_step, paired_ratios, still_sgd
from partrain.profile.timing import Stopwatch, lower_half_median
from partrain.progress import phase
from partrain.spec import SPECS
from partrain.strategies.base import (
    loss_fn,  # class or per-token cross-entropy, as training scores it
)
from partrain.strategies.fsdp import scalar_parameter


def _status_bytes(key: str) -> int:
    """A /proc/self/status memory figure. VmHWM, not ru_maxrss, for peaks: Linux carries
    ru_maxrss over exec from the parent process (here, the profiler)."""
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def baseline_probe() -> None:
    """Entry point of the memory probe: a fresh process set up as a training worker is.

    Prints its resident set after the set-up (and the peak of it), then the peak resident
    set of two serial training steps (SGD with momentum) at each batch size, ascending; on a
    CPU the timings after them, with the windows of the machine's pace taken around them
    (``profile.pace``: "pace").
    """
    args = json.loads(sys.argv[1])
    import partrain.runner  # noqa: F401  (a worker imports the training machinery)

    # every world-of-one run below leaves its process group with a full garbage collection
    # (``leave_process_group``), which walks every object torch's import made: 0.1 s each, 1 s
    # of a small model's 4.4 s probe. Frozen, those objects are skipped: only the runs' own are walked.
    gc.freeze()
    with reused_splits():  # the world-of-one runs below load the data the probe loaded already
        print(json.dumps(cuda_probe(args) if args["run"]["device"] == "cuda" else _cpu_probe(args)))
    leave_at_once()  # the profiler waits on this process's exit: not on its teardown


def _cpu_probe(args: dict) -> dict:
    """``baseline_probe``'s figures on a CPU."""
    keep_freed_memory()  # as a training worker does
    torch.set_num_threads(args["threads"])
    data = dict(data_dir=args["data_dir"], synthetic=args["synthetic"])
    train_set = load_dataset(args["dataset"], "train", **data)
    load_dataset(args["dataset"], "test", **data)
    run, cpu = args["run"], torch.device("cpu")
    net = place(build_model(args["model"], tuple(args["input_shape"]), args["num_classes"], **args["options"]), cpu,
                run["channels_last"])
    torch.ones(64, 64) @ torch.ones(64, 64)  # start the intra-op thread pool
    out = {"rss": _status_bytes("VmRSS"), "peak": _status_bytes("VmHWM"), "train_peaks": []}
    opt, sizes = still_sgd(net), sorted(args["batch_sizes"])
    # the bare step at the smallest size (it allocates the momentum): the windows of the machine's
    # pace before, between and after the timings below, and what every other size is paired with
    pace = Pace(bare_step(net, opt, train_set, sizes[0], run))
    pace.sample()
    steps = {b: bare_step(net, opt, train_set, b, run) for b in sizes}
    for b in sizes:
        steps[b]()
        steps[b]()  # a step's peak, with the momentum and the allocator's pages of the step before
        out["train_peaks"].append(_status_bytes("VmHWM"))
    ratios: dict[int, list[float]] = {b: [] for b in sizes[1:]}

    def bare_round() -> float:
        """A window of the machine's pace (its seconds returned), then every larger size's bare step
        against the smallest's, pair by pair (``pace.paired_ratios``): one round before the
        world-of-one runs, one after each of their rounds, one after the replica wrapper. The
        window comes first, after other work, as the profiler's do: taken after the pairs, on
        caches they had just warmed, the probe's windows read faster than the profiler's (the
        traced gallery model: the probe's figures scaled by 1.08-1.57 in three profiles, its
        serial loop predicted +35% to +113%)."""
        pace.sample()
        for b in ratios:
            ratios[b] += paired_ratios(steps[b], pace.step, BARE_LOOP_TARGET_S / BARE_LOOP_ROUNDS)
        return pace.windows[-1]

    n, multiples = args["world_of_one_steps"], {}
    if n:  # every strategy's step as a multiple of the bare step's windows between its rounds
        multiples = _time_world_of_one(args, between_rounds=bare_round)
    else:
        bare_round()
    x, y = train_set.get(torch.arange(sizes[0]) % len(train_set))
    out["replica_wrapper"] = _time_replica_wrapper(args, x, y, max(2, n // 2)) if n else 0.0
    bare_round()
    out["pace"] = pace.windows
    smallest = statistics.median(pace.windows)
    out["bare_loop"] = [smallest] + [smallest * statistics.median(ratios[b]) for b in sizes[1:]]
    out["world_of_one"] = {strategy: smallest * m for strategy, m in multiples.items()}
    return out


WORLD_OF_ONE = tuple(name for name, spec in SPECS.items() if spec.world_of_one_probe)
# on a GPU the first steps pick cuDNN algorithms (and compile, with --compile), and a loop that
# does not synchronise every step only shows the GPU's pace once the launch queue is full:
# 20 to 100 steps, about 0.3 s, of which train's own summary (the median after its warm-up
# steps) is what ``partrain train`` reports and what the serial prediction is there
CUDA_TARGET_S, CUDA_MIN_STEPS, CUDA_MAX_STEPS = 0.3, 20, 100


def cuda_steps(step_s: float) -> int:
    """Measured steps of a GPU loop for a step of about ``step_s``."""
    return min(CUDA_MAX_STEPS, max(CUDA_MIN_STEPS, round(CUDA_TARGET_S / max(step_s, 1e-9))))


def cuda_probe(args: dict) -> dict:
    """The probe's figures on a GPU, from the CUDA caching allocator and partrain's own loop.

    "rss"/"peak": bytes allocated for the model's parameters and buffers on the device;
    "train_peaks"/"train_peaks_reserved": ``max_memory_allocated``/``max_memory_reserved`` of
    a serial run (``train.train_worker``) at each batch size, ascending, counted from a reset
    (what ``partrain train`` reports: data placed on the device included); "loop": its step
    time at each batch size; "world_of_one": per strategy at the smallest batch (serial is
    the loop's); "replica_wrapper" as on CPU, on the GPU.
    """
    device = torch.device("cuda")
    run = args["run"]
    before = torch.cuda.memory_allocated(device)
    net = place(build_model(args["model"], tuple(args["input_shape"]), args["num_classes"], **args["options"]), device,
                run["channels_last"])
    baseline = torch.cuda.memory_allocated(device) - before
    del net
    steps = cuda_steps(args["step_s"])
    out = {"rss": baseline, "peak": baseline, "train_peaks": [], "train_peaks_reserved": [], "loop": [],
           "world_of_one": {}, "replica_wrapper": 0.0}
    for b in sorted(args["batch_sizes"]):
        phase(f"profile {args['model']}", f"serial loop at batch {b}, {steps} steps")
        ran = _cuda_run(args, "serial", b, steps, device)
        out["train_peaks"].append(ran["allocated"])
        out["train_peaks_reserved"].append(ran["reserved"])
        out["loop"].append(ran["step_s"])
    if args["world_of_one_steps"]:
        batch = min(args["batch_sizes"])
        out["world_of_one"] = {"serial": out["loop"][0]}
        for strategy in (s for s in WORLD_OF_ONE if s != "serial"):  # serial's is the loop's
            phase(f"profile {args['model']}", f"{strategy} on a world of one at batch {batch}")
            try:
                out["world_of_one"][strategy] = _cuda_run(args, strategy, batch, steps, device)["step_s"]
            except PartrainError:  # e.g. a hybrid of a model no pipeline can cut: not measured, as on a CPU
                continue
        train_set = load_dataset(args["dataset"], "train", data_dir=args["data_dir"], synthetic=args["synthetic"])
        x, y = train_set.get(torch.arange(batch) % len(train_set))
        phase(f"profile {args['model']}", "a hybrid's replica wrapper")
        out["replica_wrapper"] = _time_replica_wrapper(args, x, y, max(2, steps // 2))
    return out


def _cuda_run(args: dict, strategy: str, batch: int, steps: int, device: torch.device) -> dict:
    """One short run of partrain's loop on a world of one: its step time as ``train`` reports
    it (``RunResult.summary``: the median after the warm-up steps) and the allocator's peaks
    since a reset (the previous run's memory given back first)."""
    from partrain.config import RunConfig
    from partrain.train import train_worker

    gc.collect()
    # cuBLAS keeps its workspaces in the caching allocator once a matmul ran: a fresh ``train``
    # allocates them in its first step (64 MiB on an H200), and so must this run
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    # what this process holds already (the profiler's own tensors, cached compiled code) is
    # not the run's: a fresh ``partrain train`` starts from nothing
    held, held_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    run = args["run"]
    cfg = RunConfig(model=args["model"], dataset=args["dataset"], data_dir=args["data_dir"], synthetic=args["synthetic"],
                    model_options=args["options"], batch_size=batch, steps=steps, evaluate=False,
                    threads=args["threads"], workers=1, strategy=strategy, precision=run["precision"],
                    channels_last=run["channels_last"], compile=run["compile"])
    result = train_worker(cfg, LaunchInfo("none"), show_progress=False)
    return {"step_s": result.summary()["seconds_per_step"], "allocated": result.peak_memory_bytes - held,
            "reserved": torch.cuda.max_memory_reserved(device) - held_reserved}
# the first step is left out (the median shrugs off a second slow one); the measured ones take
# about 0.1 s: 2 steps of a big model, up to 64 of a millisecond one, whose overheads are small
# differences of short steps that a burst of other work can swamp in a few samples
WORLD_OF_ONE_WARMUP, WORLD_OF_ONE_TARGET_S, WORLD_OF_ONE_MAX_STEPS = 1, 0.1, 64
WORLD_OF_ONE_ROUNDS = 3  # turns the strategies take, each round's steps a third of them
# the bare loop's pairs: about 0.15 s of each larger size's step over the whole probe (at least one
# pair a round), spread over its rounds: before the world-of-one runs, after each of theirs, at the end
BARE_LOOP_TARGET_S, BARE_LOOP_ROUNDS = 0.15, WORLD_OF_ONE_ROUNDS + 2


def world_of_one_steps(step_s: float) -> int:
    """Measured steps per strategy for a serial step of about ``step_s``: 2 to 64."""
    return min(WORLD_OF_ONE_MAX_STEPS, max(2, round(WORLD_OF_ONE_TARGET_S / max(step_s, 1e-9))))


def _time_world_of_one(args: dict, between_rounds: Callable[[], float] = lambda: 1.0) -> dict[str, float]:
    """Step time of partrain's own training loop (``train.train_worker``, as a benchmark cell runs
    it) on a world of one, per strategy in ``WORLD_OF_ONE``, at the smallest profiled batch size,
    as a multiple of the machine's pace: what each strategy's machinery costs beyond the serial
    loop, which the blocks' times cannot show. Runs in the probe process, after the memory
    figures were taken.

    The strategies take turns over up to ``WORLD_OF_ONE_ROUNDS`` rounds that share the steps, and
    each keeps the median of its rounds (of each round, the lower of its halves' medians): a burst
    of other work spoils one round, not the figure. With one pass of about 0.1 s per strategy, one
    profile of the traced gallery model read DDP at 1.62 ms over the serial loop at batch 4, where
    four others read 0.34-0.40 ms.

    A round takes about half a second, and a spell of the host (``profile.pace``) lasts one to four:
    ``between_rounds`` is called before the first round and after each, and returns a window of the
    machine's pace then (the bare step's seconds); each round's step times count as multiples of the
    median of the windows either side of it and of all the windows. Issue 17's run87u took the
    tokens3d and traced gallery models' profiles with two of the three rounds in a spell (the
    windows after them 1.5x the rest in one, 1.8-1.9x in the other): the rounds' median read their
    serial loop at 1.56x and 1.73x the bare step it is (0.97-1.06x in twenty other profiles), and
    the one-worker cells 42-68% over. The default (no windows): the rounds' step times as they are."""
    from partrain.config import RunConfig
    from partrain.train import train_worker

    batch, steps = min(args["batch_sizes"]), args["world_of_one_steps"]
    rounds = max(1, min(WORLD_OF_ONE_ROUNDS, steps // 2))
    base = dict(model=args["model"], dataset=args["dataset"], data_dir=args["data_dir"], synthetic=args["synthetic"],
                model_options=args["options"], batch_size=batch, steps=WORLD_OF_ONE_WARMUP + steps // rounds,
                evaluate=False, threads=args["threads"], workers=1,
                **{k: args["run"][k] for k in ("precision", "channels_last", "compile")})
    medians: dict[str, list[float]] = {strategy: [] for strategy in WORLD_OF_ONE}
    windows = [between_rounds()]
    for _ in range(rounds):
        for strategy in list(medians):  # WORLD_OF_ONE's order, less those that could not run
            try:
                result = train_worker(RunConfig(strategy=strategy, **base), LaunchInfo("none"), show_progress=False)
            except PartrainError:  # e.g. a hybrid of a model no pipeline can cut, or a batch 2 micro-batches cannot split
                if strategy == "serial":
                    raise
                del medians[strategy]  # not measured: the predictor counts no overhead for it
                continue
            medians[strategy].append(lower_half_median(result.step_seconds[WORLD_OF_ONE_WARMUP:]))
        windows.append(between_rounds())
    torch.set_num_threads(args["threads"])
    # a round's pace: the median of the windows either side of it and the windows' median, so
    # that a spell counts where both windows saw it, not where one 30 ms window caught a short one
    # (run90u: tokens3d's window after round two 1.64x the rest, its rounds not: the mean of the
    # two read the loop at 0.75x the bare step)
    typical = statistics.median(windows)
    pace = [statistics.median([before, after, typical]) for before, after in zip(windows, windows[1:])]
    return {strategy: statistics.median(t / p for t, p in zip(times, pace)) for strategy, times in medians.items()}


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

    run = args["run"]
    device = torch.device(run["device"])
    # contiguous weights, NHWC batches: FSDP shards contiguous parameters only, and the replica
    # wrapper puts them back so under --channels-last (strategies.pipeline)
    net = place(build_model(args["model"], tuple(args["input_shape"]), args["num_classes"], **args["options"]), device,
                channels_last=False)
    if scalar_parameter(net) is not None:
        return 0.0  # fully_shard cannot wrap a scalar parameter: a hybrid with replicas refuses this model
    x, y, mesh = place_input(x, device, run["channels_last"]), y.to(device), None
    init_process_group(LaunchInfo("none"), "nccl" if device.type == "cuda" else "gloo", timeout_s=300.0)
    try:
        bare = _loop_step_s(net, x, y, steps, device, run["precision"])
        mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "shard"))
        fully_shard(net, mesh=mesh, reshard_after_forward=False)
        return max(0.0, _loop_step_s(net, x, y, steps, device, run["precision"]) - bare)
    finally:
        # the wrapped module holds the mesh, which holds the group: free them before the group
        # goes (see train.train_worker)
        net = mesh = None
        leave_process_group()


def _loop_step_s(net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device,
                 precision: str) -> float:
    """A plain SGD-momentum training step of ``net`` on (x, y): the lower of its halves' medians
    over ``steps`` steps after the warm-up (a fresh optimizer: ``fully_shard`` replaces the
    parameters), timed on ``device`` (``Stopwatch``) at ``precision``."""
    opt = still_sgd(net)
    samples, watch = [], Stopwatch(device)
    for _ in range(WORLD_OF_ONE_WARMUP + steps):
        watch.start()
        opt.zero_grad(set_to_none=True)
        with autocast(device, precision):
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        samples.append(watch.laps()[0])
    return lower_half_median(samples[WORLD_OF_ONE_WARMUP:])


def measure_memory(model: str, dataset: str, input_shape, num_classes: int, batch_sizes: list[int], threads: int,
                   data_dir, synthetic: bool, options: dict, world_of_one_steps: int = 0, run: dict | None = None,
                   step_s: float = 0.0) -> dict:
    """``baseline_probe``'s figures: {"rss", "peak", "train_peaks" (one per batch size),
    "bare_loop" (one per batch size), "world_of_one" (step per strategy, the lower of its halves' medians, over
    ``world_of_one_steps`` steps after warm-up; not measured when 0), "replica_wrapper" (``_time_replica_wrapper``;
    0 when not measured), "pace" (``profile.pace``: the windows of the bare step taken around them)}; on a GPU
    (``run["device"] == "cuda"``) ``cuda_probe``'s, whose loops are sized for a step of about ``step_s``."""
    run = run or {"device": "cpu", "precision": "fp32", "channels_last": False, "compile": False}
    args = {"model": model, "dataset": dataset, "input_shape": list(input_shape), "num_classes": num_classes,
            "batch_sizes": batch_sizes, "threads": threads, "data_dir": None if data_dir is None else str(data_dir),
            "synthetic": synthetic, "options": options, "world_of_one_steps": world_of_one_steps, "run": run,
            "step_s": step_s}
    if run["device"] == "cuda":
        # the allocator's peaks can be reset and counted from what is held now, so the GPU's
        # figures need no fresh process: this one saves its start (importing torch with CUDA
        # and a second CUDA context, seconds of a profile a small model's runs take seconds for)
        gc.collect()
        gc.freeze()  # the world-of-one runs' full collections walk only their own objects (see baseline_probe)
        try:
            with reused_splits():
                return cuda_probe(args)
        finally:
            gc.unfreeze()
    proc = subprocess.run([*python_command(), "-c", "from partrain.profile.probe import baseline_probe; baseline_probe()",
                           json.dumps(args)], capture_output=True, text=True, env=child_env(), timeout=600)
    if proc.returncode != 0:
        raise PartrainError(f"measuring the baseline memory failed: {_exception_line(proc.stderr, proc.returncode)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _exception_line(stderr: str, status: int) -> str:
    """What a failed child said: its exception's line, not the last line of a message that runs
    on (DDP's end with a hint on an environment variable), else its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    said = next((m.group(0) for line in reversed(lines) if (m := re.search(r"\b[\w.]+(Error|Exception): .*", line))), None)
    return said or (lines[-1] if lines else f"exit status {status}")
