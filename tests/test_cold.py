"""Cold caches: where a node's workers outnumber its cores, a single pipeline over every worker
runs each block from caches another worker wrote over (``BlockProfile.fwd_cold_s``), and the
probe over every worker is fitted with its stages' cold times likewise."""

from __future__ import annotations

import dataclasses

import pytest

from partrain.predict import Plan, compute, predict_plan
from partrain.predict.cluster import load_cluster
from partrain.predict.pipeline import _pipeline_costs, runs_cold, stage_bounds
from partrain.predict.prediction import environment
from partrain.predict.profiles import ModelProfile
from partrain.profile.pipeline_fits import fit_loaded, probe_stage_times, world_runs_cold
from partrain.profile.model import profile_model
from partrain.profile.timing import core_cache_bytes
from tests.probe_worker import simulated_world_probe
from tests.test_predict import EXAMPLE_CLUSTER

pytestmark = pytest.mark.alone  # times blocks cold and back to back: never beside another test (make test)


@pytest.fixture(scope="module")
def mlp_profile():
    return profile_model("mlp", "mnist", [4, 16], threads=1, synthetic=True)


@pytest.fixture(scope="module")
def two_cores():
    """The example cluster as one node of 2 cores, no measured sharing: processor sharing alone."""
    return dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), nodes=1, workers_per_node=4, cores_per_node=2,
                               compute_sharing={}, sync_s={}, compute_speed=1.0, shared_cores=0)


def _with_cold(profile: ModelProfile, factor: float) -> ModelProfile:
    """``profile`` whose blocks' cold times are ``factor`` times their back-to-back times."""
    blocks = [dataclasses.replace(b, fwd_cold_s=[t * factor for t in b.fwd_s], bwd_cold_s=[t * factor for t in b.bwd_s])
              for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks)


def test_a_core_has_a_cache_of_its_own():
    assert core_cache_bytes() >= 64 * 2**10


def test_cold_block_times_never_run_faster_than_back_to_back_and_fall_back_where_not_measured(mlp_profile):
    hot = compute.block_times(mlp_profile, 8)
    assert compute.block_times(_with_cold(mlp_profile, 3.0), 8) == hot  # not asked for cold
    assert compute.block_times(_with_cold(mlp_profile, 3.0), 8, cold=True) == tuple(
        [pytest.approx(3 * t) for t in times] for times in hot)
    assert compute.block_times(_with_cold(mlp_profile, 0.5), 8, cold=True) == hot  # an eviction cannot speed it up
    assert compute.block_times(_with_cold(mlp_profile, 1.0), 8, cold=True) == hot
    unmeasured = _with_cold(mlp_profile, 3.0)
    unmeasured = dataclasses.replace(unmeasured, blocks=[dataclasses.replace(b, fwd_cold_s=[], bwd_cold_s=[])
                                                         for b in unmeasured.blocks])
    assert compute.block_times(unmeasured, 8, cold=True) == hot  # a GPU, an older profile: back to back


def test_a_profile_without_cold_times_loads_and_one_of_the_wrong_length_is_refused(mlp_profile):
    older = mlp_profile.to_dict()
    for block in older["blocks"]:
        del block["fwd_cold_s"], block["bwd_cold_s"]
    assert all(b.fwd_cold_s == [] for b in ModelProfile.from_dict(older).blocks)
    bad = mlp_profile.to_dict()
    bad["blocks"][1]["bwd_cold_s"] = [1e-4]
    with pytest.raises(ValueError, match=r"blocks\.1\.bwd_cold_s holds 1 values for 2 batch sizes"):
        ModelProfile.from_dict(bad)


@pytest.mark.parametrize("workers, per_node, cores, threads, shared, expected", [
    (4, 4, 2, 1, 0, True),  # 4 workers on 2 cores
    (2, 2, 2, 1, 0, False),  # a core each
    (2, 2, 2, 2, 0, True),  # 2 threads each on 2 cores
    (4, 1, 1, 1, 2, True),  # 4 emulated nodes sharing the machine's 2 cores
    (2, 1, 1, 1, 2, False),  # 2 of them
    (4, 1, 1, 1, 0, False),  # 4 real nodes of a core each
])
def test_workers_outnumber_the_cores_machine_wide_where_nodes_share_them(two_cores, workers, per_node, cores, threads,
                                                                        shared, expected):
    hw = dataclasses.replace(two_cores, nodes=workers // per_node, workers_per_node=per_node, cores_per_node=cores,
                             shared_cores=shared)
    plan = Plan("gpipe", workers, 64, pp=workers, microbatches=8, schedule="gpipe", threads=threads)
    assert environment(hw, plan).oversubscribed() is expected


def test_only_a_single_pipeline_over_more_workers_than_cores_runs_cold(two_cores):
    env = lambda plan: environment(two_cores, plan)  # noqa: E731
    world = Plan("gpipe", 4, 64, pp=4, microbatches=8, schedule="gpipe", threads=1)
    pair = dataclasses.replace(two_cores, workers_per_node=2)
    two = Plan("1f1b", 2, 64, pp=2, microbatches=4, schedule="1f1b", threads=1)
    hybrid = Plan("hybrid", 4, 64, pp=2, dp=2, microbatches=4, schedule="1f1b", threads=1)
    alone = Plan("gpipe", 1, 64, pp=1, microbatches=4, schedule="gpipe", threads=1)
    assert runs_cold(world, env(world))
    assert not runs_cold(two, environment(pair, two))  # a core each
    assert not runs_cold(hybrid, env(hybrid))  # replicas: the side-by-side probe's per-step cost holds it
    assert not runs_cold(alone, env(alone))
    assert world_runs_cold(two_cores) and not world_runs_cold(pair)


def test_a_cold_single_pipeline_computes_its_stages_blocks_cold_and_takes_longer(mlp_profile, two_cores):
    """Value by value: each stage's forward after a wait is its blocks' cold forwards plus the
    runtime's action; a 2-worker pipeline on 2 cores and a hybrid keep the back-to-back times."""
    cold = _with_cold(mlp_profile, 2.5)
    hw = dataclasses.replace(two_cores, pipeline_action_s=4e-5)
    plan = Plan("gpipe", 3, 48, pp=3, microbatches=4, schedule="gpipe", threads=1)
    hw3 = dataclasses.replace(hw, workers_per_node=3)
    bounds = stage_bounds(cold, plan)
    costs = _pipeline_costs(cold, hw3, plan, bounds, environment(hw3, plan))
    fwd, _ = compute.stage_times(cold, bounds, 12, cold=True)
    # back to back: the blocks as they run inside the step (the loop's excess at 12 rows)
    hot = [f * compute.in_step_factor(cold, 12) for f in compute.stage_times(cold, bounds, 12)[0]]
    assert costs.fwd_cold == pytest.approx(tuple(max(f, h) + 4e-5 for f, h in zip(fwd, hot)))
    assert costs.fwd == pytest.approx(tuple(h + 4e-5 for h in hot))
    assert fwd[0] == pytest.approx(2.5 * compute.stage_times(mlp_profile, bounds, 12)[0][0])
    assert predict_plan(cold, hw3, plan).seconds_per_step > predict_plan(mlp_profile, hw3, plan).seconds_per_step
    two = Plan("gpipe", 2, 48, pp=2, microbatches=4, schedule="gpipe", threads=1)
    hw2 = dataclasses.replace(hw, workers_per_node=2)
    assert predict_plan(cold, hw2, two).seconds_per_step == predict_plan(mlp_profile, hw2, two).seconds_per_step
    hybrid = Plan("hybrid", 4, 48, pp=2, dp=2, microbatches=4, schedule="1f1b", threads=1)
    assert predict_plan(cold, hw, hybrid).seconds_per_step == predict_plan(mlp_profile, hw, hybrid).seconds_per_step


def test_only_an_action_whose_rank_waited_before_it_runs_cold():
    """Two stages of GPipe, 2 micro-batches, every action 1 s back to back and 3 s cold, messages
    free. Rank 0 runs its forwards back to back (warm), then waits for rank 1's first gradient:
    its first backward is cold, its second follows at once. Rank 1 waits for its first forward
    (cold) and runs the rest back to back. One step: rank 0 F F . . . . B(cold 6-9) B (9-10);
    rank 1 . F(cold 1-4) F B B; 10 s, where warm it is 6 s and cold throughout 18 s."""
    from partrain.predict.pipeline_sim import PipelineCosts, simulate
    from partrain.predict.schedules import gpipe_order

    def step(cold: tuple[float, ...]) -> float:
        return simulate(gpipe_order(2, 2), PipelineCosts((1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0),
                                                         fwd_cold=cold, bwd_cold=cold)).step_s

    assert step(()) == pytest.approx(6.0)
    assert step((3.0, 3.0)) == pytest.approx(10.0)
    sim = simulate(gpipe_order(2, 2), PipelineCosts((1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0),
                                                    fwd_cold=(3.0, 3.0), bwd_cold=(3.0, 3.0)))
    assert sim.busy[0] == pytest.approx({"F": 2.0, "B": 4.0, "sends": 0.0})
    assert sim.busy[1] == pytest.approx({"F": 4.0, "B": 2.0, "sends": 0.0})


def test_a_probes_cold_stage_times_are_never_below_its_back_to_back_ones():
    probe = {"stage_s": [[1e-4, 2e-4], [3e-4, 4e-4]], "stage_cold_s": [[3e-4, 1e-4], [3e-4, 9e-4]]}
    assert probe_stage_times(probe) == [(1e-4, 2e-4), (3e-4, 4e-4)]
    assert probe_stage_times(probe, cold=True) == [(3e-4, 2e-4), (3e-4, 9e-4)]
    assert probe_stage_times({"stage_s": probe["stage_s"]}, cold=True) == [(1e-4, 2e-4), (3e-4, 4e-4)]  # not timed


def test_the_probe_over_more_workers_than_cores_is_fitted_with_its_stages_cold_times(two_cores):
    """Probes whose stages ran their cold times: fitted with them, each load's hop is the one its
    simulation was given; fitted with the back-to-back times, the hop takes in the stages' extra time."""
    action, step = 4e-5, 3e-4
    hw = dataclasses.replace(two_cores, pipeline_action_s=action, pipeline_world=(step, 4e-4))
    slowdown = lambda k: compute.contention(k, cores=2)  # noqa: E731
    shapes = [(1.0, 2.0), (1.2, 2.0), (1.0, 2.4), (0.8, 1.0)]
    probes = []
    for t, hop in [(1e-5, 4e-4), (2e-4, 9e-4), (1e-3, 2.4e-3)]:
        hot = [(t * f, t * b) for f, b in shapes]
        ran = [(3 * f, 2 * b) for f, b in hot]  # what the stages took inside the pipeline after a wait: cold
        probes.append(simulated_world_probe(hot, hop, step, action, slowdown, cold_s=ran))
    hw = dataclasses.replace(hw, points={"pipeline_world": {**probes[0], "loaded": probes[1:]}})
    fitted = fit_loaded(hw, "pipeline_world")
    for (got_action, got_hop), probe, hop in zip(fitted[1:], probes[1:], (9e-4, 2.4e-3)):
        assert got_action == pytest.approx(sum(f + b for f, b in probe["stage_cold_s"]) / 8 + action)
        grid = max(p["step_s"] for p in probe["steps"]) / 2 / 200  # the fit's resolution
        assert got_hop == pytest.approx(hop, abs=grid)
    one_core_each = dataclasses.replace(hw, cores_per_node=4)  # not oversubscribed: the back-to-back times
    hot_fit = fit_loaded(one_core_each, "pipeline_world")
    assert all(h > hop * 1.05 for (_, h), hop in zip(hot_fit[1:], (9e-4, 2.4e-3)))
