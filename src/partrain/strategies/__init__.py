"""One ``parallelize_<name>`` per strategy: a plain model in, a ``Stepper`` out.

Every function has the signature ``(model, blocks, cfg, ctx, sample) -> Stepper``:
``blocks`` is the model's ordered block list (for pipeline cuts), ``cfg`` the validated
``RunConfig``, ``ctx`` the worker's ``DistContext`` (rank, device, mesh, events) and
``sample`` a batch of real inputs (pipelines time their blocks on it).
"""

from __future__ import annotations

from partrain.spec import SPECS
from partrain.strategies.base import Stepper

# strategy name -> its parallelize_*, as its StrategySpec names it (spec.py: the one registry)
PARALLELIZE = {name: spec.runtime() for name, spec in SPECS.items()}

__all__ = ["PARALLELIZE", "Stepper"]
