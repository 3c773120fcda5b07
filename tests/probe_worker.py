"""A worker that runs the hardware profile's side-by-side pipeline probe (tests/test_profile.py), and
the probe over every worker as the simulation would time it (tests/test_predict.py, test_bench_nodes.py)."""

from __future__ import annotations

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.predict.pipeline_sim import PipelineCosts, StepWork, simulate
from partrain.predict.schedules import schedule_order
from partrain.distributed.launch import detect_launcher, init_process_group, leave_process_group
from partrain.profile.step_probes import measure_pipelines_side_by_side


@record
def side_by_side(rounds: int, steps: int) -> dict:
    """Every rank's own pair's probe."""
    info = detect_launcher()
    torch.set_num_threads(1)
    init_process_group(info, "gloo", timeout_s=120)
    try:
        return measure_pipelines_side_by_side(torch.device("cpu"), loads=((8, 64, 1),), rounds=rounds, steps=steps)
    finally:
        leave_process_group()


def simulated_world_probe(stage_s, hop: float, step: float, action: float, slowdown, nbytes: int = 512,
                          links=None, cold_s=None) -> dict:
    """``measure_world_pipeline``'s record of one load, its step times the simulation's: stages
    of ``stage_s`` (forward, backward) plus the runtime's ``action`` each, ``hop`` a message
    (plus, per stage, ``links``' seconds ahead and back, with their wire times), ``step`` a
    step, the cores shared by ``slowdown``; 8 micro-batches of both schedules. ``cold_s``: each
    stage's (forward, backward) after its rank waited, recorded as the probe's ``stage_cold_s``."""
    n = len(stage_s)
    ahead, back, wire_ahead, wire_back = links or ((0.0,) * n, (0.0,) * n, (), ())
    costs = PipelineCosts(tuple(f + action for f, _ in stage_s), tuple(b + action for _, b in stage_s),
                          tuple(hop + t if s < n - 1 else 0.0 for s, t in enumerate(ahead)),
                          tuple(hop + t if s > 0 else 0.0 for s, t in enumerate(back)),
                          after=((StepWork("runtime", step),),) * n, wire_fwd=tuple(wire_ahead),
                          wire_bwd=tuple(wire_back), fwd_cold=tuple(f + action for f, _ in cold_s or ()),
                          bwd_cold=tuple(b + action for _, b in cold_s or ()))
    return {"stage_s": [list(s) for s in stage_s], "message_bytes": nbytes, "steps": [
        {"schedule": s, "microbatches": 8, "step_s": simulate(schedule_order(s, n, 8), costs, slowdown).step_s}
        for s in ("gpipe", "1f1b")], **({"stage_cold_s": [list(s) for s in cold_s]} if cold_s else {})}
