"""MobileNetV2 (Sandler et al. 2018, "MobileNetV2: Inverted Residuals and Linear Bottlenecks").

Images of 64 px and more get torchvision's ``mobilenet_v2`` exactly (width 1.0, last channel
1280, dropout 0.2). Smaller images (MNIST, CIFAR) get the common CIFAR variant (as in
kuangliu/pytorch-cifar): the stem and the first stride-2 stage (24 channels) use stride 1, so
the net downsamples 8x instead of 32x and a 32x32 input reaches the last conv at 4x4; the
rest, head included, is unchanged.

Blocks: ``stem``, one child per inverted residual (``stage1_0`` ... ``stage7_0``, 17 in all),
``conv_last`` (1x1 to 1280 channels), ``head`` (pool, flatten, dropout, fc): 20 blocks.
"""

from collections import OrderedDict

import torch
import torch.nn as nn

from partrain.models._common import image_shape, init_like_torchvision, is_small

# (expansion t, output channels c, repeats n, first stride s) per stage, Table 2 of the paper.
_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
_LAST_CHANNEL = 1280


def _conv_bn(
    in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1, relu6: bool = True
) -> nn.Sequential:
    """Conv ("same" padding, no bias) + BatchNorm [+ ReLU6]."""
    padding = (kernel - 1) // 2
    layers = OrderedDict(
        conv=nn.Conv2d(in_channels, out_channels, kernel, stride, padding, groups=groups, bias=False),
        bn=nn.BatchNorm2d(out_channels),
    )
    if relu6:
        layers["relu"] = nn.ReLU6()
    return nn.Sequential(layers)


class InvertedResidual(nn.Module):
    """1x1 expand (none when t = 1), 3x3 depthwise, linear 1x1 project; residual if shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int):
        super().__init__()
        hidden = in_channels * expansion
        layers = OrderedDict()
        if expansion != 1:
            layers["expand"] = _conv_bn(in_channels, hidden, 1)
        layers["depthwise"] = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        layers["project"] = _conv_bn(hidden, out_channels, 1, relu6=False)
        self.conv = nn.Sequential(layers)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


def mobilenetv2(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """MobileNetV2, width 1.0; torchvision's on 64 px and more, the CIFAR variant below."""
    channels, height, width = image_shape(input_shape, "mobilenetv2")
    small = is_small(height, width)
    blocks = OrderedDict(stem=_conv_bn(channels, 32, 3, stride=1 if small else 2))
    in_channels = 32
    for stage, (expansion, out_channels, repeats, stride) in enumerate(_STAGES, 1):
        if small and stage == 2:
            stride = 1
        for i in range(repeats):
            block = InvertedResidual(in_channels, out_channels, stride if i == 0 else 1, expansion)
            blocks[f"stage{stage}_{i}"] = block
            in_channels = out_channels
    blocks["conv_last"] = _conv_bn(in_channels, _LAST_CHANNEL, 1)
    blocks["head"] = nn.Sequential(
        OrderedDict(
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            dropout=nn.Dropout(0.2),
            fc=nn.Linear(_LAST_CHANNEL, num_classes),
        )
    )
    model = nn.Sequential(blocks)
    init_like_torchvision(model, linear_std=0.01)
    return model
