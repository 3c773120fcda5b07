"""--precision, --channels-last, --compile and the device-agnostic data path, on the CPU.

bf16 autocast runs on the CPU, so its behaviour is tested here: a serial run trains, and
2-worker ddp and gpipe runs in bf16 reproduce the bf16 serial run to within bf16's
rounding (its unit roundoff is 2^-8 = 0.4%; the tolerance below is 2% of the loss, a few
roundings accumulated over 10 steps, while a wrong gradient or a missed autocast is off by
far more). The CUDA side (fp16 with its scaler, data on the GPU, the prefetcher) is
tests/test_gpu.py.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from partrain.config import RunConfig
from partrain.data import load_dataset
from partrain.data.feed import Feed, place
from partrain.data.synthetic import _splitmix64, splitmix64_torch
from partrain.errors import PartrainError
from partrain.models import build_model
from partrain.runner import run_training
from partrain.strategies.precision import Amp, amp_for, autocast_for, fsdp_policy

STEPS = 10


def train(data_dir, **kw):
    base = dict(data_dir=str(data_dir), threads=1, steps=STEPS, batch_size=64, evaluate=False, timeout_s=60)
    return run_training(RunConfig(**{**base, **kw}), show_progress=False)


def _close(losses, reference, rel: float):
    a, b = torch.tensor(losses), torch.tensor(reference)
    assert len(a) == len(b) == STEPS
    worst = (a - b).abs().div(b.abs()).max().item()
    assert worst <= rel, f"per-step losses differ by {worst:.2e} (relative), more than {rel}"


@pytest.fixture(scope="module")
def bf16_serial(data_dir):
    return train(data_dir, model="mlp", precision="bf16")


def test_bf16_serial_trains_and_differs_from_fp32_only_by_rounding(data_dir, bf16_serial):
    fp32 = train(data_dir, model="mlp")
    losses = bf16_serial.step_losses
    assert losses[-1] < 0.8 * losses[0]  # it learns
    assert losses != fp32.step_losses  # autocast did run in bf16 ...
    _close(losses, fp32.step_losses, rel=0.02)  # ... and only rounded differently


@pytest.mark.multiproc
@pytest.mark.parametrize("overrides", [dict(strategy="ddp", workers=2),
                                       dict(strategy="gpipe", workers=2, microbatches=2)], ids=["ddp", "gpipe"])
def test_bf16_two_workers_equal_bf16_serial(data_dir, bf16_serial, overrides):
    run = train(data_dir, model="mlp", precision="bf16", **overrides)
    _close(run.step_losses, bf16_serial.step_losses, rel=0.02)


@pytest.mark.multiproc
def test_bf16_fsdp_uses_its_mixed_precision_policy_and_trains(data_dir, bf16_serial):
    run = train(data_dir, model="mlp", precision="bf16", strategy="fsdp", workers=2)
    _close(run.step_losses, bf16_serial.step_losses, rel=0.02)


def test_fp16_is_refused_on_cpu_with_one_line(data_dir):
    with pytest.raises(PartrainError, match=r"^--precision fp16 needs a CUDA device; use bf16 on CPU$"):
        train(data_dir, model="mlp", precision="fp16", backend="gloo")
    with pytest.raises(PartrainError, match="fp16 needs a CUDA device"):
        amp_for(RunConfig(precision="fp16"), torch.device("cpu"), autocasts_itself=False, lockstep=False)


def test_precision_pieces_for_fp32_and_bf16():
    cpu = torch.device("cpu")
    fp32, bf16 = RunConfig(), RunConfig(precision="bf16")
    assert fsdp_policy(fp32) is None and amp_for(fp32, cpu, False, False).scaler is None
    policy = fsdp_policy(bf16)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    lin = torch.nn.Linear(4, 4)
    with autocast_for(bf16, cpu):
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast_for(fp32, cpu):
        assert lin(torch.randn(2, 4)).dtype == torch.float32
    stepped = amp_for(bf16, cpu, autocasts_itself=True, lockstep=False)  # FSDP or a pipeline stage casts
    with stepped.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.float32
    assert Amp().state_dict() == {}


def test_resume_may_change_precision_and_says_so(data_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    kw = dict(model="mlp", limit=640, epochs=2, steps=None)
    train(data_dir, checkpoint=str(ckpt), epochs=1, **{k: v for k, v in kw.items() if k != "epochs"})
    saved = torch.load(ckpt / (ckpt / "LATEST").read_text() / "rank0.pt", weights_only=True)
    assert saved["scaler"] == {}  # no scaler outside fp16
    resumed = train(data_dir, resume=str(ckpt), precision="bf16", **kw)
    assert "precision fp32 -> bf16" in capsys.readouterr().err
    assert len(resumed.step_losses) == 20 and resumed.step_losses[-1] < resumed.step_losses[0]


def test_channels_last_changes_layout_not_numbers(data_dir):
    plain = train(data_dir, model="cnn")
    nhwc = train(data_dir, model="cnn", channels_last=True)
    _close(nhwc.step_losses, plain.step_losses, rel=1e-4)
    model = build_model("cnn", (1, 28, 28), 10).to(memory_format=torch.channels_last)
    conv = next(p for p in model.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    feed = Feed(load_dataset("mnist", "test", data_dir=data_dir, limit=8), torch.device("cpu"), channels_last=True)
    assert feed.get(torch.arange(4))[0].is_contiguous(memory_format=torch.channels_last)
    tokens = Feed(load_dataset("tokens", "test", limit=8), torch.device("cpu"), channels_last=True)
    assert tokens.get(torch.arange(4))[0].shape == (4, 64)  # not 4-D: left as it is


def test_synthetic_labels_are_the_splitmix_labels_on_any_device():
    i = np.arange(0, 10**6, 997, dtype=np.uint64)
    for state in (0, 2**63 + 5, 2**64 - 1):
        assert (splitmix64_torch(state, torch.from_numpy(i.astype(np.int64))).numpy().view(np.uint64)
                == _splitmix64(state, i)).all()
    ds = load_dataset("cifar10", "train", synthetic=True, seed=3)
    idx = torch.tensor([0, 5, 49_999])
    state = ds._state
    expected = (_splitmix64(state, 2 * idx.numpy().astype(np.uint64)) % np.uint64(10)).astype(np.int64)
    assert ds.get(idx)[1].tolist() == expected.tolist()  # the labels partrain always gave


def test_synthetic_batches_are_a_pure_function_of_the_index():
    ds = load_dataset("imagenet", "train", seed=1)
    idx = torch.tensor([3, 1_281_166, 17])
    x, y = ds.get(idx)
    moved = ds.to(torch.device("cpu"))  # the device path's code, on the CPU
    for k, i in enumerate(idx.tolist()):
        xi, yi = moved.get(torch.tensor([i]))
        assert torch.equal(xi[0], x[k]) and yi[0] == y[k]
    assert not torch.equal(x[0], x[2])
    noise = x - torch.nn.functional.interpolate(ds._templates[y], size=(224, 224), mode="bilinear", align_corners=False)
    assert 0.9 < noise.std().item() < 1.1  # NOISE_STD
    assert place(ds, torch.device("cpu")) is ds  # on a CPU nothing moves


def test_dataset_to_device_keeps_values_and_skips_the_host_check(data_dir):
    ds = load_dataset("mnist", "test", data_dir=data_dir, limit=100)
    moved = ds.to(torch.device("cpu"))
    assert moved is not ds and ds.device_bytes() == 5 * 100 * 28 * 28 + 100 * 8  # bytes, float32 and labels
    idx = torch.tensor([4, 0, 99])
    for a, b in zip(ds.get(idx), moved.get(idx), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(IndexError):
        ds.get(torch.tensor([100]))


def _needs_inductor():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile (inductor) needs a C compiler on the CPU")
    try:
        torch.compile(lambda t: t * 2)(torch.ones(2))
    except Exception as err:  # noqa: BLE001 - any failure of the toolchain is a skip, not a defect here
        pytest.skip(f"inductor unavailable: {type(err).__name__}")


@pytest.mark.slow
def test_compile_gives_the_eager_losses(data_dir):
    _needs_inductor()
    from torch._dynamo.utils import counters

    eager = train(data_dir, model="mlp")
    torch._dynamo.reset()  # an earlier compile of the same architecture in this process would be reused: 0 new graphs
    counters.clear()
    compiled = train(data_dir, model="mlp", compile=True)  # one worker: in this process
    _close(compiled.step_losses, eager.step_losses, rel=1e-4)
    # the whole model one graph, as torch.compile(model) makes: Module.compile() made none for
    # this Sequential of torch layers (Dynamo skips torch's own frames), so nothing was compiled
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_a_compiled_forward_is_the_modules_own_and_its_copys():
    import copy

    from partrain.strategies.base import compile_forward

    _needs_inductor()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x, eager = torch.randn(3, 4), None
    eager = model(x)
    compile_forward(model)
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no _orig_mod. prefix
    torch.testing.assert_close(model(x), eager)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.equal(twin(x), torch.zeros(3, 2))  # the copy runs its own (zeroed) weights
    torch.testing.assert_close(model(x), eager)


IMAGE = dict(dataset="mnist", synthetic=True, limit=1024)
SLOW_CASES = [  # (model, data, strategy options): each equals its bf16 serial run to bf16 rounding
    ("tests.gallery:traced", IMAGE, dict(strategy="gpipe", workers=2, microbatches=2)),  # the tracer's stages
    ("tests.gallery:tied", dict(dataset="tokens@16", limit=1024, lr=0.5), dict(strategy="1f1b", workers=2, microbatches=2)),
    ("mlp", {}, dict(strategy="hybrid", workers=2, pp=1, dp=2)),  # FSDP's policy on a replicated stage
    ("cnn", {}, dict(strategy="fsdp", workers=2, channels_last=True)),  # FSDP keeps its parameters contiguous
]
# local-sgd and hogwild step through the same Stepper as ddp, and hybrid 2x1 through gpipe's stages


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model,data,overrides", SLOW_CASES, ids=["traced-gpipe", "tied-1f1b", "hybrid-1x2", "cnn-fsdp-nhwc"])
def test_bf16_pipelines_and_fsdp_policy_equal_bf16_serial(data_dir, model, data, overrides):
    run = train(data_dir, model=model, precision="bf16", **data, **overrides)
    assert run.step_losses[-1] < run.step_losses[0]
    _close(run.step_losses, train(data_dir, model=model, precision="bf16", **data).step_losses, rel=0.02)


def test_batchnorm_keeps_float32_parameters_under_fsdps_bf16_policy():
    """bf16 FSDP casts a block's parameters to bf16, but a BatchNorm's stay float32 (its own
    unit): CUDA's batch norm refuses bf16 weights beside float32 running statistics."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from partrain.strategies.precision import shard_norms_in_float32

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        model = torch.nn.Sequential(block, torch.nn.Flatten(), torch.nn.LazyLinear(2))
        model(torch.randn(2, 3, 6, 6))  # materialize the lazy layer
        seen = {}
        for name, m in model.named_modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear)):
                m.register_forward_hook(lambda mod, args, out, n=name: seen.update({n: (mod.weight.dtype, args[0].dtype, out.dtype)}))
        policy = fsdp_policy(RunConfig(model="cnn", precision="bf16"))
        shard_norms_in_float32(model, mesh, policy)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model(torch.randn(2, 3, 6, 6)).float().sum().backward()
        bf16, f32 = torch.bfloat16, torch.float32
        assert seen == {"0.0": (bf16, bf16, bf16), "0.1": (f32, bf16, bf16), "2": (bf16, bf16, bf16)}
        norm = model[0][1]
        assert norm.running_mean.dtype == f32 and norm.weight.grad.dtype == f32
        frozen = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3).requires_grad_(False))
        shard_norms_in_float32(frozen, mesh, policy)  # FSDP casts frozen parameters too: they need a unit as well
        fully_shard(frozen, mesh=mesh, mp_policy=policy)
        assert frozen(torch.randn(4, 3)).dtype == bf16
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("model,overrides", [
    ("tests.gallery:bn_blocks", dict(strategy="fsdp", workers=2)),  # a BatchNorm that is a block: one unit, not two
    ("tests.gallery:traced_bn", dict(strategy="hybrid", workers=4, pp=2, dp=2, microbatches=2)),
], ids=["fsdp-bn-block", "traced-hybrid-2x2"])
def test_bf16_batchnorm_models_train_under_fsdp_and_hybrid(data_dir, model, overrides):
    """BatchNorm at bf16 where FSDP holds it: its own float32 unit (even as a whole block), and
    for a plain module, whose BatchNorm the tracer folds into graphs, float32 replicas with autocast.
    (Each worker's BatchNorm sees its own rows, so these do not equal serial step for step.)"""
    run = train(data_dir, model=model, synthetic=True, limit=1024, precision="bf16", **overrides)
    assert len(run.step_losses) == STEPS and run.step_losses[-1] < 0.8 * run.step_losses[0]
