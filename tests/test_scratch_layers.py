"""partrain.scratch's hand-written forward and backward, held against torch autograd in
float64 value by value, and against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from partrain.scratch.layers import Linear, ReLU, Sigmoid, SoftmaxCrossEntropy, he_normal, xavier_uniform
from partrain.scratch.net import SGD, Net, cut, flatten, mlp

TOL = dict(rtol=1e-12, atol=1e-12)


def _t(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_linear_forward_and_backward_match_autograd(rng):
    layer = Linear(5, 3, np.float64)
    layer.W[...], layer.bias[...] = rng.normal(size=(3, 5)), rng.normal(size=3)
    a, gb = rng.normal(size=(4, 5)), rng.normal(size=(4, 3))
    ta, tW, tbias = _t(a, True), _t(layer.W, True), _t(layer.bias, True)
    tb = F.linear(ta, tW, tbias)
    tb.backward(_t(gb))

    np.testing.assert_allclose(layer.forward(a), tb.detach().numpy(), **TOL)
    np.testing.assert_allclose(layer.backward(gb), ta.grad.numpy(), **TOL)
    np.testing.assert_allclose(layer.gW, tW.grad.numpy(), **TOL)
    np.testing.assert_allclose(layer.gbias, tbias.grad.numpy(), **TOL)


@pytest.mark.parametrize("layer, fn", [(ReLU(), torch.relu), (Sigmoid(), torch.sigmoid)])
def test_activations_match_autograd(rng, layer, fn):
    a = rng.normal(scale=3.0, size=(6, 7))
    a[0, :3] = [-800.0, 800.0, 0.5]  # sigmoid far out on both sides: no overflow, no nan
    gb = rng.normal(size=a.shape)
    ta = _t(a, True)
    tb = fn(ta)
    tb.backward(_t(gb))
    np.testing.assert_allclose(layer.forward(a), tb.detach().numpy(), **TOL)
    np.testing.assert_allclose(layer.backward(gb), ta.grad.numpy(), **TOL)


@pytest.mark.parametrize("total", [None, 10])
def test_softmax_cross_entropy_matches_autograd(rng, total):
    z, y = rng.normal(scale=5.0, size=(4, 6)), rng.integers(0, 6, 4)
    z[0, 0] = 1000.0  # the log-sum-exp shift keeps a huge logit finite
    tz = _t(z, True)
    tloss = F.cross_entropy(tz, torch.from_numpy(y), reduction="sum") / (total or len(y))
    tloss.backward()
    ce = SoftmaxCrossEntropy()
    assert ce.forward(z, y, total) == pytest.approx(tloss.item(), rel=1e-13)
    np.testing.assert_allclose(ce.backward(), tz.grad.numpy(), **TOL)


def test_evaluate_sums_the_test_loss_and_the_right_answers_as_torch_does(rng):
    from partrain.scratch.local import evaluate

    net = Net(flatten(mlp((6, 5, 4), "relu", np.float64, seed=0)), np.float64)
    x, y = rng.standard_normal((23, 6)), rng.integers(0, 4, 23)
    loss, right = evaluate(net, x, y, chunk=5)  # five chunks, the last of 3 rows
    logits = torch.from_numpy(net.forward(x))
    assert loss == pytest.approx(F.cross_entropy(logits, torch.from_numpy(y), reduction="sum").item(), rel=1e-12)
    assert right == int((logits.argmax(1).numpy() == y).sum())


@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_the_whole_mlp_matches_torch_step_by_step(rng, activation):
    """Forward, loss, every gradient and three SGD-with-momentum steps, against torch.nn and torch.optim."""
    blocks = mlp((12, 8, 6, 4), activation, np.float64, seed=3)
    net = Net(flatten(blocks), np.float64)
    act = {"relu": torch.nn.ReLU, "sigmoid": torch.nn.Sigmoid}[activation]
    linears = [layer for layer in net.layers if isinstance(layer, Linear)]
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), act(), torch.nn.Linear(8, 6), act(), torch.nn.Linear(6, 4)).double()
    with torch.no_grad():
        for mine, theirs in zip(linears, model[::2]):
            theirs.weight.copy_(torch.from_numpy(mine.W))
            theirs.bias.copy_(torch.from_numpy(mine.bias))
    opt, topt = SGD(net, lr=0.1, momentum=0.9), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x, y = rng.normal(size=(5, 12)), rng.integers(0, 4, 5)
        ce = SoftmaxCrossEntropy()
        loss = ce.forward(net.forward(x), y)
        net.backward(ce.backward())
        topt.zero_grad()
        tloss = F.cross_entropy(model(_t(x)), torch.from_numpy(y))
        tloss.backward()
        assert loss == pytest.approx(tloss.item(), rel=1e-13)
        for mine, theirs in zip(linears, model[::2]):
            np.testing.assert_allclose(mine.gW, theirs.weight.grad.numpy(), **TOL)
            np.testing.assert_allclose(mine.gbias, theirs.bias.grad.numpy(), **TOL)
        opt.step()
        topt.step()
        for mine, theirs in zip(linears, model[::2]):
            np.testing.assert_allclose(mine.W, theirs.weight.detach().numpy(), **TOL)


@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_gradients_match_finite_differences(rng, activation):
    """Every weight's gradient against the central difference (L(w+h) - L(w-h)) / 2h, error O(h^2)."""
    net = Net(flatten(mlp((6, 5, 4, 3), activation, np.float64, seed=1)), np.float64)
    x, y = rng.normal(size=(4, 6)), rng.integers(0, 3, 4)
    ce = SoftmaxCrossEntropy()

    def loss() -> float:
        return ce.forward(net.forward(x), y)

    loss()
    net.backward(ce.backward())
    analytic, numeric, h = net.grads.copy(), np.zeros_like(net.grads), 1e-6
    for i in range(net.params.size):
        keep = net.params[i]
        net.params[i] = keep + h
        up = loss()
        net.params[i] = keep - h
        numeric[i] = (up - loss()) / (2 * h)
        net.params[i] = keep
    assert np.abs(analytic).max() > 1e-3  # the check is not vacuous
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)


def test_the_mnist_mlp_has_235146_parameters_and_flat_views():
    net = Net(flatten(mlp((784, 256, 128, 10))), np.float32)
    assert net.params.size == 235_146 and net.params.dtype == np.float32
    first = net.layers[0]
    assert np.shares_memory(first.W, net.params) and np.shares_memory(first.gW, net.grads)


def test_a_replica_reads_the_same_weights_and_writes_its_own_gradients(rng):
    net = Net(flatten(mlp((6, 5, 3), seed=2)), np.float64)
    twin = net.replica()
    x, y = rng.normal(size=(4, 6)), rng.integers(0, 3, 4)
    ce = SoftmaxCrossEntropy()
    ce.forward(twin.forward(x), y)
    twin.backward(ce.backward())
    assert twin.params is net.params
    assert np.abs(twin.grads).sum() > 0 and not net.grads.any()
    net.params += 1.0
    np.testing.assert_array_equal(twin.layers[0].W, net.layers[0].W)


def test_he_and_xavier_have_their_published_spread():
    rng = np.random.default_rng(0)
    layer = Linear(784, 256, np.float64)
    he_normal(layer, rng)
    assert layer.W.std() == pytest.approx(np.sqrt(2 / 784), rel=0.02) and not layer.bias.any()
    xavier_uniform(layer, rng)
    bound = np.sqrt(6 / (784 + 256))
    assert np.abs(layer.W).max() <= bound and np.abs(layer.W).max() > 0.99 * bound
    assert layer.W.std() == pytest.approx(bound / np.sqrt(3), rel=0.02)  # U(-r, r) has std r / sqrt(3)


def test_cut_balances_stages_by_parameters():
    blocks = mlp((784, 256, 128, 10))
    stages = cut(blocks, 2)
    assert [len(s) for s in stages] == [2, 3]  # [fc1, relu] | [fc2, relu, fc3]
    assert [len(s) for s in cut(blocks, 3)] == [2, 2, 1]
    with pytest.raises(Exception, match="model-parallel: 4 stages for 3 layers"):
        cut(blocks, 4)


def test_the_phase_means_leave_out_the_first_steps():
    """The first step's start-up is no phase of a steady step: with 3 steps it made the phase
    means four times the median step beside them (a review)."""
    from partrain.scratch.local import Timeline

    timeline = Timeline()
    timeline.steps = [{"comm": 0.030, "compute": 0.002}] + [{"comm": 0.001, "compute": 0.002}] * 2
    assert timeline.steady_ms() == pytest.approx({"comm": 1.0, "compute": 2.0})
    timeline.steps = [{"comm": 0.030}] * 5 + [{"comm": 0.001}] * 35  # 40 steps: the first 5 left out
    assert timeline.steady_ms() == pytest.approx({"comm": 1.0})
