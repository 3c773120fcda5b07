"""The file ``train --save-model`` writes: the trained weights, and what rebuilds the model.

A bare ``state_dict`` cannot be loaded without knowing which network it belongs to, so the
file is a small dict: ``format``, ``model``, ``dataset``, ``model_options`` and the full
``state_dict`` (gathered from every stage or shard). Only tensors, strings, numbers and
containers of them: it loads with ``torch.load(weights_only=True)``, which cannot run code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from partrain.atomic import write_atomic
from partrain.errors import PartrainError

FORMAT = "partrain-model-1"


@dataclass
class ModelFile:
    model: str
    dataset: str
    model_options: dict
    state_dict: dict

    def build(self) -> torch.nn.Module:
        """The model with its trained weights, in eval mode."""
        from partrain.data import dataset_spec
        from partrain.models import build_model

        spec = dataset_spec(self.dataset)
        net = build_model(self.model, spec.input_shape, spec.num_classes, **self.model_options)
        try:
            net.load_state_dict(self.state_dict)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[-1].strip()
            raise PartrainError(f"the weights do not fit model {self.model!r} on {self.dataset}: {first}") from None
        return net.eval()


def save(path: str, model: str, dataset: str, model_options: dict, state_dict: dict) -> None:
    """Write atomically (a temporary name, then a rename): never a torn file."""
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in model_options.items()}
    obj = {"format": FORMAT, "model": model, "dataset": dataset, "model_options": options, "state_dict": state_dict}
    write_atomic(path, lambda f: torch.save(obj, f))


def load(path: str) -> ModelFile:
    """Read a ``--save-model`` file; anything else is one clear error."""
    if os.path.isdir(path):
        raise PartrainError(f"model file {path} is a directory: give the file `partrain train --save-model` wrote")
    if not os.path.isfile(path):
        raise PartrainError(f"model file {path} not found: write one with `partrain train --save-model {path}`")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same problem to the user
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise PartrainError(f"cannot read model file {path} ({reason}): write one with `partrain train --save-model`") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise PartrainError(f"{path} is not a partrain model file (no {FORMAT!r} header): "
                            "write one with `partrain train --save-model`")
    state = obj.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PartrainError(f"{path}: the state_dict is missing or not all tensors: write it again with --save-model")
    return ModelFile(str(obj["model"]), str(obj["dataset"]), dict(obj.get("model_options") or {}), state)
