"""Token datasets for language models: next-token prediction over byte-level tokens.

Sample ``i`` is a window of ``T + 1`` tokens; ``x`` is its first ``T`` (int64 ``[T]``) and
``y`` its last ``T`` (the next token at every position), so a model's logits are
``[batch, T, vocab]`` and the loss is the per-token cross-entropy.

- ``tokens``: generated, nothing stored. Sample ``i`` of a split is a pure function of
  ``(seed, split, i)``: a walk on a random sparse Markov chain over 256 tokens (each token
  has ``FANOUT`` successors, drawn once from the seed), the start and every step chosen by
  SplitMix64 hashes of the index (Steele et al., OOPSLA 2014, as in ``synthetic.py``). A
  model that learns the chain reaches ``ln FANOUT`` nats per token, from ``ln 256`` at start.
- ``text:PATH``: any UTF-8 text file, read as bytes (vocabulary 256, no tokenizer to ship).
  The first 90% of the bytes is the train split, the rest the test split; sample ``i`` is
  the window starting at byte ``i * T``.

The context ``T`` is 64 unless the name ends in ``@T`` (``tokens@128``, ``text:war.txt@256``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from partrain.data.dataset import BaseDataset
from partrain.data.spec import DatasetSpec
from partrain.data.synthetic import _splitmix64, _stream_state
from partrain.errors import PartrainError

VOCAB = 256
CONTEXT = 64
FANOUT = 4
TRAIN_FRACTION = 0.9
SYNTHETIC_SIZES = (50_000, 5_000)  # train, test samples of ``tokens``


def split_context(name: str) -> tuple[str, int]:
    """``"tokens@128"`` -> ``("tokens", 128)``; no suffix -> the default context."""
    base, at, tail = name.rpartition("@")
    if at and tail.isdigit():
        if int(tail) < 1:
            raise PartrainError(f"dataset {name!r}: the context after '@' must be at least 1 token")
        return base, int(tail)
    return name, CONTEXT


def is_token_dataset(name: str) -> bool:
    base = split_context(name)[0]
    return base == "tokens" or base.startswith("text:")


def _text_bytes(path: str) -> np.ndarray:
    if not path:
        raise PartrainError("--dataset text: needs a file: give --dataset text:PATH with a UTF-8 text file")
    file = Path(path).expanduser()
    if file.is_dir():
        raise PartrainError(f"text file {str(file)!r} is a directory: give --dataset text:PATH with a UTF-8 text file")
    if not file.is_file():
        context = " (a context after '@' is a whole number of tokens, e.g. @128)" if "@" in path else ""
        raise PartrainError(f"text file {str(file)!r} not found{context}: give --dataset text:PATH with a UTF-8 text file")
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PartrainError(f"text file {str(file)!r} is not UTF-8 (byte {err.start}): convert it, e.g. iconv -t utf-8") from None
    return np.frombuffer(data, dtype=np.uint8)


def token_spec(name: str) -> DatasetSpec:
    base, context = split_context(name)
    if base == "tokens":
        return DatasetSpec(name, (context,), VOCAB, *SYNTHETIC_SIZES, True,
                           f"generated next-token data: walks on a random {FANOUT}-successor chain over {VOCAB} tokens")
    n = len(_text_bytes(base.removeprefix("text:")))
    cut = int(n * TRAIN_FRACTION)
    train, test = (cut - 1) // context, (n - cut - 1) // context
    if train < 1 or test < 1:
        raise PartrainError(f"text file {base.removeprefix('text:')!r} has {n} bytes: too few for one "
                            f"{context}-token window in each split; use a longer file or a shorter context (@N)")
    return DatasetSpec(name, (context,), VOCAB, train, test, False, f"byte-level tokens of {base.removeprefix('text:')}")


class TokenDataset(BaseDataset):
    """``x`` int64 ``[n, T]`` and ``y`` int64 ``[n, T]``, the same windows shifted by one token."""

    def __init__(self, spec: DatasetSpec, split: str, tokens: np.ndarray | None = None, size: int | None = None,
                 seed: int = 0):
        self.spec, self.split, self.seed = spec, split, seed
        self.context = spec.input_shape[0]
        self.tokens = tokens  # the split's bytes for text; None for generated walks
        self.size = size if size is not None else spec.split_size(split)
        if tokens is None:
            g = torch.Generator().manual_seed(_stream_state(seed, "templates"))
            self._successors = torch.randint(0, VOCAB, (VOCAB, FANOUT), generator=g).numpy()
            self._state = _stream_state(seed, split)
        self._held: torch.Tensor | None = None  # uint8 on a device (``to``): the text's bytes, or every window

    def __len__(self) -> int:
        return self.size

    @property
    def device(self) -> torch.device:
        return self._held.device if self._held is not None else torch.device("cpu")

    def to(self, device: torch.device) -> TokenDataset:
        """The split held on ``device`` as bytes (a vocabulary of 256 fits uint8), so a batch is
        one gather there, not a host-built batch copied over every step: a text's bytes as they
        are (a 100 MB file: 100 MB), a generated split's windows all made once (the 50,000 of
        ``tokens``: 3.3 MB, about a second of host time)."""
        moved = copy.copy(self)
        if self.tokens is not None:
            held = torch.from_numpy(self.tokens.copy())  # the file's buffer is read-only
        else:
            held = torch.from_numpy(self._windows(np.arange(self.size, dtype=np.uint64)).astype(np.uint8))
        moved._held = held.to(device)
        return moved

    def device_bytes(self) -> int:
        return len(self.tokens) if self.tokens is not None else self.size * (self.context + 1)

    def _windows(self, i: np.ndarray) -> np.ndarray:
        t1 = self.context + 1
        if self.tokens is not None:
            return self.tokens[i.astype(np.int64)[:, None] * self.context + np.arange(t1)]
        # one hash per (sample, position): position 0 picks the start, the rest a successor each
        h = _splitmix64(self._state, i[:, None] * np.uint64(t1) + np.arange(t1, dtype=np.uint64))
        walk = np.empty((len(i), t1), dtype=np.int64)
        walk[:, 0] = (h[:, 0] % np.uint64(VOCAB)).astype(np.int64)
        choice = (h % np.uint64(FANOUT)).astype(np.int64)
        for t in range(1, t1):
            walk[:, t] = self._successors[walk[:, t - 1], choice[:, t]]
        return walk

    def _get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._held is None:
            w = torch.from_numpy(self._windows(indices.numpy().astype(np.uint64)).astype(np.int64))
        elif self.tokens is not None:  # the same windows, gathered from the bytes where they are held
            offsets = torch.arange(self.context + 1, device=self._held.device)
            w = self._held[indices.to(self._held.device)[:, None] * self.context + offsets].long()
        else:
            w = self._held[indices.to(self._held.device)].long()
        return w[:, :-1], w[:, 1:]


def load_tokens(name: str, split: str, seed: int = 0, limit: int | None = None) -> TokenDataset:
    spec = token_spec(name)
    size = spec.split_size(split) if limit is None else min(limit, spec.split_size(split))
    base = split_context(name)[0]
    if base == "tokens":
        return TokenDataset(spec, split, size=size, seed=seed)
    data = _text_bytes(base.removeprefix("text:"))
    cut = int(len(data) * TRAIN_FRACTION)
    return TokenDataset(spec, split, data[:cut] if split == "train" else data[cut:], size=size)
