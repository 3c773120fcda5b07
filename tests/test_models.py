"""The model zoo, its parameter counts and pipeline blocks, and user factories."""

import pytest
import torch
import torch.nn as nn

from partrain.errors import PartrainError
from partrain.models import build_model, count_parameters, list_models, model_blocks

ZOO = ["mlp", "cnn", "resnet18", "resnet50", "resnet152", "vgg11", "vgg16", "mobilenetv2"]
SMALL_INPUTS = [(1, 28, 28), (3, 32, 32)]


def build_on_meta(name, input_shape, num_classes):
    """Build without allocating or initializing weights: counting parameters needs neither."""
    with torch.device("meta"):
        return build_model(name, input_shape, num_classes)


def test_list_models_is_the_zoo():
    assert list_models() == [*ZOO, "gpt"]  # image models, then the token model


def test_gpt_is_causal_and_sized_by_options():
    import torch

    model = build_model("gpt", (16,), 256, layers=3, d_model=32, heads=4, context=32)
    assert len(model_blocks(model)) == 5  # embed, 3 blocks, head
    ids = torch.randint(0, 256, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 256)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256  # a different future leaves the past's logits alone
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


@pytest.mark.parametrize("shape,options,message", [
    ((1, 28, 28), {}, "needs token sequences"),
    ((16,), dict(d_model=30, heads=4), "multiple of heads"),
    ((16,), dict(context=8), "shorter than the dataset"),
])
def test_gpt_refuses_bad_sizes(shape, options, message):
    with pytest.raises(PartrainError, match=message):
        build_model("gpt", shape, 256, **options)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("resnet18", 11_689_512),
        ("resnet50", 25_557_032),
        ("resnet152", 60_192_808),
        ("vgg11", 132_863_336),
        ("vgg16", 138_357_544),
        ("mobilenetv2", 3_504_872),
    ],
)
def test_imagenet_parameter_counts_match_torchvision(name, expected):
    assert count_parameters(build_on_meta(name, (3, 224, 224), 1000)) == expected


def test_cifar_resnet18_parameter_count():
    assert count_parameters(build_on_meta("resnet18", (3, 32, 32), 10)) == 11_173_962


def test_mlp_on_mnist():
    model = build_model("mlp", (1, 28, 28), 10)
    assert count_parameters(model) == 235_146
    assert len(model_blocks(model)) == 3
    assert any(isinstance(m, nn.ReLU) for m in model.modules())
    assert not any(isinstance(m, nn.Sigmoid) for m in model.modules())
    assert list(model.state_dict())[:2] == ["fc1.linear.weight", "fc1.linear.bias"]
    assert torch.count_nonzero(model.fc3.linear.bias) == 0


def test_mlp_options():
    model = build_model("mlp", (1, 28, 28), 10, activation="sigmoid", hidden=(64,))
    assert any(isinstance(m, nn.Sigmoid) for m in model.modules())
    assert not any(isinstance(m, nn.ReLU) for m in model.modules())
    assert len(model_blocks(model)) == 2
    with pytest.raises(PartrainError, match="activation 'tanh'"):
        build_model("mlp", (1, 28, 28), 10, activation="tanh")


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_exact_equality_models_have_no_batchnorm_or_dropout(name):
    model = build_model(name, (1, 28, 28), 10)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in model.modules())


def test_cnn_blocks_and_ocr_letters():
    model = build_model("cnn", (1, 16, 8), 26)
    assert list(dict(model.named_children())) == ["conv1", "conv2", "fc1", "fc2"]
    assert model(torch.randn(2, 1, 16, 8)).shape == (2, 26)


@pytest.mark.parametrize("input_shape", SMALL_INPUTS)
@pytest.mark.parametrize("name", ZOO)
def test_forward_shape_and_blocks_compose_to_the_model(name, input_shape):
    torch.manual_seed(0)
    model = build_model(name, input_shape, 10).eval()
    x = torch.randn(2, *input_shape)
    with torch.no_grad():
        expected = model(x)
        out = x
        for block in model_blocks(model):
            out = block(out)
    assert expected.shape == (2, 10)
    assert torch.equal(out, expected)


def test_resnet18_imagenet_forward():
    model = build_model("resnet18", (3, 224, 224), 1000).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_variant_follows_input_size():
    assert "pool" in dict(build_on_meta("resnet18", (3, 224, 224), 1000).stem.named_children())
    assert "pool" not in dict(build_on_meta("resnet18", (3, 32, 32), 10).stem.named_children())
    assert build_on_meta("mobilenetv2", (3, 32, 32), 10).stem.conv.stride == (1, 1)
    assert build_on_meta("mobilenetv2", (3, 512, 512), 10).stem.conv.stride == (2, 2)


def test_user_factory_with_blocks():
    model = build_model("tests.userfactory:build", (1, 28, 28), 10, width=8)
    blocks = model_blocks(model)
    assert blocks == [model.body, model.head]
    # The blocks are not registered a second time.
    assert count_parameters(model) == (784 * 8 + 8) + (8 * 10 + 10)
    assert list(model.state_dict()) == ["body.1.weight", "body.1.bias", "head.weight", "head.bias"]
    x = torch.randn(2, 1, 28, 28)
    out = x
    for block in blocks:
        out = block(out)
    assert torch.equal(out, model(x))


def test_a_factory_with_positional_only_parameters_gets_them_by_position():
    model = build_model("tests.userfactory:positional_only", (1, 28, 28), 10, width=4)
    assert model[1].out_features == 4 and model[3].out_features == 10
    model = build_model("tests.userfactory:positional_only_open", (1, 28, 28), 10, width=5)  # and **options
    assert model[1].out_features == 5 and model[3].out_features == 10


def test_user_factory_without_arguments_is_called_bare():
    model = build_model("tests.userfactory:no_arguments", (1, 28, 28), 10)
    assert len(model_blocks(model)) == 2


def test_non_sequential_model_without_blocks_is_one_block():
    model = build_model("tests.userfactory:TwoPart", (1, 28, 28), 10, in_features=784, width=8)
    assert model_blocks(model) == [model]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("resnet19", "unknown model 'resnet19'.*resnet18.*package.module:function"),
        ("tests.no_such_module:build", "cannot import module 'tests.no_such_module'"),
        ("tests.userfactory:missing", "has no attribute 'missing'"),
        ("tests.userfactory:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
        ("tests.userfactory:not_a_module", "returned a dict, not an nn.Module"),
        ("tests.userfactory:foreign_blocks", "blocks must be .* submodules"),
        ("tests.userfactory:other_names", "its factory needs 'shape', which partrain does not pass: it passes input_shape"),
        ("tests.userfactory:", "package.module:function"),
    ],
)
def test_bad_model_names_raise_one_clear_error(spec, message):
    with pytest.raises(PartrainError, match=message) as err:
        build_model(spec, (1, 28, 28), 10)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, source, message", [
    ("umod_syntax", "def f(:\n", r"module 'umod_syntax' has a syntax error \(umod_syntax.py:1: invalid syntax\)"),
    ("umod_raises", "raise RuntimeError('boom')\n", r"importing module 'umod_raises' raised RuntimeError: boom"),
    ("umod_exits", "import sys\nsys.exit(4)\n", r"importing module 'umod_exits' called sys.exit\(4\)"),
    ("umod_needs", "import nonexistent_pkg_xyz\n",
     r"module 'umod_needs' was found, but its own import of 'nonexistent_pkg_xyz' failed"),
])
def test_a_user_module_that_fails_as_it_is_imported_is_one_line(tmp_path, monkeypatch, name, source, message):
    """Its own code's fault, told apart from a module not found (an audit: tracebacks, and a
    silent exit with status 4)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PartrainError, match=message) as err:
        build_model(f"{name}:f", (1, 28, 28), 10)
    assert "\n" not in str(err.value)


def test_a_model_without_trainable_parameters_is_refused(tmp_path, monkeypatch):
    from partrain.models.check import checked_model

    (tmp_path / "umod_noparams.py").write_text("import torch.nn as nn\ndef f():\n    return nn.Sequential(nn.Flatten(), nn.Identity())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PartrainError, match="'umod_noparams:f' has no trainable parameters"):
        checked_model("umod_noparams:f", (1, 10), 10, {})


@pytest.mark.parametrize("factory, message", [
    ("blocks_skip_activations", r"its forward runs module '2' \(Tanh\) 1 time\(s\), the blocks its factory returned 0"),
    ("blocks_leave_a_parameter_out", "parameter scale is in none of the blocks"),
    ("blocks_miss_the_forwards_reshape", r"block 0 \(Linear\) of the blocks its factory returned failed on input \(2, 1, 28, 28\)"),
])
def test_blocks_that_do_not_compute_the_forward_are_refused(factory, message):
    """Pipelines train the blocks: ones that are not the model would train another network."""
    from partrain.models.check import checked_model

    with pytest.raises(PartrainError, match=message):
        checked_model(f"tests.userfactory:{factory}", (1, 28, 28), 10, {})
    checked_model("tests.userfactory:build", (1, 28, 28), 10, {})  # blocks that are the forward pass
    checked_model("tests.userfactory:blocks_with_a_spare_head", (1, 28, 28), 10, {})  # what forward never uses


@pytest.mark.parametrize("options, message", [
    (dict(layers="abc"), "gpt: layers must be a whole number >= 1, got 'abc'"),  # a traceback, before
    (dict(layers=[1]), r"layers must be a whole number >= 1, got \[1\]"),
    (dict(layers=2.5), "layers must be a whole number >= 1, got 2.5"),  # cut to 2 silently, before
    (dict(layers=0), "layers must be a whole number >= 1, got 0"),
    (dict(tie="maybe"), "tie must be true or false, got 'maybe'"),  # taken as true, before
])
def test_a_gpt_option_of_the_wrong_type_is_one_line(options, message):
    with pytest.raises(PartrainError, match=message):
        build_model("gpt", (16,), 256, **options)
    assert build_model("gpt", (16,), 256, tie=1, layers=1) is not None  # 1 and 0 stand for true and false


def test_unknown_options_raise():
    with pytest.raises(PartrainError, match="'resnet18' has no option 'activation'; its options are: none"):
        build_model("resnet18", (3, 32, 32), 10, activation="relu")
    with pytest.raises(PartrainError, match="no option 'depth'; its options are: activation, hidden"):
        build_model("mlp", (1, 28, 28), 10, depth=3)
    with pytest.raises(PartrainError, match="no option 'depth'"):
        build_model("tests.userfactory:build", (1, 28, 28), 10, depth=3)


def test_bad_shapes_raise():
    with pytest.raises(PartrainError, match=r"needs an image input_shape \(C, H, W\)"):
        build_model("cnn", (784,), 10)
    with pytest.raises(PartrainError, match="input_shape"):
        build_model("mlp", (1, 0, 28), 10)
    with pytest.raises(PartrainError, match="num_classes"):
        build_model("mlp", (1, 28, 28), 0)
