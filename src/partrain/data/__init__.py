"""Datasets: MNIST, Fashion-MNIST, EMNIST letters (IDX), CIFAR-10 (binary), OCR letters (CSV),
and generated data of any of their shapes, including the synthetic-only ImageNet and Highres.

    ds = load_dataset("mnist", "train", data_dir=None)   # ArrayDataset, read once into memory
    x, y = ds.get(torch.arange(64))                      # float32 [64, 1, 28, 28], int64 [64]
    load_dataset("imagenet", "train", seed=0)            # SyntheticDataset, 1,281,167 samples, nothing stored

The data directory is ``--data-dir``, else ``$PARTRAIN_DATA_DIR``, else ``~/.partrain/data``;
``partrain.data.load`` documents the layout inside it.
"""

from partrain.data.dataset import ArrayDataset, BaseDataset
from partrain.data.load import (
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    load_dataset,
    resolve_data_dir,
)
from partrain.data.spec import DatasetSpec, dataset_spec, list_datasets
from partrain.data.synthetic import SyntheticDataset

__all__ = [
    "ArrayDataset", "BaseDataset", "DATA_DIR_ENV", "DEFAULT_DATA_DIR", "DatasetSpec", "SyntheticDataset",
    "dataset_spec", "list_datasets", "load_dataset", "resolve_data_dir",
]
