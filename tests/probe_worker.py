"""A worker that runs the hardware profile's side-by-side pipeline probe (tests/test_profile.py)."""

from __future__ import annotations

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.distributed.launch import detect_launcher, init_process_group, leave_process_group
from partrain.profile.step_probes import measure_pipelines_side_by_side


@record
def side_by_side(rounds: int, steps: int) -> dict:
    """Every rank's own pair's probe."""
    info = detect_launcher()
    torch.set_num_threads(1)
    init_process_group(info, "gloo", timeout_s=120)
    try:
        return measure_pipelines_side_by_side(torch.device("cpu"), rounds=rounds, steps=steps)
    finally:
        leave_process_group()
