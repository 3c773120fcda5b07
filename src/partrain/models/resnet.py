"""ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition").

Images of 64 px and more get torchvision's ``resnet18/50/152`` exactly (v1.5: the bottleneck
downsamples in its 3x3 conv; 7x7 stride-2 stem and max-pool). Smaller images (MNIST, CIFAR)
get the usual CIFAR variant (as in kuangliu/pytorch-cifar): a 3x3 stride-1 stem without
max-pool, so a 32x32 input reaches layer4 at 4x4; ResNet-18 then has 11,173,962 parameters
on CIFAR-10.

Blocks: ``stem``, one child per residual block (``layer1_0`` ... ``layer4_{n-1}``), ``head``
(global average pool, flatten, fc). Activations are not in-place, so a block never
overwrites a tensor that a previous pipeline stage handed over.
"""

from collections import OrderedDict

import torch
import torch.nn as nn

from partrain.models._common import image_shape, init_like_torchvision, is_small


def _downsample(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """The projection shortcut (1x1 conv + BN) where the shape changes, else identity (None)."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_channels, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus the residual (ResNet-50+)."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1):
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _resnet(
    name: str,
    block: type[BasicBlock | Bottleneck],
    depths: tuple[int, int, int, int],
    input_shape: tuple[int, ...],
    num_classes: int,
) -> nn.Sequential:
    channels, height, width = image_shape(input_shape, name)
    small = is_small(height, width)
    if small:
        conv = nn.Conv2d(channels, 64, 3, padding=1, bias=False)
    else:
        conv = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    stem = OrderedDict(conv=conv, bn=nn.BatchNorm2d(64), relu=nn.ReLU())
    if not small:
        stem["pool"] = nn.MaxPool2d(3, stride=2, padding=1)

    blocks = OrderedDict(stem=nn.Sequential(stem))
    in_channels = 64
    for stage, (planes, depth) in enumerate(zip((64, 128, 256, 512), depths), 1):
        for i in range(depth):
            stride = 2 if stage > 1 and i == 0 else 1
            blocks[f"layer{stage}_{i}"] = block(in_channels, planes, stride)
            in_channels = planes * block.expansion
    blocks["head"] = nn.Sequential(
        OrderedDict(
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            fc=nn.Linear(in_channels, num_classes),
        )
    )
    model = nn.Sequential(blocks)
    init_like_torchvision(model)
    return model


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """ResNet-18: 8 basic blocks, 10 pipeline blocks."""
    return _resnet("resnet18", BasicBlock, (2, 2, 2, 2), input_shape, num_classes)


def resnet50(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """ResNet-50: 16 bottleneck blocks, 18 pipeline blocks."""
    return _resnet("resnet50", Bottleneck, (3, 4, 6, 3), input_shape, num_classes)


def resnet152(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """ResNet-152: 50 bottleneck blocks, 52 pipeline blocks."""
    return _resnet("resnet152", Bottleneck, (3, 8, 36, 3), input_shape, num_classes)
