"""partrain.data: real-data readers against the shared files, generated data, and corrupt input."""

import gzip
import shutil
import struct
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from partrain.data import (
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    ArrayDataset,
    SyntheticDataset,
    dataset_spec,
    list_datasets,
    load_dataset,
    resolve_data_dir,
)
from partrain.data.load import reused_splits
from partrain.errors import PartrainError

MNIST_FILES = [f"{s}-{k}-ubyte.gz" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]


def write_idx(path, array, gz=False):
    array = np.asarray(array, np.uint8)
    data = struct.pack(f">{1 + array.ndim}I", 0x0800 + array.ndim, *array.shape) + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)


@pytest.fixture(scope="module")
def mnist_train(data_dir):
    return load_dataset("mnist", "train", data_dir=data_dir)


@pytest.fixture
def mnist_copy(data_dir, tmp_path):
    """A writable copy of the gzipped MNIST test files under tmp_path/mnist: (data dir, folder)."""
    folder = tmp_path / "mnist"
    folder.mkdir()
    for name in MNIST_FILES[2:]:
        shutil.copy(data_dir / "mnist" / name, folder / name)
    return tmp_path, folder


@contextmanager
def raises_naming(path, *phrases):
    """Expect a PartrainError whose message names ``path`` and contains every phrase."""
    with pytest.raises(PartrainError) as info:
        yield
    for expected in (str(path), *phrases):
        assert expected in str(info.value)


# --- specs and data directory --------------------------------------------------------------

def test_specs_cover_every_dataset_with_its_shape():
    shapes = {s.name: (s.input_shape, s.num_classes, s.synthetic_only) for s in list_datasets()}
    assert shapes == {
        "mnist": ((1, 28, 28), 10, False), "fashion-mnist": ((1, 28, 28), 10, False),
        "emnist": ((1, 28, 28), 26, False), "cifar10": ((3, 32, 32), 10, False),
        "ocr-letters": ((1, 16, 8), 10, False), "imagenet": ((3, 224, 224), 1000, True),
        "highres": ((3, 512, 512), 1000, True), "tokens": ((64,), 256, True),
    }
    assert dataset_spec("imagenet").train_size == 1_281_167
    with pytest.raises(PartrainError, match="unknown dataset 'svhn'.*mnist.*highres"):
        dataset_spec("svhn")


def test_data_dir_lookup_order(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert resolve_data_dir(None) == DEFAULT_DATA_DIR.expanduser().absolute()
    assert str(DEFAULT_DATA_DIR) == "~/.partrain/data"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "env"))
    assert resolve_data_dir(None) == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"


def test_missing_data_is_an_error_never_synthetic(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    for name in ("mnist", "emnist", "cifar10", "ocr-letters"):
        with raises_naming(tmp_path, "--data-dir", "PARTRAIN_DATA_DIR", "--synthetic"):
            load_dataset(name, "test", data_dir=tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "nowhere"))
    with raises_naming(tmp_path / "nowhere" / "mnist" / "t10k-images-idx3-ubyte[.gz]", "--synthetic"):
        load_dataset("mnist", "test")


def test_env_var_points_at_the_data(monkeypatch, data_dir):
    monkeypatch.setenv(DATA_DIR_ENV, str(data_dir))
    assert len(load_dataset("ocr-letters", "test")) == 1000


def test_bad_arguments(data_dir):
    with pytest.raises(PartrainError, match="unknown split 'val'"):
        load_dataset("mnist", "val", data_dir=data_dir)
    with pytest.raises(PartrainError, match="generated data only"):
        load_dataset("mnist", "test", data_dir=data_dir, size=10)
    with pytest.raises(PartrainError, match="limit must be at least 1"):
        load_dataset("mnist", "test", data_dir=data_dir, limit=0)


# --- real data -----------------------------------------------------------------------------

def test_mnist_train(mnist_train):
    assert isinstance(mnist_train, ArrayDataset) and len(mnist_train) == 60_000
    x, y = mnist_train.get(torch.arange(60_000))
    assert x.shape == (60_000, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
    assert torch.bincount(y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def test_mnist_test_and_limit(data_dir):
    test = load_dataset("mnist", "test", data_dir=data_dir)
    assert len(test) == 10_000 and test.labels[:4].tolist() == [7, 2, 1, 0]
    first = load_dataset("mnist", "test", data_dir=data_dir, limit=100)
    assert len(first) == 100
    assert torch.equal(first.get(torch.arange(100))[0], test.get(torch.arange(100))[0])


def test_a_split_read_again_inside_reused_splits_shares_its_tensors(mnist_copy):
    root, folder = mnist_copy
    with reused_splits():
        first = load_dataset("mnist", "test", data_dir=root)
        part = load_dataset("mnist", "test", data_dir=root, limit=10)  # another split: read
        assert len(part) == 10 and part.pixels is not first.pixels
        (folder / "t10k-labels-idx1-ubyte.gz").unlink()  # not read again: the split is the one read
        again = load_dataset("mnist", "test", data_dir=root)
        assert again is not first and again.pixels is first.pixels and again.labels is first.labels
    with raises_naming(folder / "t10k-labels-idx1-ubyte", "not found"):  # outside, the files as they are
        load_dataset("mnist", "test", data_dir=root)


def test_single_items_and_dataloader(mnist_train):
    x, y = mnist_train[0]
    assert x.shape == (1, 28, 28) and y.item() == 5
    assert mnist_train[-1][1] == mnist_train.labels[-1]
    with pytest.raises(IndexError):
        mnist_train[60_000]
    with pytest.raises(IndexError):
        mnist_train.get(torch.tensor([0, 60_000]))
    xb, yb = next(iter(torch.utils.data.DataLoader(mnist_train, batch_size=10)))
    assert xb.shape == (10, 1, 28, 28) and yb.tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_plain_and_gzipped_idx_load_alike(data_dir, tmp_path):
    for name in MNIST_FILES[2:]:
        (tmp_path / "mnist").mkdir(exist_ok=True)
        (tmp_path / "mnist" / name[:-3]).write_bytes(gzip.decompress((data_dir / "mnist" / name).read_bytes()))
    plain = load_dataset("mnist", "test", data_dir=tmp_path)
    gzipped = load_dataset("mnist", "test", data_dir=data_dir)
    assert torch.equal(plain.pixels, gzipped.pixels) and torch.equal(plain.labels, gzipped.labels)


def test_emnist_letters_are_shifted_and_transposed(tmp_path):
    images = np.zeros((3, 28, 28), np.uint8)
    images[:, 0, 5] = 255  # stored column-major: row 5, column 0 once upright
    write_idx(tmp_path / "emnist" / "emnist-letters-test-images-idx3-ubyte.gz", images, gz=True)
    write_idx(tmp_path / "emnist" / "emnist-letters-test-labels-idx1-ubyte.gz", [1, 26, 13], gz=True)
    ds = load_dataset("emnist", "test", data_dir=tmp_path)
    assert ds.labels.tolist() == [0, 25, 12]
    assert ds.pixels[0, 0, 5, 0] == 255 and ds.pixels[0, 0, 0, 5] == 0
    write_idx(tmp_path / "emnist" / "emnist-letters-test-labels-idx1-ubyte.gz", [1, 27, 13], gz=True)
    with raises_naming(tmp_path / "emnist" / "emnist-letters-test-labels-idx1-ubyte.gz", "label 27", "1..26"):
        load_dataset("emnist", "test", data_dir=tmp_path)


def test_fashion_mnist_reads_mnist_names_with_its_own_statistics(tmp_path):
    write_idx(tmp_path / "fashion-mnist" / "train-images-idx3-ubyte", np.full((2, 28, 28), 255))
    write_idx(tmp_path / "fashion-mnist" / "train-labels-idx1-ubyte", [9, 0])
    x, y = load_dataset("fashion-mnist", data_dir=tmp_path).get(torch.arange(2))
    assert y.tolist() == [9, 0]
    assert torch.allclose(x, torch.full_like(x, (1 - 0.2860) / 0.3530))


def test_cifar10_sample(data_dir):
    train = load_dataset("cifar10", "train", data_dir=data_dir)
    test = load_dataset("cifar10", "test", data_dir=data_dir)
    assert (len(train), len(test)) == (4000, 1000)
    assert train.labels[:10].tolist() == [6, 9, 9, 4, 1, 1, 2, 7, 8, 3]
    assert test.labels[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]
    assert torch.bincount(train.labels).tolist() == [396, 366, 420, 384, 422, 393, 414, 385, 407, 413]
    assert torch.bincount(test.labels).tolist() == [103, 89, 100, 103, 90, 86, 112, 102, 106, 109]
    x, _ = train.get(torch.arange(4000))
    assert x.shape == (4000, 3, 32, 32)
    assert x.mean(dim=(0, 2, 3)).abs().max() < 0.05 and (x.std(dim=(0, 2, 3)) - 1).abs().max() < 0.05


def test_ocr_letters(data_dir):
    train = load_dataset("ocr-letters", "train", data_dir=data_dir)
    test = load_dataset("ocr-letters", "test", data_dir=data_dir)
    assert (len(train), len(test)) == (9000, 1000)
    x, y = test.get(torch.arange(1000))
    # binary pixels, standardized with the ink share 0.21 and its std 0.41
    assert x.shape == (1000, 1, 16, 8)
    assert torch.allclose(x.unique(), torch.tensor([(0 - 0.21) / 0.41, (1 - 0.21) / 0.41]))
    assert torch.bincount(y).tolist() == [100] * 10
    assert torch.bincount(train.labels).tolist() == [900] * 10


# --- generated data ------------------------------------------------------------------------

def test_synthetic_is_deterministic_per_seed_split_and_index():
    a = load_dataset("mnist", "train", synthetic=True, seed=1)
    idx = torch.tensor([0, 7, 9_999])
    xa, ya = a.get(idx)
    xb, yb = load_dataset("mnist", "train", synthetic=True, seed=1).get(idx)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.get(torch.tensor([7]))[0][0], xa[1])  # independent of the batch it is in
    assert not torch.equal(load_dataset("mnist", "train", synthetic=True, seed=2).get(idx)[0], xa)
    assert not torch.equal(load_dataset("mnist", "test", synthetic=True, seed=1).get(idx)[0], xa)


def test_synthetic_only_datasets_are_never_materialized():
    imagenet = load_dataset("imagenet", "train")
    assert isinstance(imagenet, SyntheticDataset) and len(imagenet) == 1_281_167
    held = sum(t.numel() for t in vars(imagenet).values() if isinstance(t, torch.Tensor))
    assert held <= 1000 * 3 * 8 * 8 + SyntheticDataset.NOISE_BANK * 3 * 32 * 32  # templates and noise tiles, whatever the length
    x, y = imagenet.get(torch.tensor([0, 1_281_166]))
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32 and y.dtype == torch.int64
    x, y = load_dataset("highres", "test").get(torch.arange(2))
    assert x.shape == (2, 3, 512, 512) and len(load_dataset("highres", "test")) == 1000
    labels = imagenet.get(torch.arange(64))[1]
    assert labels.min() >= 0 and labels.max() < 1000 and len(labels.unique()) > 60
    counts = torch.bincount(load_dataset("mnist", synthetic=True).get(torch.arange(5000))[1], minlength=10)
    assert len(counts) == 10 and counts.min() > 400  # labels spread evenly over the classes


def test_synthetic_size_and_limit():
    assert len(load_dataset("cifar10", "test", synthetic=True, size=500)) == 500
    assert len(load_dataset("cifar10", "test", synthetic=True, size=500, limit=20)) == 20
    assert len(load_dataset("imagenet", "test", limit=64)) == 64


def test_synthetic_data_is_learnable():
    torch.manual_seed(0)
    train = load_dataset("mnist", "train", synthetic=True, size=2000)
    test = load_dataset("mnist", "test", synthetic=True, size=500)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for start in range(0, 2000, 50):
        x, y = train.get(torch.arange(start, start + 50))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = test.get(torch.arange(500))
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    assert (model(x).argmax(1) == y).float().mean() > 0.8


# --- corrupt files -------------------------------------------------------------------------

def test_idx_wrong_magic(mnist_copy):
    root, folder = mnist_copy
    path = folder / "t10k-labels-idx1-ubyte.gz"
    data = bytearray(gzip.decompress(path.read_bytes()))
    data[3] = 3
    path.write_bytes(gzip.compress(bytes(data)))
    with raises_naming(path, "magic number 2051, expected 2049"):
        load_dataset("mnist", "test", data_dir=root)


def test_idx_truncated(mnist_copy):
    root, folder = mnist_copy
    path = folder / "t10k-images-idx3-ubyte"
    path.write_bytes(gzip.decompress((folder / "t10k-images-idx3-ubyte.gz").read_bytes())[:-100])
    with raises_naming(path, "truncated", "10000 x 28 x 28 = 7840000", "7839900"):
        load_dataset("mnist", "test", data_dir=root)


def test_idx_count_mismatch(mnist_copy):
    root, folder = mnist_copy
    labels = folder / "t10k-labels-idx1-ubyte.gz"
    write_idx(labels, np.zeros(9999), gz=True)
    with raises_naming(labels, "9999 labels", "10000 images"):
        load_dataset("mnist", "test", data_dir=root)


def test_bad_gzip(mnist_copy):
    root, folder = mnist_copy
    path = folder / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:50_000])
    with raises_naming(path, "not a valid gzip file"):
        load_dataset("mnist", "test", data_dir=root)
    path.write_bytes(b"this is not gzip")
    with raises_naming(path, "not a valid gzip file"):
        load_dataset("mnist", "test", data_dir=root)


def test_idx_label_out_of_range(mnist_copy):
    root, folder = mnist_copy
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", [3] * 9999 + [10], gz=True)
    with raises_naming(folder / "t10k-labels-idx1-ubyte.gz", "label 10 at item 9999", "0..9"):
        load_dataset("mnist", "test", data_dir=root)


def test_cifar_corrupt(data_dir, tmp_path):
    folder = tmp_path / "cifar10"
    folder.mkdir()
    records = (data_dir / "cifar10_sample" / "test_batch.first1000.bin").read_bytes()[:3073 * 3]
    path = folder / "test_batch.bin"
    path.write_bytes(records[:-1])
    with raises_naming(path, "9218 bytes", "3073"):
        load_dataset("cifar10", "test", data_dir=tmp_path)
    path.write_bytes(records[:3073] + b"\x0a" + records[3074:])
    with raises_naming(path, "label 10 at record 1", "0..9"):
        load_dataset("cifar10", "test", data_dir=tmp_path)


@pytest.mark.parametrize("row, phrases", [
    ("3," + "0," * 126 + "0", ["line 3 has 128 columns, expected 129"]),
    ("3," + "0," * 100 + "x," + "0," * 26 + "0", ["line 3, column 102", "'x' is not a 64-bit integer"]),
    ("3," + "0," * 100 + "9" * 23 + "," + "0," * 26 + "0", ["line 3, column 102", "is not a 64-bit integer"]),  # was OverflowError
    ("10," + "0," * 127 + "0", ["label 10 at line 3", "0..9"]),
    ("3," + "0," * 127 + "2", ["line 3, column 129: pixel 2 is not 0 or 1"]),
])
def test_csv_corrupt(data_dir, tmp_path, row, phrases):
    lines = (data_dir / "ocr_letters_cmu" / "largeValidation.csv").read_text().splitlines()
    path = tmp_path / "ocr_letters_cmu" / "largeValidation.csv"
    path.parent.mkdir()
    path.write_text("\n".join(lines[:2] + [row] + lines[3:]) + "\n")
    with raises_naming(path, *phrases):
        load_dataset("ocr-letters", "test", data_dir=tmp_path)


def test_a_split_of_no_samples_is_refused_when_read(tmp_path):
    """Well-formed IDX files of 0 items: an accuracy of 0 / 0 after training, before this."""
    import gzip
    import struct

    folder = tmp_path / "mnist"
    folder.mkdir()
    for prefix in ("train", "t10k"):
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(struct.pack(">IIII", 2051, 0, 28, 28))
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(struct.pack(">II", 2049, 0))
    with pytest.raises(PartrainError, match="mnist's test split in .* holds no samples"):
        load_dataset("mnist", "test", data_dir=tmp_path)


# --- token datasets -------------------------------------------------------------------------

def test_generated_tokens_are_next_token_pairs_and_a_pure_function_of_the_index():
    ds = load_dataset("tokens@16", "train", seed=3)
    x, y = ds.get(torch.tensor([5, 9, 5]))
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert torch.equal(x[0], x[2]) and not torch.equal(x[0], x[1])
    assert torch.equal(load_dataset("tokens@16", "train", seed=3).get(torch.tensor([9]))[0][0], x[1])
    assert not torch.equal(load_dataset("tokens@16", "test", seed=3).get(torch.tensor([5]))[0][0], x[0])
    assert not torch.equal(load_dataset("tokens@16", "train", seed=4).get(torch.tensor([5]))[0][0], x[0])


@pytest.mark.parametrize("source", ["tokens@16", "text"])
def test_token_data_held_on_a_device_gives_the_host_batches(tmp_path, source):
    if source == "text":
        (tmp_path / "t.txt").write_text("na\u00efve caf\u00e9 " * 400)
        source = f"text:{tmp_path / 't.txt'}@8"
    for split in ("train", "test"):
        host = load_dataset(source, split)
        held = host.to(torch.device("cpu"))  # what a GPU gets, made and indexed the same way
        assert held is not host and held.device_bytes() == held._held.numel()
        idx = torch.randperm(len(host), generator=torch.Generator().manual_seed(0))[:40]
        for a, b in zip(host.get(idx), held.get(idx), strict=True):
            assert b.dtype == torch.int64 and torch.equal(a, b)
    with pytest.raises(IndexError):
        held.get(torch.tensor([len(held)]))


def test_text_file_gives_byte_windows_split_90_10(tmp_path):
    text = "na\u00efve caf\u00e9 " * 40  # UTF-8 with two-byte characters
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    raw = torch.tensor(list(text.encode("utf-8")))
    train = load_dataset(f"text:{path}@8", "train")
    test = load_dataset(f"text:{path}@8", "test")
    cut = int(len(raw) * 0.9)
    assert len(train) == (cut - 1) // 8 and len(test) == (len(raw) - cut - 1) // 8
    x, y = train.get(torch.tensor([2]))
    assert torch.equal(x[0], raw[16:24]) and torch.equal(y[0], raw[17:25])
    assert torch.equal(test.get(torch.tensor([0]))[0][0], raw[cut:cut + 8])


def test_text_file_refusals(tmp_path):
    with pytest.raises(PartrainError, match="not found"):
        dataset_spec(f"text:{tmp_path}/missing.txt")
    with pytest.raises(PartrainError, match=r"not found \(a context after '@' is a whole number"):
        dataset_spec(f"text:{tmp_path}/missing.txt@-1")
    with pytest.raises(PartrainError, match="is a directory"):
        dataset_spec(f"text:{tmp_path}")
    with pytest.raises(PartrainError, match="needs a file"):
        dataset_spec("text:")
    (tmp_path / "bin.txt").write_bytes(bytes([0xFF, 0xFE]) * 100)
    with pytest.raises(PartrainError, match="not UTF-8"):
        dataset_spec(f"text:{tmp_path}/bin.txt")
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(PartrainError, match="too few"):
        load_dataset(f"text:{tmp_path}/short.txt", "train")
