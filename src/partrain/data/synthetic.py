"""Generated data of a dataset's shape, for benchmarks without the real files (or any files).

Sample ``i`` of a split is a pure function of ``(seed, split, i)``, computed when asked for,
on whatever device the dataset is held (``to(device)``: a GPU generates its own batches, and
gets the very same samples as the CPU), so a dataset of any length costs nothing: ImageNet's
1.28M train samples, 770 GB as float32, cost one low-resolution template per class
(1000 x 3 x 8 x 8 floats) and a small bank of noise tiles.

- label: ``h % num_classes``, where ``h`` is output ``2i`` of a SplitMix64 stream keyed by
  seed and split (G. Steele, D. Lea and C. Flood, "Fast splittable pseudorandom number
  generators", OOPSLA 2014) -- a cheap, vectorized, well-mixed hash of the index, computed
  with torch's int64 arithmetic (which wraps like uint64) so it runs on any device.
- image: the class template upsampled bilinearly to ``(H, W)``, plus ``NOISE_STD`` times
  gaussian noise: one of ``NOISE_BANK`` gaussian tiles of at most ``NOISE_TILE`` x
  ``NOISE_TILE`` pixels, shifted by ``(dy, dx)``, signed and repeated over the image, all
  four chosen by output ``2i + 1``. That costs a gather of tiles and one in-place add, the
  same on CPU and GPU (drawing a fresh gaussian image per sample on the host took 119 ms
  for a batch of 128 ImageNet images); 32 tiles of 32 x 32 give 65,536 distinct fields.

The templates and tiles are gaussian, drawn once from the seed on the CPU, shared by train
and test, so the data is learnable (smooth class patterns a CNN or an MLP picks up; the loss
falls) and a model trained on train is scored fairly on test.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from partrain.data.dataset import BaseDataset
from partrain.data.spec import DatasetSpec

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment, 2^64 / golden ratio
_STREAMS = {"templates": 0, "train": 1, "test": 2, "noise": 3}


def _splitmix64(state: np.ndarray | int, i: np.ndarray) -> np.ndarray:
    """Output ``i`` (uint64 array) of the SplitMix64 generator started at ``state``; wraps mod 2^64."""
    z = np.uint64(state) + (i + np.uint64(1)) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _stream_state(seed: int, stream: str) -> int:
    return int(_splitmix64(seed & (2**64 - 1), np.array([_STREAMS[stream]], np.uint64))[0])


def _signed(u: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic on every device)."""
    return u - 2**64 if u >= 2**63 else u


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` sign-extends)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


_MIX1, _MIX2, _GAMMA_I = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(int(_GAMMA))


def splitmix64_torch(state: int, i: torch.Tensor) -> torch.Tensor:
    """``_splitmix64`` on int64 tensors of any device: the same bits, as int64 (wrapping arithmetic)."""
    z = (i + 1) * _GAMMA_I + _signed(state)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _unsigned_mod(z: torch.Tensor, n: int) -> torch.Tensor:
    """``z % n`` of int64 bit patterns read as uint64: u = 2 (u >> 1) + (u & 1)."""
    return (2 * (_shr(z, 1) % n) + (z & 1)) % n


def _tile(size: int, most: int) -> int:
    """The largest divisor of ``size`` up to ``most``: whole tiles cover the image (224 -> 32, 28 -> 28)."""
    return max(d for d in range(1, min(size, most) + 1) if size % d == 0)


class SyntheticDataset(BaseDataset):
    TEMPLATE_SIZE = 8  # templates are at most this many pixels high and wide
    NOISE_STD = 1.0
    NOISE_TILE = 32  # noise tiles are at most this many pixels high and wide
    NOISE_BANK = 32  # noise tiles to choose from

    def __init__(self, spec: DatasetSpec, split: str = "train", size: int | None = None, *, seed: int = 0):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.spec, self.split, self.seed = spec, split, seed
        self.size = spec.split_size(split) if size is None else size
        channels, height, width = spec.input_shape
        g = torch.Generator().manual_seed(_stream_state(seed, "templates"))
        self._templates = torch.randn(spec.num_classes, channels, min(height, self.TEMPLATE_SIZE),
                                      min(width, self.TEMPLATE_SIZE), generator=g)
        g = torch.Generator().manual_seed(_stream_state(seed, "noise"))
        self._tiles = torch.randn(self.NOISE_BANK, channels, _tile(height, self.NOISE_TILE), _tile(width, self.NOISE_TILE),
                                  generator=g)
        self._state = _stream_state(seed, split)

    def __len__(self) -> int:
        return self.size

    @property
    def device(self) -> torch.device:
        return self._templates.device

    def to(self, device: torch.device) -> SyntheticDataset:
        moved = copy.copy(self)  # tiles and templates move; every batch is then made on the device
        moved._templates, moved._tiles = self._templates.to(device), self._tiles.to(device)
        return moved

    def device_bytes(self) -> int:
        return self._templates.nbytes + self._tiles.nbytes

    def _get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = indices.to(self.device)
        y = _unsigned_mod(splitmix64_torch(self._state, 2 * i), self.spec.num_classes)
        channels, height, width = self.spec.input_shape
        x = F.interpolate(self._templates[y], size=(height, width), mode="bilinear", align_corners=False)
        key = splitmix64_torch(self._state, 2 * i + 1)  # its bits choose the tile, the shift and the sign
        bank, th, tw = self._tiles.shape[0], self._tiles.shape[2], self._tiles.shape[3]
        tile = _unsigned_mod(key, bank)
        dy, dx = _shr(key, 16) % th, _shr(key, 40) % tw
        # shift the small tile (a periodic field shifted is its tile rolled), then add it to every
        # (th, tw) block of the image in place: no image-sized noise tensor is made
        rows = (torch.arange(th, device=i.device) + dy[:, None]) % th  # [n, th]
        cols = (torch.arange(tw, device=i.device) + dx[:, None]) % tw  # [n, tw]
        n = len(i)
        at = (rows[:, :, None] * tw + cols[:, None, :]).view(n, 1, th * tw).expand(n, channels, th * tw)
        rolled = torch.gather(self._tiles.index_select(0, tile).flatten(2), 2, at).view(n, channels, 1, th, 1, tw)
        sign = (1.0 - 2.0 * (key < 0).to(x.dtype)).view(n, 1, 1, 1, 1, 1)  # the top bit
        # x += NOISE_STD * sign * rolled: products of +-1 and a power of two are exact, so a fused
        # multiply-add on the GPU rounds as the CPU does
        x.view(n, channels, height // th, th, width // tw, tw).addcmul_(rolled, sign, value=self.NOISE_STD)
        return x, y
