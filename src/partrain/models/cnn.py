"""The classic two-convolution baseline CNN of the student reports (MNIST, OCR letters)."""

from collections import OrderedDict

import torch.nn as nn

from partrain.errors import PartrainError
from partrain.models._common import image_shape


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(in_channels, out_channels, 3, padding=1),
            relu=nn.ReLU(),
            pool=nn.MaxPool2d(2),
        )
    )


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Two 3x3 conv + ReLU + 2x2 max-pool stages (32, 64 channels), Linear(64*H/4*W/4 -> 128), Linear.

    Blocks: ``conv1``, ``conv2``, ``fc1`` (flatten, linear, ReLU), ``fc2``. No BatchNorm or dropout,
    so parallel and serial training can be compared for exact equality; PyTorch default init.
    """
    channels, height, width = image_shape(input_shape, "cnn")
    if min(height, width) < 4:
        raise PartrainError(f"cnn needs images of at least 4x4 pixels, got {height}x{width}")
    return nn.Sequential(
        OrderedDict(
            conv1=_conv_block(channels, 32),
            conv2=_conv_block(32, 64),
            fc1=nn.Sequential(
                OrderedDict(
                    flatten=nn.Flatten(),
                    linear=nn.Linear(64 * (height // 4) * (width // 4), 128),
                    relu=nn.ReLU(),
                )
            ),
            fc2=nn.Linear(128, num_classes),
        )
    )
