"""Plain ``nn.Module`` models: the zoo (mlp, cnn, ResNet, VGG, MobileNetV2) and user factories.

Every zoo model is an ``nn.Sequential`` whose named top-level children are the blocks a
pipeline cuts into stages; ``model_blocks`` returns them for any model.
"""

from partrain.models.registry import (
    build_model,
    count_parameters,
    list_models,
    load_factory,
    model_blocks,
)

__all__ = ["build_model", "count_parameters", "list_models", "load_factory", "model_blocks"]
