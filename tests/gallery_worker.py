"""Runs many training configurations in one launch of two workers (tests/test_gallery.py).

Starting two processes costs seconds (imports, rendezvous); a tiny model's run costs a
fraction of one. So the workers join one gloo group once and run every cell in it, each
with the training loop's own ``_train`` and its own device mesh. Serial cells run on both
workers alike (without a mesh); their world-mean losses are then the serial losses.
"""

from __future__ import annotations

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.config import RunConfig
from partrain.distributed.context import DistContext, build_mesh
from partrain.distributed.launch import detect_launcher, init_process_group
from partrain.events import EventLog
from partrain.train import _train


@record
def run_cells(cells: list[tuple[str, RunConfig]]) -> dict[str, dict | str]:
    """{cell name: {"losses": per-step losses, "accuracy": test accuracy or None}, or the error it raised}."""
    info = detect_launcher()
    torch.set_num_threads(1)
    backend = init_process_group(info, "gloo", timeout_s=60)
    device = torch.device("cpu")
    out: dict[str, dict | str] = {}
    for name, cfg in cells:
        mesh = None if cfg.strategy == "serial" else build_mesh(cfg.dims, device)
        ctx = DistContext(info, backend, device, cfg.dims, mesh, EventLog(None, info.rank))
        try:
            result = _train(cfg, ctx, 1, False)
            out[name] = {"losses": result.step_losses, "accuracy": result.test_accuracy}
        except Exception as err:  # noqa: BLE001 - the test reports it per cell
            out[name] = f"{type(err).__name__}: {err}"
            break  # the peer may be waiting in a collective this rank left: no later cell can be trusted
    torch.distributed.destroy_process_group()
    return out
