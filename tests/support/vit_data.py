"""Tiny ViT settings and tiny MNIST-format image files (idx, gzipped or not) for the ViT's tests."""

from __future__ import annotations

import gzip
import struct

import numpy as np

TINY = dict(dim=16, depth=2, heads=2, head_dim=8, mlp_dim=32, patch=4)


# --------------------------------------------------------------------------- tiny data in both formats
def write_idx(path, array, gz=True):
    array = np.asarray(array, dtype=np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist(directory, n_train=64, n_test=32, size=8, classes=4, seed=0, gz=True):
    """Tiny MNIST-format data: class c images are bright in quadrant c (learnable)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % classes
        images = rng.integers(0, 60, size=(n, size, size))
        h = size // 2
        for i, c in enumerate(labels):
            r, col = divmod(int(c), 2)
            images[i, r * h : (r + 1) * h, col * h : (col + 1) * h] += 180
        write_idx(directory / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte", labels, gz)
    return directory
