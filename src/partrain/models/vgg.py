"""VGG (Simonyan & Zisserman 2015, "Very Deep Convolutional Networks"), configurations A and D.

Images of 64 px and more get torchvision's ``vgg11``/``vgg16`` (no BatchNorm) exactly: the
conv stack, AdaptiveAvgPool2d((7, 7)) and the 4096-4096 classifier with dropout. Smaller
images (MNIST, CIFAR, OCR letters) get the common CIFAR variant: the same conv stack, but the
five max-pools use ``ceil_mode`` so that 28x28 (and 16x8) still end at 1x1 instead of
collapsing to 0x0 (32x32 ends at 1x1 either way), then a global average pool and
Linear(512 -> 512)-ReLU-Linear(512 -> classes) without dropout.

Blocks: one child per conv + ReLU (``conv1_1`` ...), one per max-pool (``pool1`` ... ``pool5``),
``avgpool`` (pool + flatten), then one per classifier layer (``fc6``, ``fc7``[, ``fc8``]).
"""

from collections import OrderedDict

import torch.nn as nn

from partrain.models._common import image_shape, init_like_torchvision, is_small

_CONFIGS = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
}


def _linear_relu(in_features: int, out_features: int, dropout: float | None = None):
    layers = OrderedDict(linear=nn.Linear(in_features, out_features), relu=nn.ReLU())
    if dropout is not None:
        layers["dropout"] = nn.Dropout(dropout)
    return nn.Sequential(layers)


def _vgg(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    channels, height, width = image_shape(input_shape, name)
    small = is_small(height, width)
    blocks = OrderedDict()
    stage, index = 1, 1
    for v in _CONFIGS[name]:
        if v == "M":
            blocks[f"pool{stage}"] = nn.MaxPool2d(2, stride=2, ceil_mode=small)
            stage, index = stage + 1, 1
        else:
            conv = nn.Conv2d(channels, v, 3, padding=1)
            blocks[f"conv{stage}_{index}"] = nn.Sequential(OrderedDict(conv=conv, relu=nn.ReLU()))
            channels, index = v, index + 1

    pooled = 1 if small else 7
    blocks["avgpool"] = nn.Sequential(
        OrderedDict(pool=nn.AdaptiveAvgPool2d(pooled), flatten=nn.Flatten())
    )
    if small:
        blocks["fc6"] = _linear_relu(512, 512)
        blocks["fc7"] = nn.Linear(512, num_classes)
    else:
        blocks["fc6"] = _linear_relu(512 * 7 * 7, 4096, dropout=0.5)
        blocks["fc7"] = _linear_relu(4096, 4096, dropout=0.5)
        blocks["fc8"] = nn.Linear(4096, num_classes)
    model = nn.Sequential(blocks)
    init_like_torchvision(model, linear_std=0.01)
    return model


def vgg11(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """VGG-11 (configuration A): 8 convs; 17 pipeline blocks (16 on small images)."""
    return _vgg("vgg11", input_shape, num_classes)


def vgg16(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """VGG-16 (configuration D): 13 convs; 22 pipeline blocks (21 on small images)."""
    return _vgg("vgg16", input_shape, num_classes)
