"""Issue 17, item 5: compute sharing measured for the model being predicted, and the profiler
on blocks that return tuples and on token ids."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from partrain.data import load_dataset
from partrain.predict import Plan, predict_plan
from partrain.predict.cluster import load_cluster
from partrain.predict.profiles import BlockProfile, ModelProfile
from partrain.profile import outputs
from partrain.profile.blocks import profile_blocks
from partrain.profile.model import profile_model
from partrain.profile.numerics import autocast
from partrain.profile.timing import Stopwatch
from partrain.profile.sharing import (CONFIRMATIONS, PAUSE_S, SUSPECT, CoRunners, confirmed, measure_sharing,
                                     sharing_factors, training_step)

pytestmark = pytest.mark.alone  # measures compute side by side: never beside another test (make test)

EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


def _block(name: str, seconds: float) -> BlockProfile:
    return BlockProfile(name, 1000, 4000, 2, 0, [seconds, 4 * seconds], [2 * seconds, 8 * seconds], [256, 1024],
                        [512, 2048], False, False, [10, 40], {"sgd": 1e-5, "sgd-momentum": 2e-5, "adam": 3e-5})


def _profile(fingerprint: str, sharing: dict[int, float]) -> ModelProfile:
    """A made-up profile of two blocks: every figure chosen, none measured."""
    return ModelProfile("fake", "mnist", True, [8, 32], 1, fingerprint, [1, 28, 28], 3136, 60000,
                        [_block("a", 1e-3), _block("b", 2e-3)], [1e-4, 4e-4], [1e-4, 4e-4],
                        {"sgd": 2e-5, "sgd-momentum": 4e-5, "adam": 6e-5}, 10**8, 10**8, [10**8, 10**8], 0.0,
                        compute_sharing=sharing, sharing_batch=8)


@pytest.fixture(scope="module")
def two_cores():
    hw = load_cluster(EXAMPLE_CLUSTER)
    return dataclasses.replace(hw, cores_per_node=2, workers_per_node=2, nodes=1, compute_speed=1.0,
                               compute_sharing={2: 1.5})


def test_the_models_own_sharing_replaces_the_hardware_probes(two_cores):
    plan = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    probe_only = predict_plan(_profile(two_cores.fingerprint, {}), two_cores, plan)
    own = predict_plan(_profile(two_cores.fingerprint, {2: 1.05}), two_cores, plan)
    assert own.compute_s == pytest.approx(probe_only.compute_s * 1.05 / 1.5)
    assert own.seconds_per_step < probe_only.seconds_per_step
    assert any("1.05x (measured for this model)" in n for n in own.notes)
    assert any("1.50x (the hardware probe's convolution: not measured for this model)" in n for n in probe_only.notes)
    # never below processor sharing: 2 workers on 1 core each get half of it, whatever was measured
    one_core = predict_plan(_profile(two_cores.fingerprint, {2: 1.05}), dataclasses.replace(two_cores, cores_per_node=1), plan)
    assert one_core.compute_s == pytest.approx(probe_only.compute_s * 2.0 / 1.5)


def test_beyond_the_models_workers_the_hardwares_growth_goes_on_the_models_own(two_cores):
    """The model measured 2 workers (1.05x), the hardware profile says 2 (1.5x) and 4 (3.3x): 4
    workers of the model compute 3.3 / 1.5 * 1.05 = 2.31x slower, above the cores' processor
    sharing (2x)."""
    hw = dataclasses.replace(two_cores, workers_per_node=4, compute_sharing={2: 1.5, 4: 3.3})
    plan = Plan("ddp", workers=4, batch_size=32, dp=4, threads=1)
    probe_only = predict_plan(_profile(hw.fingerprint, {}), hw, plan)
    own = predict_plan(_profile(hw.fingerprint, {2: 1.05}), hw, plan)
    assert own.compute_s == pytest.approx(probe_only.compute_s * 2.31 / 3.3)
    assert any("2.31x (the model's at 2 workers times the hardware profile's growth beyond)" in n for n in own.notes)
    # under processor sharing of the cores, the floor
    low = predict_plan(_profile(hw.fingerprint, {2: 1.05}), dataclasses.replace(hw, compute_sharing={2: 1.5, 4: 2.4}), plan)
    assert low.compute_s == pytest.approx(probe_only.compute_s * 2.0 / 3.3)


def test_sharing_measured_elsewhere_or_with_other_threads_is_not_used(two_cores):
    plan = Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)
    probe_only = predict_plan(_profile(two_cores.fingerprint, {}), two_cores, plan)
    elsewhere = predict_plan(_profile("another-machine", {2: 1.05}), two_cores, plan)
    assert elsewhere.compute_s == pytest.approx(probe_only.compute_s)
    assert any("the model's was measured elsewhere" in n for n in elsewhere.notes)
    threads = dataclasses.replace(_profile(two_cores.fingerprint, {2: 1.05}), threads=2)
    assert predict_plan(threads, two_cores, plan).compute_s == pytest.approx(probe_only.compute_s)


def test_the_models_sharing_enters_pipelines_and_leaves_serial_alone(two_cores):
    pipe = Plan("gpipe", workers=2, batch_size=32, microbatches=4, schedule="gpipe", pp=2, threads=1)
    probe_only = predict_plan(_profile(two_cores.fingerprint, {}), two_cores, pipe)
    own = predict_plan(_profile(two_cores.fingerprint, {2: 1.0}), two_cores, pipe)
    assert own.seconds_per_step < probe_only.seconds_per_step
    serial = Plan("serial", workers=1, batch_size=32, threads=1)
    hw1 = dataclasses.replace(two_cores, workers_per_node=1)
    a = predict_plan(_profile(two_cores.fingerprint, {}), hw1, serial)
    b = predict_plan(_profile(two_cores.fingerprint, {2: 3.0}), hw1, serial)
    assert a.seconds_per_step == b.seconds_per_step and not any("side by side" in n for n in b.notes)


def test_a_one_block_profile_predicts_data_parallel_and_refuses_pipelines(two_cores):
    """A profile of one block (a plain module the tracer could not split): data parallel is
    predicted, a pipeline plan is refused with the fix, as the run refuses it."""
    from partrain.errors import PartrainError

    whole = dataclasses.replace(_profile(two_cores.fingerprint, {2: 1.1}), blocks=[_block("", 3e-3)])
    assert predict_plan(whole, two_cores, Plan("ddp", workers=2, batch_size=32, dp=2, threads=1)).seconds_per_step > 0
    with pytest.raises(PartrainError, match="one block to the profiler.*return \\(module, blocks\\)"):
        predict_plan(whole, two_cores, Plan("gpipe", workers=2, batch_size=32, microbatches=2, schedule="gpipe", pp=2,
                                            threads=1))


def test_profile_round_trip_keeps_the_sharing(tmp_path, two_cores):
    prof = _profile(two_cores.fingerprint, {2: 1.07, 3: 1.4})
    loaded = ModelProfile.load(prof.save(tmp_path / "p.json"))
    assert loaded.compute_sharing == {2: 1.07, 3: 1.4} and loaded.sharing_batch == 8


@pytest.mark.timeout(180)
def test_the_probe_measures_a_sane_factor_with_two_processes():
    train_set = load_dataset("mnist", "train", synthetic=True)
    torch.manual_seed(0)
    from partrain.models import build_model

    net = build_model("mlp", train_set.spec.input_shape, train_set.spec.num_classes)
    job = dict(model="mlp", dataset="mnist", input_shape=list(train_set.spec.input_shape),
               num_classes=train_set.spec.num_classes, threads=1, data_dir=None, synthetic=True, options={}, seed=0,
               batch=16)
    x, y = train_set.get(torch.arange(16))
    with CoRunners(1, job, timeout_s=120) as others:
        raw = measure_sharing(training_step(net, x, y), others, window_s=0.02, rounds=2)
    assert [p.returncode for p in others.procs] == [0]  # told to quit, it left (spawn.leave_at_once)
    assert set(raw) == {2}
    assert all(v > 0 for v in raw[2].values())
    factor = sharing_factors(raw)[2]
    assert math.isfinite(factor) and factor >= 1.0


class _SpellAfterFirstWindow:
    """Stands in for ``CoRunners``: nothing runs beside the step, but from the first ``busy``
    on, the machine is in a slow spell (every step burns 1.5x the CPU), as a core of the
    2-vCPU VM does for seconds at a time."""

    n = 1

    def __init__(self):
        self.slow = False

    def wait_ready(self):
        pass

    def busy(self, j):
        self.slow = True

    def idle(self):
        pass


def _burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_spell_that_begins_inside_a_round_spoils_that_round_not_the_factor():
    others = _SpellAfterFirstWindow()
    raw = measure_sharing(lambda: _burn_cpu(0.0015 if others.slow else 0.001), others, window_s=0.005, rounds=5)
    # the fastest window alone (before the spell) against the fastest side by side (in it): 1.5
    assert raw[2]["together_cpu_s"] / raw[2]["alone_cpu_s"] > 1.3
    # round by round: 1.5 in the first, 1.0 in the four after it
    assert sharing_factors(raw)[2] < 1.15


def test_the_factor_is_the_median_round_never_below_one():
    raw = {2: {"alone_s": 1.0, "together_s": 1.0, "alone_cpu_s": 1.0, "together_cpu_s": 1.0, "cpu_ratio": 1.25},
           "3": {"alone_s": 1.0, "together_s": 1.0, "alone_cpu_s": 1.0, "together_cpu_s": 1.0, "cpu_ratio": 0.9}}
    assert sharing_factors(raw) == {2: 1.25, 3: 1.0}


def _measurements(*readings):
    """Stands in for one sharing measurement per call, and counts the calls and the pauses."""
    calls, pauses = [], []

    def measure():
        calls.append(1)
        return readings[len(calls) - 1]

    return measure, calls, pauses.append, pauses


def test_a_factor_under_suspicion_is_measured_once():
    measure, calls, pause, pauses = _measurements({2: SUSPECT, 3: 1.0})
    assert confirmed(measure, pause) == {2: SUSPECT, 3: 1.0}
    assert len(calls) == 1 and pauses == []


def test_a_spell_that_outlasts_a_measurement_is_measured_away():
    # run69u's tuple_out: 2.00 in every round of one measurement, about 1.1 in the next
    measure, calls, pause, pauses = _measurements({2: 2.0, 3: 1.0}, {2: 1.08, 3: 1.05})
    assert confirmed(measure, pause) == {2: 1.08, 3: 1.0}  # each k's lowest
    assert len(calls) == 2 and pauses == [PAUSE_S]


def test_a_factor_the_model_has_stays_after_every_confirmation():
    readings = [{2: 1.5}, {2: 1.45}, {2: 1.6}, {2: 1.0}]  # the fourth is never taken
    measure, calls, pause, pauses = _measurements(*readings)
    assert confirmed(measure, pause) == {2: 1.45}
    assert len(calls) == 1 + CONFIRMATIONS and pauses == [PAUSE_S] * CONFIRMATIONS


def test_a_broken_corunner_is_one_clear_error():
    from partrain.errors import PartrainError

    job = dict(model="no-such-model", dataset="mnist", input_shape=[1, 28, 28], num_classes=10, threads=1,
               data_dir=None, synthetic=True, options={}, seed=0, batch=4)
    with pytest.raises(PartrainError, match="co-runner exited"), CoRunners(1, job, timeout_s=120) as others:
        measure_sharing(lambda: None, others)


# ---- the profiler on tuples and token ids ----------------------------------------------------


class Pair(nn.Module):
    """Returns (activations, ids): a tuple with an int64 tensor in it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)

    def forward(self, ids):
        return self.embed(ids), ids


class UsePair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.gate = nn.Linear(8, 8), nn.Embedding(50, 8)

    def forward(self, pair):
        h, ids = pair
        return self.lin(h) * self.gate(ids), ids


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 50)

    def forward(self, pair):
        return self.head(pair[0])


def test_blocks_returning_tuples_are_timed_and_sized():
    ids = torch.randint(0, 50, (4, 6))
    cpu = torch.device("cpu")
    rows = profile_blocks([Pair(), UsePair(), Head()], ids, Stopwatch(cpu), lambda: autocast(cpu, "fp32"))
    assert [r["out_bytes"] for r in rows] == [4 * 6 * 8 * 4 + 4 * 6 * 8, 4 * 6 * 8 * 4 + 4 * 6 * 8, 4 * 6 * 50 * 4]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in rows)
    assert rows[1]["flops"] > 0  # the linear layer counted through a tuple input
    # a tuple crosses a stage boundary as one message per tensor, gradients for the float ones only
    assert [(r["out_tensors"], r["out_floats"]) for r in rows] == [(2, 1), (2, 1), (1, 1)]


def test_outputs_helpers_on_tuples():
    h = torch.ones(2, 3, requires_grad=True)
    pair = (h * 2, torch.arange(2))
    cut = outputs.detached(pair, True)
    assert cut[0].requires_grad and not cut[1].requires_grad and cut[0].grad_fn is None
    assert outputs.nbytes(pair) == 2 * 3 * 4 + 2 * 8
    outputs.backward(pair)
    assert torch.equal(h.grad, torch.full((2, 3), 2.0))


@pytest.mark.timeout(300)
def test_token_model_profile_counts_int64_inputs():
    prof = profile_model("tests.gallery:tuple_out", "tokens", [4, 8], threads=1, synthetic=True)
    t = prof.input_shape[0]
    assert prof.input_bytes == 8 * t  # int64 token ids, not 4-byte floats
    assert prof.blocks[0].out_bytes[0] > 4 * 4 * t  # activations and the ids both cross the first boundary
    assert set(prof.compute_sharing) >= {2} and all(f >= 1.0 for f in prof.compute_sharing.values())


def test_validate_names_strategies_whose_2_worker_errors_share_one_sign():
    from partrain.validate import Case, error_signs, one_sided

    def case(strategy, workers, measured, predicted):
        return Case(f"{strategy} x{workers}", ("m", "d", 64, workers, 1), strategy, measured, predicted, 1, 1, 1.0)

    cases = [case("ddp", 2, 1.0, 1.2), case("ddp", 2, 1.0, 1.1), case("ddp", 4, 1.0, 0.9),
             case("gpipe", 2, 1.0, 1.1), case("gpipe", 2, 1.0, 0.95), case("serial", 1, 1.0, 1.3)]
    signs = error_signs(cases, workers=2)
    assert signs == {"ddp": (2, 2, 0), "gpipe": (2, 1, 1)}
    assert one_sided(signs) == ["ddp"]


def test_validate_says_when_the_serial_cells_show_the_profiles_ran_at_another_speed():
    """Serial is the profile's own parts summed: most serial cells off one way is the machine's
    speed moving between profiling and the cells, not the model of a strategy."""
    from partrain.validate import SPEED_SHIFT, Case, speed_shift

    def serial(batch, measured, predicted):
        return Case(f"serial b{batch}", ("m", "d", batch, 1, 1), "serial", measured, predicted, 1, 1, 1.0)

    slow = [serial(b, 1.0, p) for b, p in ((8, 1.12), (16, 1.10), (32, 0.97), (64, 1.2), (128, 1.15))]
    assert speed_shift(slow) == pytest.approx(0.12)  # the median: one cell the other way does not hide it
    steady = [serial(b, 1.0, p) for b, p in ((8, 1.05), (16, 0.93), (32, 0.98), (64, 1.06))]
    assert speed_shift(steady) is None
    assert speed_shift(slow[:3]) is None  # too few serial cells to tell
    fast = [serial(b, 1.0, 1.0 - SPEED_SHIFT - 0.01) for b in (8, 16, 32, 64)]
    assert speed_shift(fast) == pytest.approx(-SPEED_SHIFT - 0.01)
    assert speed_shift(slow + [Case("ddp", ("m", "d", 8, 2, 1), "ddp", 1.0, 1.0, 1, 1, 1.0)] * 9) == pytest.approx(0.12)


def test_validate_divides_the_serial_shift_out_of_every_prediction_as_a_diagnostic():
    """A machine 20% faster while profiling leaves every prediction 20% under; divided out,
    what remains is each strategy's own error, value by value."""
    from partrain.validate import Case, without_shift

    def case(strategy, predicted):
        return Case(f"{strategy} {predicted}", ("m", "d", 8, 2, 1), strategy, 1.0, predicted, 1, 1, 1.0)

    cases = [case("serial", 0.8), case("serial", 0.8), case("ddp", 0.8 * 1.1), case("ddp", 0.8 * 0.95)]
    mape = without_shift(cases, -0.2)
    assert mape["serial"] == pytest.approx(0.0)
    assert mape["ddp"] == pytest.approx((0.10 + 0.05) / 2)
    assert mape["all"] == pytest.approx(0.15 / 4)
    assert without_shift(cases, 0.0)["ddp"] == pytest.approx((0.12 + 0.24) / 2)  # no shift: the MAPE as measured
