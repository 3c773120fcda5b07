"""The small protocol every partrain dataset follows, and the in-memory dataset of real data.

A training loop asks for a whole batch at once with ``get(indices)``: one indexing operation
instead of ``batch_size`` Python calls, which matters for the small models in the benchmarks
where per-sample loading would cost more than the step. ``ds[i]`` gives one sample, so a
``torch.utils.data.DataLoader`` works as well.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from partrain.data.spec import DatasetSpec


class BaseDataset(ABC):
    spec: DatasetSpec
    split: str  # "train" or "test"
    device = torch.device("cpu")  # where ``get`` takes its indices and returns its batch

    def to(self, device: torch.device) -> BaseDataset | None:
        """This dataset held on ``device`` (``get`` then indexes there, with no host round trip),
        or None where it cannot move (it is read or generated on the host)."""
        return None

    def device_bytes(self) -> int:
        """The bytes ``to(device)`` would put on the device (``data.feed`` checks they fit)."""
        return 0

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` float32 ``[n, *input_shape]`` and ``y`` int64 ``[n]`` for 1-D int64 ``indices``."""
        indices = torch.as_tensor(indices, dtype=torch.int64)
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
        # checked on the host only: reading a GPU tensor's min would wait for the GPU every step
        # (an index out of range there fails in the indexing kernel instead)
        on_host = indices.device.type == "cpu"
        if on_host and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= len(self)):
            raise IndexError(f"indices must be in 0..{len(self) - 1} for {self!r}")
        return self._get(indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {self!r}")
        x, y = self.get(torch.tensor([i % len(self)]))
        return x[0], y[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.name} {self.split}, {len(self)} samples)"


class ArrayDataset(BaseDataset):
    """Real data held in memory as uint8 ``pixels`` and int64 ``labels``.

    A batch is normalized when it is taken, ``(pixels * scale - mean) / std`` per channel.
    Keeping bytes costs a quarter of float32's memory, which lets several local workers each
    hold a copy; normalizing a batch is far cheaper than its forward pass.
    """

    def __init__(self, spec: DatasetSpec, split: str, pixels: torch.Tensor, labels: torch.Tensor, *,
                 scale: float = 1.0, mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,)):
        if pixels.dtype != torch.uint8 or tuple(pixels.shape[1:]) != spec.input_shape:
            raise ValueError(f"pixels must be uint8 [n, {spec.input_shape}], got {pixels.dtype} {tuple(pixels.shape)}")
        if labels.dtype != torch.int64 or labels.shape != pixels.shape[:1]:
            raise ValueError(f"labels must be int64 [{len(pixels)}], got {labels.dtype} {tuple(labels.shape)}")
        self.spec, self.split, self.pixels, self.labels = spec, split, pixels, labels
        self._normalized = None  # the whole split as float32, once on a device (``to``)
        mean_t = torch.tensor(mean, dtype=torch.float64).view(-1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float64).view(-1, 1, 1)
        self._scale = (scale / std_t).float()
        self._shift = (-mean_t / std_t).float()

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def device(self) -> torch.device:
        return self.pixels.device

    def to(self, device: torch.device) -> ArrayDataset:
        """On a device the whole split is normalized once (float32: MNIST 188 MB, CIFAR-10 614 MB),
        so a batch is two gathers, not five kernels: what a small model's step notices."""
        moved = copy.copy(self)
        for name in ("pixels", "labels", "_scale", "_shift"):
            setattr(moved, name, getattr(self, name).to(device))
        moved._normalized = moved._normalize(moved.pixels)  # the same arithmetic as per batch: the same values
        return moved

    def device_bytes(self) -> int:
        return 5 * self.pixels.nbytes + self.labels.nbytes  # the bytes and their float32 normalization

    def _normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.to(torch.float32).mul_(self._scale).add_(self._shift)

    def _get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._normalized is not None:
            return self._normalized[indices], self.labels[indices]
        return self._normalize(self.pixels[indices]), self.labels[indices]
