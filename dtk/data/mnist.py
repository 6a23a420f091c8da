"""MNIST, the example data set: ``tensorflow_datasets`` (the default), LeCun IDX files, a bundled sample.

This is example data, kept apart from dtk's input path (``dtk.data.input``), which takes any
``tf.data.Dataset``.

Both give the same ``tf.data.Dataset`` of unbatched ``(image, label)`` pairs: image float32
``[28, 28, 1]`` in [0, 1], label int64 ``[]``.

Offline, ``tfds.load`` retries for minutes before it fails; ``load_mnist(source="tfds")`` instead
checks whether the data is prepared and, if not, whether the download host answers within a few
seconds. If it cannot get the data and no ``data_dir`` was given, it falls back to the sample
bundled with dtk (the first 2,000 training and 1,000 test images, ``dtk/data/mnist_sample``) and
logs one warning that says so and how to get the full data; with a ``data_dir`` it raises
``DataUnavailableError`` in one line that names the offline route. Setting ``DTK_OFFLINE=1`` skips
the network check (treats the machine as offline).
"""

from __future__ import annotations

import gzip
import logging
import os
import socket
from pathlib import Path

import numpy as np
import tensorflow as tf

from dtk import _env

_log = logging.getLogger("dtk")
SOURCES = ("tfds", "idx", "sample")
SAMPLE_DIR = Path(__file__).resolve().parent / "mnist_sample"
SAMPLE_SIZES = {"train": 2000, "test": 1000}
_SAMPLE_NOTICE: list[bool] = []  # the fallback notice is given once per process

SPLITS = ("train", "test")
_IDX_PREFIX = {"train": "train", "test": "t10k"}
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_DOWNLOAD_HOST = ("storage.googleapis.com", 443)
_NETWORK_TIMEOUT_S = 3.0


class DataUnavailableError(ValueError):
    """The data is neither prepared locally nor downloadable (no network)."""


def read_idx(path: str) -> np.ndarray:
    """Reads one LeCun IDX file (optionally gzip-compressed) into a numpy array.

    The header is big-endian: two zero bytes, a type code (0x08 = uint8), the number of dims, then
    one 4-byte size per dim.

    Raises:
      ValueError: the file is missing, unreadable, has a bad magic number or a wrong length.
    """
    if not os.path.isfile(path):
        raise ValueError(f"IDX file {path} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"IDX file {path} cannot be read: {e}") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"IDX file {path}: bad magic number {data[:4].hex()!r}; expected "
                         "00 00 <type> <ndim> (e.g. 00000803 for images, 00000801 for labels)")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"IDX file {path} is truncated: header of {ndim} dims needs {header} bytes")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"IDX file {path}: header says shape {shape} ({expected} bytes) but the "
                         f"file has {len(data)} bytes; the file is truncated or corrupt")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def _find(data_dir: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise ValueError(f"MNIST IDX file {stem}[.gz] not found in {data_dir!r}; it must hold "
                     "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
                     "t10k-labels-idx1-ubyte (optionally .gz)")


def read_mnist_idx(split: str, data_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [n, 28, 28], labels uint8 [n])`` of a split, from IDX files in data_dir."""
    _check_split(split)
    if not data_dir or not os.path.isdir(data_dir):
        raise ValueError(f"data_dir {data_dir!r} is not a directory of MNIST IDX files")
    prefix = _IDX_PREFIX[split]
    images_path = _find(data_dir, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(data_dir, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(f"{images_path} has shape {images.shape} and {labels_path} {labels.shape}; "
                         "expected images [n, rows, cols] and labels [n]")
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{images_path} holds images of {images.shape[1]}x{images.shape[2]} "
                         "pixels; MNIST images are 28x28. Point data_dir at the MNIST IDX files")
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} holds "
                         f"{len(labels)} labels; the files do not belong together")
    return images, labels


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")


@tf.autograph.experimental.do_not_convert  # plain ops; also avoids AutoGraph's conversion cache
def _to_example(image, label):
    image = tf.cast(image, tf.float32) / 255.0
    return tf.reshape(image, [28, 28, 1]), tf.cast(label, tf.int64)


def random_shift(image, label, *, pixels: int = 2):
    """Augmentation: shifts a ``[28, 28, 1]`` image by up to ``pixels`` in each direction."""
    padded = tf.pad(image, [[pixels, pixels], [pixels, pixels], [0, 0]])
    return tf.image.random_crop(padded, tf.shape(image)), label


def network_reachable() -> bool:
    """Whether the TFDS download host answers within a few seconds (False if DTK_OFFLINE=1)."""
    if _env.get_flag(_env.OFFLINE):
        return False
    try:
        with socket.create_connection(_DOWNLOAD_HOST, timeout=_NETWORK_TIMEOUT_S):
            return True
    except OSError:
        return False


def load_mnist(split: str, *, source: str = "tfds", data_dir: str | None = None) -> tf.data.Dataset:
    """MNIST ``split`` as unbatched ``(image float32 [28,28,1] in [0,1], label int64)`` pairs.

    Args:
      split: ``train`` or ``test``.
      source: ``tfds`` (tensorflow_datasets; downloads once when online; falls back to the
        bundled sample when it cannot and ``data_dir`` is None), ``idx`` (LeCun IDX files in
        ``data_dir``, e.g. ``../shared/data/mnist``) or ``sample`` (the bundled sample).
      data_dir: TFDS data directory, or the directory of IDX files.

    Raises:
      DataUnavailableError: TFDS data is not prepared in ``data_dir`` and the network is
        unreachable.
      ValueError: bad split or source, missing or corrupt IDX files.
    """
    _check_split(split)
    if source not in SOURCES:
        raise ValueError(f"source {source!r} is not one of {', '.join(SOURCES)}")
    if source in ("idx", "sample"):
        images, labels = read_mnist_idx(split, data_dir if source == "idx" else str(SAMPLE_DIR))
        return tf.data.Dataset.from_tensor_slices((images, labels)).map(_to_example)
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    builder = tfds.builder("mnist", data_dir=data_dir)
    if not builder.is_prepared():
        if not network_reachable():
            if data_dir is None:
                if not _SAMPLE_NOTICE:
                    _SAMPLE_NOTICE.append(True)
                    _log.warning(
                        "MNIST is not prepared for tensorflow_datasets and its download host "
                        "(%s) is unreachable: using the sample bundled with dtk (%d training, "
                        "%d test images; lower accuracy). For the full data run once with "
                        "internet, or pass --dataset idx --data_dir DIR", _DOWNLOAD_HOST[0],
                        SAMPLE_SIZES["train"], SAMPLE_SIZES["test"])
                return load_mnist(split, source="sample")
            raise DataUnavailableError(
                f"MNIST is not prepared in the TFDS data dir ({builder.data_dir}) and its download "
                f"host ({_DOWNLOAD_HOST[0]}) is unreachable, so tensorflow_datasets cannot download "
                "it; use the offline IDX files: source='idx' with data_dir=DIR (train_mnist.py: "
                "--dataset idx --data_dir DIR)")
        builder.download_and_prepare()
    return builder.as_dataset(split=split, as_supervised=True).map(_to_example)
