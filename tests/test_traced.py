"""A plain module split into blocks by pipelining's tracer (strategies.traced): the pieces,
chained, compute the module value by value, and the profiler and predictor see those pieces."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from partrain.errors import PartrainError
from partrain.predict import Plan, predict_plan
from partrain.predict.cluster import load_cluster
from partrain.profile.model import profile_model
from partrain.strategies.traced import TracedSpan, traced_blocks

pytestmark = pytest.mark.alone  # profiles a plain module's traced pieces: never beside another test (make test)

EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


class LongSkip(nn.Module):
    """A residual that skips two submodules: its input must pass through the piece between."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        return self.head(self.c(self.b(h)) + h)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), x.sum(-1, keepdim=True)


class TupleInside(nn.Module):
    """A submodule returning a tuple, whose parts different later submodules read."""

    def __init__(self):
        super().__init__()
        self.pair, self.mix, self.head = Pair(), nn.Linear(8, 8), nn.Linear(9, 3)

    def forward(self, x):
        h, s = self.pair(x)
        return self.head(torch.cat([self.mix(h), s], -1))


def _chain(blocks, x):
    for block in blocks:
        x = block(x)
    return x


@pytest.mark.parametrize("make", [LongSkip, TupleInside])
def test_the_pieces_chained_are_the_module_forward_and_backward(make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(5, 8)
    blocks = traced_blocks(model, x)
    assert len(blocks) == len(list(model.children())) and all(isinstance(b, TracedSpan) for b in blocks)
    assert [b.begins for b in blocks] == [n for n, _ in model.named_children()]
    whole = model(x)
    whole.square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pieces = _chain(blocks, x)
    pieces.square().sum().backward()
    torch.testing.assert_close(pieces, whole, rtol=0, atol=0)
    for n, p in model.named_parameters():  # the pieces hold the module's own parameters
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)


def test_a_weight_two_pieces_use_stays_the_models_one():
    from tests.gallery import traced_tied

    torch.manual_seed(0)
    model, x = traced_tied((1, 28, 28), 10), torch.randn(4, 1, 28, 28)
    blocks = traced_blocks(model, x)
    held = {id(p) for b in blocks for p in b.parameters()}
    assert held == {id(p) for p in model.parameters()}  # Pipe's per-piece copy of the tie is gone
    assert any(model.first.weight is p for p in blocks[1].parameters())
    assert any(model.first.weight is p for p in blocks[3].parameters())
    model(x).square().sum().backward()
    want = model.first.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    _chain(blocks, x).square().sum().backward()
    torch.testing.assert_close(model.first.weight.grad, want, rtol=1e-6, atol=1e-7)  # both uses' gradients


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.drop, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.drop(self.norm(self.a(x))))


def test_the_probes_before_training_leave_no_trace_on_traced_pieces():
    # the trace recorded BatchNorm and dropout in training mode, where eval() does not reach
    from partrain.strategies.boundary import probe_boundaries, stage_examples
    from partrain.strategies.pipeline import stage_module

    model, x = Noisy(), torch.randn(6, 8)
    blocks = traced_blocks(model, x)
    stats, rng = model.norm.running_mean.clone(), torch.get_rng_state()
    crossings = probe_boundaries(blocks, x)
    stage_examples([stage_module(blocks[:2], False, None), stage_module(blocks[2:], False, crossings[1])], x)
    torch.testing.assert_close(model.norm.running_mean, stats, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.norm.num_batches_tracked.item() == 0


def test_a_residual_crosses_the_pieces_it_skips():
    model, x = LongSkip(), torch.randn(5, 8)
    a, b, c, head = traced_blocks(model, x)
    after_a = a(x)
    assert isinstance(after_a, torch.Tensor)  # h alone: both b and the sum read it
    after_b = b(after_a)
    assert isinstance(after_b, tuple) and len(after_b) == 2  # b's output, and h passed on for the sum
    assert any(t is after_a for t in after_b)
    assert isinstance(c(after_b), torch.Tensor)  # the sum is made in c's piece: one value crosses to the head


def test_the_tracer_leaves_the_module_as_it_was():
    model, x = LongSkip(), torch.randn(5, 8)
    traced_blocks(model, x)
    assert all("forward" not in m.__dict__ for m in model.modules())  # pipeline() patched the split points
    assert isinstance(model(x), torch.Tensor)


def test_an_untraceable_module_is_one_line_with_the_fix():
    from tests.gallery import untraceable

    with pytest.raises(PartrainError, match=r"torch.export cannot trace it whole .*return \(model, blocks\)"):
        traced_blocks(untraceable((1, 28, 28), 10), torch.randn(4, 1, 28, 28))


def test_the_profile_of_a_plain_module_has_its_pieces_and_its_pipelines_are_predicted(two_cores_hw):
    prof = profile_model("tests.gallery:traced", "mnist", [8, 32], threads=1, synthetic=True)
    assert [b.name for b in prof.blocks] == ["stem", "layers.0", "layers.1", "layers.2", "norm", "head"]
    assert all(len(b.fwd_s) == 2 and min(b.fwd_s) > 0 for b in prof.blocks)
    # a layer's piece sends its [B, W, T] activations: 16 x 28 floats a sample
    assert prof.blocks[1].out_bytes == [8 * 16 * 28 * 4, 32 * 16 * 28 * 4]
    gpipe = predict_plan(prof, two_cores_hw, Plan("gpipe", workers=2, batch_size=32, microbatches=4, schedule="gpipe",
                                                  pp=2, threads=1))
    serial = predict_plan(prof, two_cores_hw, Plan("serial", workers=1, batch_size=32, threads=1))
    assert gpipe.seconds_per_step > 0 and serial.seconds_per_step > 0


@pytest.fixture(scope="module")
def two_cores_hw():
    return dataclasses.replace(load_cluster(EXAMPLE_CLUSTER), cores_per_node=2, workers_per_node=2, nodes=1)
