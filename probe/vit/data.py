"""Image data sets, offline: Fashion-MNIST (idx files) and CIFAR-10/100 (python-pickle batches).

* ``fashion-mnist``: the standard idx files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each plain or ``.gz``.  Debian's package
  ``dataset-fashion-mnist`` installs them in :data:`FASHION_MNIST_DIR` (the default).  Any MNIST-format set
  (MNIST itself, KMNIST) reads the same way.
* ``cifar10``: the directory ``cifar-10-batches-py`` (``data_batch_1`` .. ``data_batch_5``, ``test_batch``), or
  its parent.
* ``cifar100``: the directory ``cifar-100-python`` (``train``, ``test``; the ``fine_labels``), or its parent.

Every problem (missing directory or file, truncated or corrupt file, wrong magic number, counts that do not
match, labels out of range) raises :class:`probe.core.errors.ProbeError` with a message that says what to do.
CIFAR batches are read by a restricted unpickler that builds only the types the format uses (dicts,
lists, strings, numbers, numpy arrays): a file that names any other Python object is refused, so a crafted
file cannot run code.
Images are kept as ``uint8 (N, C, H, W)``; :meth:`ImageData.normalise` maps a batch to floats with the
training set's per-channel mean and standard deviation: the same for every attention, no augmentation.
"""

from __future__ import annotations

import gzip
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probe.core.errors import ProbeError

__all__ = ["FASHION_MNIST_DIR", "DATASETS", "ImageData", "load_data", "read_idx", "default_data_dir"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DATASETS = ("fashion-mnist", "cifar10", "cifar100")
_IDX_TYPES = {0x08: np.uint8}


@dataclass
class ImageData:
    name: str
    train_images: torch.Tensor  # uint8 (N, C, H, W)
    train_labels: torch.Tensor  # int64 (N,)
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    source: str

    def __post_init__(self):
        x = self.train_images.double() / 255.0
        self.mean = x.mean(dim=(0, 2, 3)).float()
        self.std = x.std(dim=(0, 2, 3)).float().clamp_min(1e-6)

    @property
    def channels(self) -> int:
        return self.train_images.shape[1]

    @property
    def image_size(self) -> int:
        return self.train_images.shape[2]

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8 (B, C, H, W)`` -> ``float32``, standardised per channel with the training set's statistics."""
        return (images.float() / 255.0 - self.mean[:, None, None]) / self.std[:, None, None]


def default_data_dir(name: str) -> Path | None:
    return FASHION_MNIST_DIR if name == "fashion-mnist" else None


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as error:
        raise ProbeError(
            f"cannot read {path} ({error}): the file is damaged or not what its name says. Replace it with "
            "a fresh copy of the data set (for Fashion-MNIST: apt install --reinstall dataset-fashion-mnist)."
        ) from None


def read_idx(path: Path) -> np.ndarray:
    """One idx file (plain or ``.gz``) as a numpy array of its declared shape (unsigned bytes only)."""
    data = _read_bytes(path)
    bad = (
        f"{path} is not a valid idx file of unsigned bytes ({{}}). Replace it with a fresh copy of the data "
        "set (for Fashion-MNIST: apt install --reinstall dataset-fashion-mnist)."
    )
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ProbeError(bad.format("wrong magic number"))
    dtype, ndim = data[2], data[3]
    if dtype not in _IDX_TYPES or ndim == 0:
        raise ProbeError(bad.format(f"type code {dtype:#x} with {ndim} dimensions"))
    if len(data) < 4 + 4 * ndim:
        raise ProbeError(bad.format("truncated header"))
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    expected = 4 + 4 * ndim + int(np.prod(shape))
    if len(data) != expected:
        raise ProbeError(bad.format(f"{len(data)} bytes where its header {shape} needs {expected}"))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise ProbeError(
        f"{directory} has no {stem} or {stem}.gz: --data-dir must hold the four idx files of an MNIST-format "
        "data set (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        "t10k-labels-idx1-ubyte, plain or .gz). For Fashion-MNIST: apt install dataset-fashion-mnist, which "
        f"puts them in {FASHION_MNIST_DIR}."
    )


def _idx_split(directory: Path, prefix: str):
    images = read_idx(_find(directory, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find(directory, f"{prefix}-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ProbeError(
            f"the {prefix} files in {directory} do not match: images of shape {images.shape}, labels of shape "
            f"{labels.shape} (expected (N, H, W) and (N,)). Replace them with a fresh copy of the data set."
        )
    if images.shape[0] == 0:
        raise ProbeError(f"the {prefix} files in {directory} hold no images: replace them with the full data set.")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


#: the only globals a CIFAR python batch may name: numpy's array and scalar reconstructors under their
#: numpy 1 and numpy 2 module names, ``numpy.ndarray``, ``numpy.dtype``, and ``_codecs.encode`` (the bytes
#: of protocol-2 pickles written by Python 3).  None of them runs code of the file's choosing.
_CIFAR_GLOBALS = frozenset(
    [(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
     for name in ("_reconstruct", "scalar")]
    + [(module, "_frombuffer") for module in ("numpy.core.numeric", "numpy._core.numeric")]
    + [("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")]
)


class _UnsafePickle(Exception):
    """A pickle names a global outside :data:`_CIFAR_GLOBALS`."""


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, strings, numbers and numpy arrays only: any other global (a
    function such as ``os.system``, a class) is refused before it is looked up, so a crafted file runs no code."""

    def find_class(self, module, name):
        if (module, name) not in _CIFAR_GLOBALS:
            raise _UnsafePickle(f"{module}.{name}")
        return super().find_class(module, name)


def _load_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return _CifarUnpickler(f, encoding="bytes").load()
    except _UnsafePickle as error:
        raise ProbeError(
            f"refusing to read {path}: it names the Python object {error}, which a CIFAR python batch never "
            "holds (only dicts, lists, strings, numbers and numpy arrays), and unpickling it could run code. "
            "Replace it with a fresh copy of the python version of the data set from its official source."
        ) from None
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ProbeError(
            f"cannot read {path} as a CIFAR python batch ({type(error).__name__}: {error}). Replace it with a "
            "fresh copy of the python version of the data set (cifar-10-python.tar.gz / cifar-100-python.tar.gz)."
        ) from None


def _cifar_batch(path: Path, label_key: bytes):
    batch = _load_pickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise ProbeError(
            f"{path} is not a CIFAR python batch (no {b'data'!r} and {label_key!r} entries). Replace it with a "
            "fresh copy of the python version of the data set."
        )
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
        raise ProbeError(
            f"{path} holds data of shape {data.shape} ({data.dtype}) and {labels.shape[0]} labels; a CIFAR batch "
            "has N x 3072 unsigned bytes and N labels. Replace it with a fresh copy of the data set."
        )
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)


def _cifar(directory: Path, name: str):
    if name == "cifar10":
        sub, train_files, test_files, key, classes = (
            "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels", 10
        )
    else:
        sub, train_files, test_files, key, classes = "cifar-100-python", ["train"], ["test"], b"fine_labels", 100
    if (directory / sub).is_dir():
        directory = directory / sub
    missing = [f for f in train_files + test_files if not (directory / f).is_file()]
    if missing:
        raise ProbeError(
            f"{directory} is not a {name} directory: {', '.join(missing)} missing. --data-dir must be the "
            f"unpacked python version of the data set ({sub}/ with {', '.join(train_files + test_files)}) or its "
            "parent. No copy of CIFAR exists offline on this machine; download it where the internet is reachable."
        )
    parts = {}
    for split, files in (("train", train_files), ("test", test_files)):
        batches = [_cifar_batch(directory / f, key) for f in files]
        parts[split] = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    return parts, classes, directory


def load_data(name: str, data_dir: str | Path | None = None) -> ImageData:
    """Load a data set by name (``fashion-mnist``, ``cifar10``, ``cifar100``) from ``data_dir``."""
    if name not in DATASETS:
        raise ProbeError(f"unknown data set {name!r}: --data must be one of {', '.join(DATASETS)}.")
    directory = Path(data_dir) if data_dir is not None else default_data_dir(name)
    if directory is None:
        raise ProbeError(f"--data {name} needs --data-dir: the directory holding its python batches.")
    if not directory.is_dir():
        hint = " (apt install dataset-fashion-mnist installs it there)" if directory == FASHION_MNIST_DIR else ""
        raise ProbeError(f"the data directory {directory} does not exist{hint}: give the right --data-dir.")
    if name == "fashion-mnist":
        train, test = _idx_split(directory, "train"), _idx_split(directory, "t10k")
        classes = 10
    else:
        parts, classes, directory = _cifar(directory, name)
        train, test = parts["train"], parts["test"]
    if train[0].shape[1:] != test[0].shape[1:]:
        raise ProbeError(
            f"the training images ({tuple(train[0].shape[1:])}) and test images ({tuple(test[0].shape[1:])}) in "
            f"{directory} differ in shape: the files come from different data sets."
        )
    for split, labels in (("training", train[1]), ("test", test[1])):
        if labels.min() < 0 or labels.max() >= classes:
            raise ProbeError(
                f"the {split} labels in {directory} range over {int(labels.min())}..{int(labels.max())}, outside "
                f"0..{classes - 1} for {name}: the files are damaged or belong to another data set."
            )
    return ImageData(name, train[0], train[1], test[0], test[1], classes, str(directory))
