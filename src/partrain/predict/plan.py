"""A plan: one way to run a training job, what ``partrain train`` would be told; and the
candidate plans for a worker count and batch, valid or not (``check_plan`` says why not).

    plans = enumerate_plans(profile, workers=4, batch_size=64)
    plan.label(), plan.to_config(model, dataset), plan.cli_args()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from partrain.config import RunConfig, to_argv
from partrain.errors import PartrainError
from partrain.predict.cut import pipeline_refusal, untraced_refusal
from partrain.predict.profiles import HardwareProfile, ModelProfile
from partrain.spec import OPTIONS, SPECS, StrategySpec, fully_sharded, scalar_refusal, threads_per_worker

MB = 2**20  # DDP's bucket_cap_mb is in MiB (torch.nn.parallel.distributed._MB_TO_BYTES)


@dataclass(frozen=True)
class Plan:
    """One way to run a training job: what ``partrain train`` would be told."""

    strategy: str
    workers: int
    batch_size: int  # global, summed over data-parallel replicas
    pp: int = 1
    dp: int = 1
    microbatches: int = 1
    schedule: str | None = None  # pipelines: gpipe | 1f1b | interleaved-1f1b
    stages_per_worker: int = 1
    bucket_mb: float = 25.0
    average_every: int | str = 1
    recompute: bool = False
    optimizer: str = "sgd"
    momentum: float = 0.9
    threads: int | None = None
    split_points: tuple[int, ...] | None = None
    # numerics and speed options: a plan is predicted from a profile taken with the same ones
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig, split_points: list[int] | None = None) -> Plan:
        dims = cfg.dims
        return cls(
            strategy=cfg.strategy, workers=cfg.workers, batch_size=cfg.batch_size, pp=dims.pp, dp=dims.dp,
            microbatches=cfg.num_microbatches, schedule=cfg.pipeline_schedule, stages_per_worker=cfg.stages_per_worker,
            bucket_mb=cfg.bucket_mb, average_every=cfg.average_every, recompute=cfg.recompute, optimizer=cfg.optimizer,
            momentum=cfg.momentum, threads=cfg.threads,
            split_points=tuple(split_points or cfg.split_points or ()) or None,
            precision=cfg.precision, channels_last=cfg.channels_last, compile=cfg.compile,
        )

    @property
    def spec(self) -> StrategySpec:
        return SPECS[self.strategy]

    @property
    def kind(self) -> str:
        return self.spec.family

    def cli_args(self) -> list[str]:
        """The ``partrain train`` arguments that run this plan (``config.to_argv``; printed even
        for a plan that cannot run, with the reason)."""
        fields = {k: v for k, v in self._config_fields("", "").items() if k not in ("model", "dataset")}
        return to_argv(fields, always=("strategy", "workers", "batch_size"))

    def to_config(self, model: str, dataset: str, **extra) -> RunConfig:
        """The validated ``RunConfig`` (raises ``PartrainError`` naming what is wrong)."""
        return RunConfig(**self._config_fields(model, dataset), **extra)

    def _config_fields(self, model: str, dataset: str) -> dict:
        hybrid, piped = self.kind == "hybrid", self.spec.micro_batched
        return dict(
            model=model, dataset=dataset, strategy=self.strategy, workers=self.workers, batch_size=self.batch_size,
            pp=self.pp if hybrid else None, dp=self.dp if hybrid else None,
            microbatches=self.microbatches if piped else None, schedule=self.schedule if piped else None,
            stages_per_worker=self.stages_per_worker, bucket_mb=self.bucket_mb, average_every=self.average_every,
            recompute=self.recompute, optimizer=self.optimizer, momentum=self.momentum if self.optimizer == "sgd" else 0.9,
            threads=self.threads, split_points=list(self.split_points) if self.split_points else None,
            precision=self.precision, channels_last=self.channels_last, compile=self.compile,
        )

    def batch_sizes(self) -> tuple[float, float]:
        """The batch sizes a prediction evaluates: one worker's rows, and its micro-batch."""
        rows = self.batch_size / self.dp
        return rows, rows / self.microbatches

    def as_run(self) -> Plan:
        """The plan as the runtime executes it: a hybrid of one replica is its pipeline alone
        (``strategies.pipeline`` replicates the stages only where dp > 1), the same run as the
        pipeline strategy of its schedule; any other plan is itself."""
        if self.kind == "hybrid" and self.dp == 1:
            return replace(self, strategy="gpipe" if self.schedule == "gpipe" else "1f1b")
        return self

    def label(self) -> str:
        """A short name for tables: strategy and the parameters that matter."""
        parts = [self.strategy]
        if self.kind == "hybrid":
            parts.append(f"pp{self.pp}xdp{self.dp}")
        if self.spec.micro_batched:
            sched = self.schedule if self.stages_per_worker == 1 else f"{self.schedule} v{self.stages_per_worker}"
            parts.append(f"{sched} M={self.microbatches}" if self.kind == "hybrid" or sched != self.strategy else f"M={self.microbatches}")
        parts += [OPTIONS[option][1](getattr(self, option)) for option in self.spec.options]
        if self.recompute:
            parts.append("recompute")
        parts += [self.precision] if self.precision != "fp32" else []
        parts += ["channels-last"] if self.channels_last else []
        parts += ["compiled"] if self.compile else []
        return " ".join(parts)


def profile_batch_sizes(needed) -> list[int]:
    """Batch sizes to profile so that every size in ``needed`` is interpolated, not extrapolated:
    from the power of two at or below the smallest, by factors of four, up to the largest."""
    lo, hi = min(needed), max(needed)
    size = 2 ** max(0, math.floor(math.log2(max(1.0, lo))))
    sizes = []
    while size < hi:
        sizes.append(size)
        size *= 4
    return sorted({*sizes, math.ceil(hi)})


def local_workers(plan_workers: int, hardware: HardwareProfile) -> int:
    """Workers per node: ranks fill nodes in order, as torchrun, mpirun and srun place them."""
    return plan_workers if hardware.nodes <= 1 else min(plan_workers, hardware.workers_per_node)


def threads_for(plan_workers: int, hardware: HardwareProfile, threads: int | None = None) -> int:
    """The intra-op threads a plan's workers get on ``hardware``: what ``partrain train`` gives them."""
    return threads_per_worker(hardware.cores_per_node, local_workers(plan_workers, hardware), threads)


def check_plan(profile: ModelProfile, plan: Plan, hardware: HardwareProfile | None = None) -> str | None:
    """Why ``plan`` cannot run (one line), or None when it can; on ``hardware`` when given."""
    try:
        cfg = plan.to_config(profile.model, profile.dataset)
    except PartrainError as err:
        return str(err)
    if reason := untraced_refusal(profile.model, len(profile.blocks), cfg.dims.pp * cfg.stages_per_worker):
        return reason
    if reason := pipeline_refusal(cfg, len(profile.blocks)):
        return reason
    if profile.scalar_parameter and fully_sharded(plan.strategy, plan.dp):
        return scalar_refusal(profile.model, profile.scalar_parameter, plan.strategy)
    if plan.batch_size > profile.train_samples:
        return f"batch {plan.batch_size} exceeds the {profile.train_samples} training samples"
    if hardware is not None:
        return plan.spec.refusal(plan.workers, local_workers(plan.workers, hardware), hardware.backend)
    return None


# the recommender's order: data-parallel plans, then pipelines by micro-batches, then hybrids
_FAMILY_ORDER = {"serial": 0, "data": 0, "shared": 0, "pipeline": 1, "hybrid": 2}


def candidate_plans(workers: int, batch_size: int, optimizer: str = "sgd", momentum: float = 0.9,
                    threads: int | None = None, run_options: dict | None = None) -> list[Plan]:
    """Every strategy's variants (``StrategySpec.variants``) for ``workers`` and global
    ``batch_size``, valid or not (``check_plan`` says which cannot run), with ``run_options``
    (precision, channels_last, compile: ``ModelProfile.run_options``) as asked, never others."""
    common = dict(workers=workers, batch_size=batch_size, optimizer=optimizer, momentum=momentum, threads=threads,
                  **(run_options or {}))
    plans = [Plan(name, **variant, **common) for name, spec in SPECS.items() for variant in spec.variants(workers)]
    return sorted(plans, key=lambda p: (_FAMILY_ORDER[p.kind], p.microbatches if p.kind == "pipeline" else 0))


def enumerate_plans(profile: ModelProfile, workers: int, batch_size: int, optimizer: str = "sgd", momentum: float = 0.9,
                    threads: int | None = None, with_invalid: bool = False,
                    hardware: HardwareProfile | None = None) -> list[Plan] | list[tuple[Plan, str | None]]:
    """The candidate plans that can run this model (on ``hardware`` when given), or with
    ``with_invalid`` every candidate with the reason it cannot (None when it can). Small
    gradient buckets are left out when the gradients fit one of them anyway."""
    candidates = [
        plan for plan in candidate_plans(workers, batch_size, optimizer, momentum, threads, profile.run_options())
        if not ("bucket_mb" in plan.spec.options and plan.bucket_mb < 25 and profile.param_bytes <= plan.bucket_mb * MB)
    ]
    checked = [(plan, check_plan(profile, plan, hardware)) for plan in candidates]
    return checked if with_invalid else [plan for plan, reason in checked if reason is None]
