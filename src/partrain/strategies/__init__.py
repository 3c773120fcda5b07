"""One ``parallelize_<name>`` per strategy: a plain model in, a ``Stepper`` out.

Every function has the signature ``(model, blocks, cfg, ctx, sample) -> Stepper``:
``blocks`` is the model's ordered block list (for pipeline cuts), ``cfg`` the validated
``RunConfig``, ``ctx`` the worker's ``DistContext`` (rank, device, mesh, events) and
``sample`` a batch of real inputs (pipelines time their blocks on it).
"""

from __future__ import annotations

from partrain.strategies.base import Stepper
from partrain.strategies.ddp import parallelize_ddp
from partrain.strategies.fsdp import parallelize_fsdp
from partrain.strategies.hogwild import parallelize_hogwild
from partrain.strategies.local_sgd import parallelize_local_sgd
from partrain.strategies.pipeline import parallelize_pipeline
from partrain.strategies.serial import parallelize_serial

PARALLELIZE = {
    "serial": parallelize_serial,
    "ddp": parallelize_ddp,
    "local-sgd": parallelize_local_sgd,
    "fsdp": parallelize_fsdp,
    "model-parallel": parallelize_pipeline,
    "gpipe": parallelize_pipeline,
    "1f1b": parallelize_pipeline,
    "hybrid": parallelize_pipeline,
    "hogwild": parallelize_hogwild,
}

__all__ = ["PARALLELIZE", "Stepper"]
