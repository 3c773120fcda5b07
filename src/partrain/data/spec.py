"""What each dataset looks like: shape, classes and nominal split sizes.

A ``DatasetSpec`` is pure metadata, so the predictor and recommender can size a job
(samples per epoch, bytes per sample) without reading a single file.

``train_size``/``test_size`` are the sizes of the complete public splits. A partial copy
(such as the truncated CIFAR-10 sample) loads with fewer samples; ``len()`` of the loaded
dataset is the truth. The two ``synthetic_only`` entries have no reader: ImageNet is too
large to ship or read for a benchmark, and Highres is the thesis's generated set of large
images, sized here at 10,000 train and 1,000 test samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from partrain.errors import PartrainError


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    input_shape: tuple[int, ...]  # (C, H, W) of one sample
    num_classes: int
    train_size: int
    test_size: int
    synthetic_only: bool
    description: str

    def split_size(self, split: str) -> int:
        """Nominal number of samples in ``split`` ("train" or "test")."""
        return self.train_size if split == "train" else self.test_size


_SPECS = {
    spec.name: spec
    for spec in (
        DatasetSpec("mnist", (1, 28, 28), 10, 60_000, 10_000, False,
                    "MNIST handwritten digits (LeCun et al. 1998), IDX files"),
        DatasetSpec("fashion-mnist", (1, 28, 28), 10, 60_000, 10_000, False,
                    "Fashion-MNIST clothing images (Xiao et al. 2017), IDX files"),
        # EMNIST letters labels are 1..26 on disk; they load as 0..25 (a=0).
        DatasetSpec("emnist", (1, 28, 28), 26, 124_800, 20_800, False,
                    "EMNIST letters a-z (Cohen et al. 2017), IDX files"),
        DatasetSpec("cifar10", (3, 32, 32), 10, 50_000, 10_000, False,
                    "CIFAR-10 colour images (Krizhevsky 2009), binary batch files"),
        DatasetSpec("ocr-letters", (1, 16, 8), 10, 9_000, 1_000, False,
                    "OCR handwritten letters, 10-letter subset (Taskar et al. 2003), CMU CSV"),
        DatasetSpec("imagenet", (3, 224, 224), 1000, 1_281_167, 50_000, True,
                    "ImageNet-1k (ILSVRC 2012) shapes and sizes, generated data only"),
        DatasetSpec("highres", (3, 512, 512), 1000, 10_000, 1_000, True,
                    "Highres: 512x512 RGB images, 1000 classes, generated data only"),
    )
}


def dataset_spec(name: str) -> DatasetSpec:
    from partrain.data.tokens import (  # tokens.py builds on DatasetSpec
        is_token_dataset,
        token_spec,
    )

    if is_token_dataset(name):
        return token_spec(name)
    try:
        return _SPECS[name]
    except KeyError:
        raise PartrainError(
            f"unknown dataset {name!r}; known datasets: {', '.join(_SPECS)}, tokens, or text:PATH for a UTF-8 file"
        ) from None


def list_datasets() -> list[DatasetSpec]:
    from partrain.data.tokens import token_spec

    return [*_SPECS.values(), token_spec("tokens")]
