"""Generated data of a dataset's shape, for benchmarks without the real files (or any files).

Sample ``i`` of a split is a pure function of ``(seed, split, i)``, computed when asked for,
so a dataset of any length costs nothing: ImageNet's 1.28M train samples, 770 GB as float32,
cost one low-resolution template per class (1000 x 3 x 8 x 8 floats).

- label: ``h % num_classes``, where ``h`` is output ``2i`` of a SplitMix64 stream keyed by
  seed and split (G. Steele, D. Lea and C. Flood, "Fast splittable pseudorandom number
  generators", OOPSLA 2014) -- a cheap, vectorized, well-mixed hash of the index.
- image: the class template upsampled bilinearly to ``(H, W)``, plus ``NOISE_STD`` times
  gaussian noise from a ``torch.Generator`` seeded with output ``2i + 1``.

The templates are gaussian images of at most 8x8 pixels drawn once from the seed, shared by
train and test, so the data is learnable (smooth class patterns a CNN or an MLP picks up;
the loss falls) and a model trained on train is scored fairly on test.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from partrain.data.dataset import BaseDataset
from partrain.data.spec import DatasetSpec

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment, 2^64 / golden ratio
_STREAMS = {"templates": 0, "train": 1, "test": 2}


def _splitmix64(state: np.ndarray | int, i: np.ndarray) -> np.ndarray:
    """Output ``i`` (uint64 array) of the SplitMix64 generator started at ``state``; wraps mod 2^64."""
    z = np.uint64(state) + (i + np.uint64(1)) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _stream_state(seed: int, stream: str) -> int:
    return int(_splitmix64(seed & (2**64 - 1), np.array([_STREAMS[stream]], np.uint64))[0])


class SyntheticDataset(BaseDataset):
    TEMPLATE_SIZE = 8  # templates are at most this many pixels high and wide
    NOISE_STD = 1.0

    def __init__(self, spec: DatasetSpec, split: str = "train", size: int | None = None, *, seed: int = 0):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.spec, self.split, self.seed = spec, split, seed
        self.size = spec.split_size(split) if size is None else size
        channels, height, width = spec.input_shape
        g = torch.Generator().manual_seed(_stream_state(seed, "templates"))
        self._templates = torch.randn(spec.num_classes, channels, min(height, self.TEMPLATE_SIZE),
                                      min(width, self.TEMPLATE_SIZE), generator=g)
        self._state = _stream_state(seed, split)

    def __len__(self) -> int:
        return self.size

    def _get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = indices.numpy().astype(np.uint64)
        y = torch.from_numpy((_splitmix64(self._state, 2 * i) % np.uint64(self.spec.num_classes)).astype(np.int64))
        shape = self.spec.input_shape
        x = F.interpolate(self._templates[y], size=shape[1:], mode="bilinear", align_corners=False)
        noise = torch.empty(len(i), *shape)
        g = torch.Generator()
        # torch's CPU generator uses the low 32 bits of a seed: among ImageNet's 1.28M samples
        # about 200 pairs share their noise, and all but one in 1000 of those differ in class.
        for k, key in enumerate(_splitmix64(self._state, 2 * i + np.uint64(1)).tolist()):
            torch.randn(shape, generator=g.manual_seed(key), out=noise[k])
        return x.add_(noise, alpha=self.NOISE_STD), y
