"""Batches on the training device, without making a GPU wait for them.

Three paths, chosen once per dataset by ``Feed``:

- CPU training: ``dataset.get(idx)``, as ever (nothing moves, nothing changes).
- GPU, data that fits: the dataset is moved to the GPU once (``dataset.to(device)``: MNIST,
  CIFAR-10 or OCR letters, normalized there once; synthetic data's templates and noise
  tiles, from which every batch is then generated there; token data's bytes, or every
  generated window, as uint8) and indexed there with indices
  already on the GPU, so a batch costs a few kernels and no host round trip. "Fits" means
  at most ``DEVICE_SHARE`` of the GPU's free memory (MNIST takes 235 MB there, CIFAR-10
  768 MB: far below it on a GPU that trains them), leaving the rest to the model.
- GPU, data that must stay on the host (a dataset too big, or one that cannot move): a prefetcher
  (after NVIDIA's apex ``data_prefetcher``): each batch is copied into pinned memory and
  sent with a non-blocking copy on a side CUDA stream while the current step runs; the
  step's stream waits on an event for that copy only, never on the host.

``channels_last`` puts 4-D batches in ``torch.channels_last`` (a copy on the device; no-op
for other ranks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from partrain.data.dataset import BaseDataset

DEVICE_SHARE = 0.25  # a dataset moves onto the GPU when it needs at most this share of its free memory


def place(dataset: BaseDataset, device: torch.device, share: float = DEVICE_SHARE) -> BaseDataset:
    """``dataset`` held on ``device`` when it can move and fits in ``share`` of the free memory; else as it is."""
    if device.type != "cuda" or dataset.device == device:
        return dataset
    free, _ = torch.cuda.mem_get_info(device)
    if dataset.device_bytes() > share * free:
        return dataset
    return dataset.to(device) or dataset


class Feed:
    """One dataset's batches on ``device``: indexed on the device where the data is, else prefetched."""

    def __init__(self, dataset: BaseDataset, device: torch.device, channels_last: bool = False, on_device: bool = True):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current GPU: name it, so devices compare
            device = torch.device("cuda", torch.cuda.current_device())
        self.dataset = place(dataset, device) if on_device else dataset
        self.device = device
        self.channels_last = channels_last
        self.prefetch = device.type == "cuda" and self.dataset.device != device

    def __len__(self) -> int:
        return len(self.dataset)

    def indices(self, order: torch.Tensor) -> torch.Tensor:
        """``order`` where the dataset wants its indices (one copy an epoch, not one a step)."""
        return order.to(self.dataset.device)

    def get(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch on the device, fetched now (evaluation, and the CPU path)."""
        x, y = self.dataset.get(idx)
        return self._format(x.to(self.device, non_blocking=True)), y.to(self.device, non_blocking=True)

    def batches(self, index_batches: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of ``index_batches`` in order; a host dataset's next one is on its way while a step runs."""
        if not self.prefetch:
            return (self.get(idx) for idx in index_batches)
        return self._prefetched(iter(index_batches))

    def _format(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    def _prefetched(self, index_batches: Iterator[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)

        def start(idx):
            """The host's work for one batch, and its copy queued on the side stream."""
            x, y = self.dataset.get(idx)
            x, y = x.pin_memory(), y.pin_memory()  # a pageable source would make the copy synchronous
            with torch.cuda.stream(side):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            return x, y, copied

        pending = next((start(idx) for idx in index_batches), None)
        while pending is not None:
            x, y, copied = pending
            pending = next((start(idx) for idx in index_batches), None)  # the next batch, before this one's step
            main.wait_event(copied)  # the step waits for this batch's copy, on the GPU, not the host
            x.record_stream(main)  # made on the side stream, used on the main one: not freed under it
            y.record_stream(main)
            yield self._format(x), y
