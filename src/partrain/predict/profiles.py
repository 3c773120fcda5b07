"""The profiles the predictor reads, as plain dataclasses and their JSON.

A ``ModelProfile`` is what one worker measured about a model, block by block and per batch
size; a ``HardwareProfile`` what the predictor knows about the machines: nodes, workers,
memory, and fitted collective costs per link tier. ``profile/`` measures them with torch
and writes them; this module and ``profile_json`` only read and write JSON, so the cost
model never loads torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

from partrain.predict.fits import COLLECTIVES, CostFit, held_interpolation
from partrain.predict.methods import MEASUREMENT, MODEL_MEASUREMENT
from partrain.predict.profile_json import JsonProfile, check_fields


class PipelineRuntime(NamedTuple):
    """What ``torch.distributed.pipelining`` costs beyond the stages' compute, fitted to the
    hardware profile's probe (``profile.pipeline_fits.fit_pipeline_runtime``)."""

    step_s: float  # once per step (splitting the batch, merging losses, waking the stages)
    hop_s: float | None  # one message between stages, the probe's link time included; None: no probe
    probe_ranks: tuple[int, int]  # the global ranks the probe's messages went between
    # True: timed on every worker at once, so step_s already holds their sharing of the cores
    side_by_side: bool


@dataclass
class HardwareProfile(JsonProfile):
    """What the predictor knows about the hardware a job runs on."""

    kind = "hardware profile"

    fingerprint: str
    description: str
    backend: str
    nodes: int
    workers_per_node: int
    cores_per_node: int  # CPU contention: more busy threads than this slows every worker
    device_memory_bytes: int  # per GPU; on CPU, the host RAM that a node's workers share
    shared_memory: bool  # True on CPU: a node's workers share device_memory_bytes
    compute_speed: float = 1.0  # relative to the machine that measured the model profile
    links: dict[str, CostFit] = field(default_factory=dict)  # tier -> point-to-point fit
    collectives: dict[str, dict[int, dict[str, CostFit]]] = field(default_factory=dict)  # tier -> group size -> name -> fit
    process_group_rss_bytes: int = 0  # resident memory a worker gains by joining the process group
    pipeline_action_s: float = 0.0  # what the pipelining runtime adds to each micro-batch forward or backward
    pipeline_step_s: float = 0.0  # what it adds once per step (splitting the batch, merging losses)
    pipeline_hop_s: float | None = None  # latency of one message between stages inside the runtime
    # (pipeline_step_s, pipeline_hop_s) of 2-stage pipelines on every worker at once, as a hybrid's
    # replicas run (``runtime_of``); None where not measured (fewer than 4 workers, a cluster file)
    pipeline_side_by_side: tuple[float, float] | None = None
    # k busy workers on a node -> their compute time over one worker's alone (measured; else k / cores)
    compute_sharing: dict[int, float] = field(default_factory=dict)
    # k workers -> what one synchronisation after computing costs beyond a collective between busy ranks
    sync_s: dict[int, float] = field(default_factory=dict)
    source: str = "measured"
    notes: list[str] = field(default_factory=list)
    points: dict = field(default_factory=dict)  # raw: tier -> group size -> name -> [[bytes, s]]; "pipeline": the probe
    method: int = MEASUREMENT  # the MEASUREMENT that took it (files without one: 1)
    other_load: float = 0.0  # share of the machine's CPU other processes used while it was measured
    # nodes that share one machine's cores (emulated nodes): how many cores all of them share, so that
    # compute contends machine-wide, busy workers of every node against these; 0: each node has its own
    shared_cores: int = 0
    # (pipeline_step_s, pipeline_hop_s) of one pipeline with a stage on every worker (``runtime_of``);
    # None where not measured (fewer than 3 workers, a cluster file)
    pipeline_world: tuple[float, float] | None = None
    # each probe's (seconds of a stage's action, pipeline_hop_s) as its stages compute more, the first
    # its own; empty where not measured (``profile.pipeline_fits.fit_loaded``)
    pipeline_world_loaded: tuple[tuple[float, float], ...] = ()
    pipeline_side_by_side_loaded: tuple[tuple[float, float], ...] = ()
    # how much later a worker waiting for a pipeline message wakes when the message's sender goes on
    # computing (at most until the sender waits): ``pipeline_sim.simulate``'s ``busy_sender_s``,
    # fitted to GPipe's excess over 1F1B in the two-stage probe over loaded stages
    # (``profile.pipeline_fits.fit_busy_sender``; to their step times before MEASUREMENT 27); 0 where
    # not measured (a GPU's host does not compute, a cluster file, a profile before MEASUREMENT 16)
    busy_sender_s: float = 0.0
    # k workers -> the compute each ran side by side before the synchronisation ``sync_s`` timed:
    # a step that computes less between synchronisations pays that share of it (``Env.sync_after``);
    # empty where not recorded (a cluster file, a profile before it was kept): the whole ``sync_s``
    sync_compute_s: dict[int, float] = field(default_factory=dict)
    # k workers -> bytes -> what a synchronous allreduce of that many bytes cost a step after they
    # computed side by side: ((seconds of compute, excess seconds), ...) by compute
    # (``profile.step_probes.measure_step_sync``; ``Env.sync_after``); empty where not measured (a GPU,
    # a cluster file, a profile before MEASUREMENT 25 for more workers than cores: ``sync_s``). A k
    # beyond workers_per_node is the whole world across the nodes, measured where each node's
    # workers have a core each
    step_sync: dict[int, dict[int, tuple[tuple[float, float], ...]]] = field(default_factory=dict)
    # the CPU a stage's worker spends on each message it sends or receives between stages (posting
    # it, waiting on it: ``profile.pipeline_fits.fit_message_cpu``), on top of ``pipeline_action_s``;
    # 0 where not measured (a GPU, a cluster file, a profile before MEASUREMENT 26)
    pipeline_message_cpu_s: float = 0.0

    @property
    def stale(self) -> bool:
        """Measured by an earlier method than this partrain's (``MEASUREMENT``)."""
        return self.source.startswith("measured") and self.method < MEASUREMENT  # "measured across 2 emulated nodes ..." too

    def runtime_of(self, replicas: int, stages: int = 2, action_s: float | None = None) -> PipelineRuntime:
        """The pipelining runtime's costs for a plan with ``replicas`` pipelines of ``stages`` ranks
        side by side, whose stages' actions take ``action_s`` each on average (alone).

        A single pipeline with a stage on every worker of the profile takes the probe run that
        way (``pipeline_world``): the probe beside busy workers put 7.1 ms a step and 0.48 ms a
        message on 4-stage pipelines over 4 workers on 2 cores, whose steps of small models were
        then predicted 40-90% over their measure (issue 17's run51).

        One pipeline is timed by the probe on ranks 0 and 1 while the others keep a core busy.
        Replicas' pipelines pass messages at once, and where the workers outnumber the cores
        every hop waits for one: 2-stage 1F1B over 4 micro-batches read 15.4-16.0 ms a step as
        two pipelines on 4 workers on 2 cores, 4.7-9.1 ms as one beside two busy workers (issue
        18: the mlp's pp2 x dp2 was 30-50% under). Where that was measured
        (``pipeline_side_by_side``), replicas take it.

        Either probe's message costs what it cost over stages that computed as long as the
        plan's (``*_loaded``, held at its ends), where that was measured and ``action_s`` given."""
        def probed(fitted: tuple[float, float], loaded, ranks) -> PipelineRuntime:
            hop = held_interpolation(loaded, action_s) if loaded and action_s is not None else fitted[1]
            return PipelineRuntime(fitted[0], hop, tuple(ranks), side_by_side=True)

        if replicas == 1 and stages == self.nodes * self.workers_per_node and self.pipeline_world is not None:
            return probed(self.pipeline_world, self.pipeline_world_loaded, (0, 1))
        if replicas > 1 and self.pipeline_side_by_side is not None:
            ranks = (self.points or {}).get("pipeline_side_by_side", {}).get("ranks", (0, 1))
            return probed(self.pipeline_side_by_side, self.pipeline_side_by_side_loaded, ranks)
        return PipelineRuntime(self.pipeline_step_s, self.pipeline_hop_s, (0, 1), side_by_side=False)

    def link_rate(self, tier: str) -> float | None:
        """The ``tier``'s link rate in bytes per second: the marginal rate of send/recv between
        its two largest messages (the latency cancels out), timed with the link alone
        (``measure_link_alone``; profiles from before it: the sweep's own send/recv). None where
        it was not measured; NaN where the larger message took no longer (messages that small
        pass in a token-bucket shaper's burst)."""
        points = (self.points or {}).get("link_alone", {}).get(tier) or self.sendrecv_points(tier)
        if len(points) < 2:
            return None
        (b1, t1), (b2, t2) = sorted(points)[-2:]
        return (b2 - b1) / (t2 - t1) if t2 > t1 else math.nan

    def sendrecv_points(self, tier: str) -> list[list[float]]:
        """The ``tier``'s send/recv sweep as measured, [bytes, one-way seconds] by size (between
        nodes, the group over every node); empty where it was not measured (a cluster file)."""
        by_size = (self.points or {}).get(tier, {})
        group = by_size.get(str(self.nodes), {}) if tier == "inter" else next(iter(by_size.values()), {})
        return sorted(group.get("sendrecv") or [])

    def memory_limit_per_worker(self, local_workers: int) -> int:
        return self.device_memory_bytes // max(1, local_workers) if self.shared_memory else self.device_memory_bytes

    def to_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint, "description": self.description, "backend": self.backend,
            "nodes": self.nodes, "workers_per_node": self.workers_per_node, "cores_per_node": self.cores_per_node,
            "device_memory_bytes": self.device_memory_bytes, "shared_memory": self.shared_memory,
            "compute_speed": self.compute_speed,
            "links": {tier: fit.to_dict() for tier, fit in self.links.items()},
            "collectives": {
                tier: {str(p): {name: fit.to_dict() for name, fit in fits.items()} for p, fits in sizes.items()}
                for tier, sizes in self.collectives.items()
            },
            "process_group_rss_bytes": self.process_group_rss_bytes, "pipeline_action_s": self.pipeline_action_s,
            "pipeline_step_s": self.pipeline_step_s, "pipeline_hop_s": self.pipeline_hop_s,
            "pipeline_side_by_side": list(self.pipeline_side_by_side) if self.pipeline_side_by_side else None,
            "compute_sharing": {str(k): v for k, v in self.compute_sharing.items()},
            "sync_s": {str(k): v for k, v in self.sync_s.items()}, "source": self.source,
            "notes": self.notes, "points": self.points, "method": self.method, "other_load": self.other_load,
            "shared_cores": self.shared_cores,
            "pipeline_world": list(self.pipeline_world) if self.pipeline_world else None,
            "pipeline_world_loaded": [list(p) for p in self.pipeline_world_loaded],
            "pipeline_side_by_side_loaded": [list(p) for p in self.pipeline_side_by_side_loaded],
            "busy_sender_s": self.busy_sender_s,
            "sync_compute_s": {str(k): v for k, v in self.sync_compute_s.items()},
            "step_sync": {str(k): {str(n): [list(p) for p in points] for n, points in by_size.items()}
                          for k, by_size in self.step_sync.items()},
            "pipeline_message_cpu_s": self.pipeline_message_cpu_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> HardwareProfile:
        return cls(
            d["fingerprint"], d["description"], d["backend"], int(d["nodes"]), int(d["workers_per_node"]),
            int(d["cores_per_node"]), int(d["device_memory_bytes"]), bool(d["shared_memory"]), float(d["compute_speed"]),
            {tier: CostFit.from_dict(rows) for tier, rows in d["links"].items()},
            {
                tier: {int(p): {name: CostFit.from_dict(rows) for name, rows in fits.items() if name in COLLECTIVES}
                       for p, fits in sizes.items()}
                for tier, sizes in d["collectives"].items()
            },
            int(d.get("process_group_rss_bytes", 0)), float(d.get("pipeline_action_s", 0.0)),
            float(d.get("pipeline_step_s", 0.0)), d.get("pipeline_hop_s"),
            tuple(map(float, d["pipeline_side_by_side"])) if d.get("pipeline_side_by_side") else None,
            {int(k): float(v) for k, v in d.get("compute_sharing", {}).items()},
            {int(k): float(v) for k, v in d.get("sync_s", {}).items()},
            d.get("source", "measured"), list(d.get("notes", [])), d.get("points", {}), int(d.get("method", 1)),
            float(d.get("other_load", 0.0)), int(d.get("shared_cores", 0)),
            tuple(map(float, d["pipeline_world"])) if d.get("pipeline_world") else None,
            tuple(tuple(map(float, p)) for p in d.get("pipeline_world_loaded", ())),
            tuple(tuple(map(float, p)) for p in d.get("pipeline_side_by_side_loaded", ())),
            float(d.get("busy_sender_s", 0.0)),
            {int(k): float(v) for k, v in d.get("sync_compute_s", {}).items()},
            _step_sync(d),
            float(d.get("pipeline_message_cpu_s", 0.0)),
        )


def _step_sync(d: dict) -> dict[int, dict[int, tuple[tuple[float, float], ...]]]:
    """``step_sync`` of a profile's dict: ``{k: {bytes: points}}``, or (MEASUREMENT 19-22) one size
    for every k, ``{k: points}`` beside ``step_sync_bytes``."""
    def points(rows) -> tuple[tuple[float, float], ...]:
        return tuple(tuple(map(float, p)) for p in rows)

    one_size = int(d.get("step_sync_bytes", 0))
    return {int(k): ({int(n): points(rows) for n, rows in by_size.items()} if isinstance(by_size, dict)
                     else {one_size: points(by_size)})
            for k, by_size in d.get("step_sync", {}).items()}


@dataclass
class BlockProfile:
    """One block; list fields hold one value per ``ModelProfile.batch_sizes`` entry."""

    name: str
    params: int
    param_bytes: int
    param_tensors: int
    buffer_bytes: int
    fwd_s: list[float]
    bwd_s: list[float]
    out_bytes: list[int]  # the block's output: what a pipeline stage boundary sends
    saved_bytes: list[int]  # kept by autograd for backward, without parameters and the block's input
    saves_input: bool  # backward also keeps the block's input
    saves_output: bool  # saved_bytes includes the block's own output
    flops: list[int]  # forward + backward
    optimizer_s: dict[str, float]  # one optimizer step over this block's parameters alone
    # forward and backward each started with the core's caches written over (``timing.evict_caches``),
    # as a pipeline stage's actions run where the node's workers outnumber its cores; empty where
    # not measured (a GPU, a profile before MODEL_MEASUREMENT 4)
    fwd_cold_s: list[float] = field(default_factory=list)
    bwd_cold_s: list[float] = field(default_factory=list)
    out_tensors: int = 1  # tensors in the output (a tuple's): a stage boundary sends each on its own
    out_floats: int = 1  # of them floating point: the gradients the next stage sends back


@dataclass
class ModelProfile(JsonProfile):
    kind = "model profile"

    model: str
    dataset: str
    synthetic: bool
    batch_sizes: list[int]
    threads: int
    fingerprint: str
    input_shape: list[int]
    input_bytes: int  # one sample at its own element size (int64 token ids: 8 bytes each)
    train_samples: int  # samples in the train split as loaded (an epoch's worth)
    blocks: list[BlockProfile]
    loss_s: list[float]  # cross-entropy forward + backward
    data_s: list[float]  # loading one batch from the in-memory dataset
    optimizer_s: dict[str, float]  # one step over all parameters, per optimizer
    baseline_rss_bytes: int  # resident set of a fresh worker-like process: torch, data, model
    baseline_peak_rss_bytes: int  # its peak (loading data may peak above what stays)
    train_peak_rss_bytes: list[int]  # the same process's peak after serial SGD-momentum steps at each batch size
    # what a hybrid's fully_shard replica wrapper adds to a step of the whole model on a world of one
    # (required: a profile from before it was measured is measured again)
    replica_wrapper_s: float
    profile_seconds: float = 0.0
    other_load: float = 0.0  # share of the machine's CPU other processes used while profiling
    options: dict = field(default_factory=dict)
    world_of_one_s: dict[str, float] = field(default_factory=dict)  # step of partrain's training loop, per strategy
    world_of_one_batch: int = 0  # the batch size world_of_one_s ran at
    # what the profile ran on and with (profile.numerics): a prediction is made only from a
    # profile at the precision and options the plan runs with, on the device it runs on
    device: str = "cpu"  # "cpu", or the GPU's name (torch.cuda.get_device_name)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast)
    channels_last: bool = False
    compile: bool = False
    # on a GPU the memory figures above are the CUDA caching allocator's (allocated bytes, what
    # train reports as its peak); these are its reserved peaks, one per batch size
    train_peak_reserved_bytes: list[int] = field(default_factory=list)
    # partrain's serial training loop, seconds per step at each batch size as train reports it
    # (the median after warm-up): on a GPU run for the allocator peaks anyway; on a CPU its
    # world-of-one step grown as the memory probe's bare loop grows (profile.model._cpu_loop).
    # Empty in a profile from before it was measured (the loop is then the sum of its parts)
    loop_s: list[float] = field(default_factory=list)
    # what the memory probe's time figures (the loop's, world_of_one_s, replica_wrapper_s) were
    # multiplied by, to the machine's pace over the whole profile (profile.pace.probe_pace); 1 on a GPU
    probe_pace: float = 1.0
    # the machine's pace (profile.pace): windows of the bare serial step at the smallest batch size
    # the profile took (its time figures stand at their median), and those ``bench --profile`` took
    # beside the cells after it; predictions read every time figure at the median of both
    # (``pace.at_later_pace``). Empty on a GPU and in profiles from before they were kept
    pace_s: list[float] = field(default_factory=list)
    later_pace_s: list[float] = field(default_factory=list)

    # k workers side by side -> this model's forward + backward time over its time alone, measured
    # by profile.sharing at sharing_batch rows with the profile's threads (empty: not measured;
    # the predictor falls back to the hardware profile's probe)
    compute_sharing: dict[int, float] = field(default_factory=dict)
    sharing_batch: int = 0
    # the model's first 0-dimensional parameter, which fully_shard cannot shard ("": none, or not looked for)
    scalar_parameter: str = ""
    # per batch size, [forward, backward] of every block as one chain (``compute.stage_times``), and what that
    # backward adds summing into gradients already there (``compute.gradient_pass_time``); empty/None: not measured
    chain_s: list[list[float]] = field(default_factory=list)
    accumulate_s: float | None = None
    method: int = MODEL_MEASUREMENT  # the MODEL_MEASUREMENT that took it (files without one: 1)

    @property
    def stale(self) -> bool:
        """Measured by an earlier method than this partrain's (``MODEL_MEASUREMENT``)."""
        return self.method < MODEL_MEASUREMENT

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def run_options(self) -> dict:
        """The options a plan must run with to be predicted from this profile."""
        return {"precision": self.precision, "channels_last": self.channels_last, "compile": self.compile}

    def overhead_s(self, strategy: str) -> float:
        """What ``strategy``'s machinery adds to a step on a world of one, over the serial
        loop (DDP's hooks and bucket copies, the averager's flatten and unflatten, the
        pipelining runtime and replica wrapper); 0 when not measured."""
        ran = self.world_of_one_s
        return max(0.0, ran[strategy] - ran["serial"]) if strategy in ran and "serial" in ran else 0.0

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelProfile:
        check_fields(cls, d, "")
        if not isinstance(d["blocks"], list) or not d["blocks"]:
            raise ValueError("blocks: no block measured")
        for i, b in enumerate(d["blocks"]):
            check_fields(BlockProfile, b, f"blocks.{i}.")
        per_batch = {k: d[k] for k in _PER_BATCH if k in _MEASURED_ALWAYS or d.get(k)} | {
            f"blocks.{i}.{k}": b[k] for i, b in enumerate(d["blocks"]) for k in _BLOCK_PER_BATCH if k in _MEASURED_ALWAYS or b.get(k)}
        for where, values in per_batch.items():  # what the predictor interpolates between batch sizes
            if len(values) != len(d["batch_sizes"]):
                raise ValueError(f"{where} holds {len(values)} values for {len(d['batch_sizes'])} batch sizes")
        if not d["batch_sizes"] or d["batch_sizes"] != sorted(set(d["batch_sizes"])):
            raise ValueError(f"batch_sizes {d['batch_sizes']} are not increasing sizes")
        if any(len(pair) != 2 for pair in d.get("chain_s", [])):
            raise ValueError("chain_s holds an entry that is not [forward, backward]")
        blocks = [BlockProfile(**b) for b in d["blocks"]]
        known = {f.name for f in fields(cls)}  # profiles saved by earlier versions may carry retired keys
        sharing = {int(k): float(v) for k, v in d.get("compute_sharing", {}).items()}  # JSON keys are strings
        return cls(**{"method": 1, **{k: v for k, v in d.items() if k in known}, "blocks": blocks,
                      "compute_sharing": sharing})


# the lists that hold one figure per batch size (empty where not measured), in a profile and in a block
_PER_BATCH = ("loss_s", "data_s", "train_peak_rss_bytes", "train_peak_reserved_bytes", "loop_s", "chain_s")
_MEASURED_ALWAYS = ("loss_s", "data_s", "train_peak_rss_bytes",  # the others are empty where not measured
                    "fwd_s", "bwd_s", "out_bytes", "saved_bytes", "flops")
_BLOCK_PER_BATCH = ("fwd_s", "bwd_s", "out_bytes", "saved_bytes", "flops", "fwd_cold_s", "bwd_cold_s")

