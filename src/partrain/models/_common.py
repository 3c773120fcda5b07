"""Helpers shared by the zoo builders: image input checks and torchvision-style initialization."""

import torch.nn as nn

from partrain.errors import PartrainError

# Inputs whose shorter side is below this many pixels (MNIST 28, OCR 16x8, CIFAR 32) get the
# CIFAR-style variant of a model; ImageNet (224) and Highres (512) get the torchvision one.
SMALL_IMAGE = 64


def image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """Return ``(C, H, W)``, or raise if ``input_shape`` is not an image shape."""
    if len(input_shape) != 3:
        raise PartrainError(
            f"model {model!r} needs an image input_shape (C, H, W), got {tuple(input_shape)}; "
            "use 'mlp' for flat inputs"
        )
    return input_shape[0], input_shape[1], input_shape[2]


def is_small(height: int, width: int) -> bool:
    """True when the CIFAR-style variant fits the image better than the ImageNet one."""
    return min(height, width) < SMALL_IMAGE


def init_like_torchvision(model: nn.Module, linear_std: float | None = None) -> None:
    """Kaiming-normal (fan_out, ReLU) convs with zero bias, BatchNorm weight 1 and bias 0.

    Linear layers get N(0, ``linear_std``) weights and zero bias when ``linear_std`` is given
    (torchvision VGG and MobileNetV2 use 0.01); otherwise PyTorch's default (torchvision ResNet).
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear) and linear_std is not None:
            nn.init.normal_(m.weight, 0.0, linear_std)
            nn.init.zeros_(m.bias)
