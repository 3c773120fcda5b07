"""A pipeline stage's worker posts and waits on its own messages between its actions: the CPU
that costs it is fitted from the pipeline probe's CPU a step on each rank
(``profile.pipeline_fits.fit_message_cpu``), held apart from the message's latency by the
probe's fit, and paid by every action that receives or sends (``predict.pipeline``)."""

from __future__ import annotations

import dataclasses

import pytest

from partrain.predict import Plan
from partrain.predict.cluster import load_cluster
from partrain.predict.pipeline import _pipeline_costs, stage_bounds
from partrain.predict.pipeline_sim import PipelineCosts, StepWork, simulate
from partrain.predict.prediction import environment
from partrain.predict.schedules import schedule_order
from partrain.profile.model import profile_model
from partrain.profile.pipeline_fits import fit_message_cpu, fit_pipeline_runtime
from tests.test_predict import EXAMPLE_CLUSTER

pytestmark = pytest.mark.alone  # measures the pipeline runtime's costs: never beside another test (make test)

STAGES = [(1e-4, 2e-4), (1e-4, 3e-4), (2e-4, 2e-4), (1e-4, 1e-4)]  # (forward, backward) seconds


def _probe_cpu(n: int, per_message: float, action: float, per_step: float = 3e-4) -> dict:
    """A probe of ``n`` stages whose ranks each used, a step, ``per_step`` of CPU plus, per
    micro-batch, a forward, a backward, the runtime's two actions and ``per_message`` for each
    message (a forward's and a backward's from and to each neighbour)."""
    stage_s = STAGES[:n]
    steps = [{"schedule": s, "microbatches": m, "step_s": 0.01,
              "cpu_s": [per_step + m * (f + b + 2 * action + 2 * ((r > 0) + (r < n - 1)) * per_message)
                        for r, (f, b) in enumerate(stage_s)]}
             for s in ("gpipe", "1f1b") for m in (4, 8)]
    return {"stage_s": stage_s, "steps": steps, "message_bytes": 512}


@pytest.mark.parametrize("n", [2, 4])
def test_a_messages_cpu_is_what_each_micro_batch_more_costs_a_rank_beyond_its_actions(n):
    """Two stages (one neighbour each) and four (the middle ranks have two): the CPU each
    micro-batch more adds, less its compute and the runtime's actions, per message; the per-step
    CPU cancels out."""
    action = 4e-5
    assert fit_message_cpu(_probe_cpu(n, 9e-5, action), action) == pytest.approx(9e-5)
    assert fit_message_cpu(_probe_cpu(n, 9e-5, action, per_step=5e-3), action) == pytest.approx(9e-5)
    # never below nothing (a rank that used less than its compute: timing noise)
    assert fit_message_cpu(_probe_cpu(n, -2e-5, action), action) == 0.0
    # a probe without CPU times (a profile measured before they were taken), or of one micro-batch count
    bare = _probe_cpu(n, 9e-5, action)
    for step in bare["steps"]:
        del step["cpu_s"]
    assert fit_message_cpu(bare, action) == 0.0
    one_count = _probe_cpu(n, 9e-5, action)
    one_count["steps"] = [s for s in one_count["steps"] if s["microbatches"] == 4]
    assert fit_message_cpu(one_count, action) == 0.0


def test_the_runtime_fit_keeps_a_messages_cpu_apart_from_its_latency():
    """A probe simulated with each action paying its messages' CPU: given that CPU, the fit finds
    the latency the simulation was given; without it, it takes the CPU for latency."""
    n, action, step, hop, cpu = 2, 4e-5, 4e-4, 3e-4, 1e-4
    own = [action + cpu * ((s > 0) + (s < n - 1)) for s in range(n)]
    fwd, bwd = (tuple(stage[i] + own[s] for s, stage in enumerate(STAGES[:n])) for i in (0, 1))
    costs = PipelineCosts(fwd, bwd, (hop, 0.0), (0.0, hop), after=((StepWork("runtime", step),),) * n)
    probe = {"stage_s": STAGES[:n], "message_bytes": 512, "steps": [
        {"schedule": s, "microbatches": m, "step_s": simulate(schedule_order(s, n, m), costs).step_s}
        for s in ("gpipe", "1f1b") for m in (4, 8)]}
    _, fitted_hop = fit_pipeline_runtime(probe, action, message_cpu_s=cpu)
    assert fitted_hop == pytest.approx(hop, rel=0.05)
    _, hop_alone = fit_pipeline_runtime(probe, action)
    assert hop_alone > 1.2 * hop


@pytest.fixture(scope="module")
def mlp_profile():
    return profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True)


@pytest.mark.parametrize("pp", [2, 3])
def test_every_action_pays_the_cpu_of_the_messages_it_receives_and_sends(mlp_profile, pp):
    """Each stage's forward pays for the message it receives from the stage before and the one it
    sends to the one after, its backward for their gradients the other way: the end stages one
    message each, a middle stage two, whatever a message's tensors (they are posted together);
    a pipeline on one worker sends nothing."""
    hw = dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), compute_speed=1.0, compute_sharing={}, sync_s={},
                             pipeline_hop_s=3e-4, points={"pipeline": {"message_bytes": 512}})

    def actions(plan: Plan, cpu: float) -> tuple:
        machine = dataclasses.replace(hw, pipeline_message_cpu_s=cpu)
        costs = _pipeline_costs(mlp_profile, machine, plan, stage_bounds(mlp_profile, plan), environment(machine, plan))
        return costs.fwd, costs.bwd

    plan = Plan("gpipe", workers=pp, batch_size=16, pp=pp, microbatches=4, schedule="gpipe", threads=1)
    (fwd, bwd), (fwd0, bwd0) = actions(plan, 2e-4), actions(plan, 0.0)
    messages = [(s > 0) + (s < pp - 1) for s in range(pp)]
    assert [a - b for a, b in zip(fwd, fwd0)] == pytest.approx([2e-4 * k for k in messages])
    assert [a - b for a, b in zip(bwd, bwd0)] == pytest.approx([2e-4 * k for k in messages])
    # blocks that return (activations, ids): two tensors a message forward, one gradient back; the same posts
    pairs = dataclasses.replace(mlp_profile, blocks=[dataclasses.replace(b, out_tensors=2, out_floats=1)
                                                     for b in mlp_profile.blocks])
    machine = dataclasses.replace(hw, pipeline_message_cpu_s=2e-4)
    costs = _pipeline_costs(pairs, machine, plan, stage_bounds(pairs, plan), environment(machine, plan))
    assert [a - b for a, b in zip(costs.fwd, fwd0)] == pytest.approx([2e-4 * k for k in messages])
    alone = Plan("gpipe", workers=1, batch_size=16, pp=pp, microbatches=4, schedule="gpipe", threads=1)
    assert actions(alone, 2e-4) == actions(alone, 0.0)
