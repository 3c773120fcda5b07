"""Multi-layer perceptron: the fully connected net of the student reports (784-256-128-10)."""

from collections import OrderedDict
from math import prod

import torch.nn as nn

from partrain.errors import PartrainError

_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    activation: str = "relu",
    hidden: tuple[int, ...] = (256, 128),
) -> nn.Sequential:
    """Flatten, one Linear + activation per ``hidden`` width, then a Linear to the classes.

    Blocks: one per Linear layer, ``fc1`` (which also flattens the input) to ``fc{len(hidden)+1}``;
    235,146 parameters on MNIST. No BatchNorm or dropout, so parallel and serial training can be
    compared for exact equality. Init: He normal (He et al. 2015; fan_in, ReLU) for ReLU hidden
    layers, Xavier uniform (Glorot & Bengio 2010) for the output layer and for every layer of the
    sigmoid variant; biases zero.
    """
    if len(input_shape) == 1:  # partrain's 1-D inputs are token ids, not features to multiply
        raise PartrainError(f"model 'mlp' reads images, got token sequences of shape {tuple(input_shape)}: "
                            "train --model gpt on them, or your own model with an embedding")
    if activation not in _ACTIVATIONS:
        raise PartrainError(
            f"mlp: unknown activation {activation!r}; choose one of {', '.join(_ACTIVATIONS)}"
        )
    if isinstance(hidden, int):
        hidden = (hidden,)
    if not isinstance(hidden, (list, tuple)) or not all(isinstance(h, int) and h > 0 for h in hidden):
        raise PartrainError(f"mlp: hidden must be a list of positive layer widths, got {hidden!r}")

    widths = (prod(input_shape), *hidden, num_classes)
    blocks = OrderedDict()
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:]), 1):
        is_output = i == len(widths) - 1
        layers = OrderedDict(flatten=nn.Flatten()) if i == 1 else OrderedDict()
        layers["linear"] = linear = nn.Linear(n_in, n_out)
        if activation == "relu" and not is_output:
            nn.init.kaiming_normal_(linear.weight, mode="fan_in", nonlinearity="relu")
        else:
            nn.init.xavier_uniform_(linear.weight)
        nn.init.zeros_(linear.bias)
        if not is_output:
            layers["act"] = _ACTIVATIONS[activation]()
        blocks[f"fc{i}"] = nn.Sequential(layers)
    return nn.Sequential(blocks)
