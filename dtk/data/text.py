"""Text for language models, with no download: bytes of Python's own standard library (or a file).

Example data, like ``dtk.data.mnist``: the Python standard library's ``.py`` files (about 13 MB under
``sysconfig.get_paths()["stdlib"]``, on every machine with Python) or any text file, read as bytes
(tokens 0..255), split into training and held-out text BY FILE (every ``heldout_every``-th file
is held out, so held-out code is code the model never saw), cut into windows of ``seq_len + 1``
bytes: inputs are the first ``seq_len`` bytes, targets the next byte at each position.

Example::

    corpus = dtk.data.text.load_corpus()                  # TextCorpus(train=bytes, heldout=bytes, ...)
    train = dtk.data.text.windows(corpus.train, seq_len=128)   # tf.data of (int32 [128], int64 [128])
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sysconfig
from collections import Counter

import numpy as np
import tensorflow as tf

_log = logging.getLogger("dtk")

VOCAB = 256  # byte-level


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextCorpus:
    """Training and held-out bytes, and where they came from."""

    train: bytes
    heldout: bytes
    source: str
    num_files: int


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files (not site-packages, not tests), in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages",
                                                            "test", "tests", "__pycache__",
                                                            "idlelib", "lib2to3"))
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    return files


BINARY_SHARE_WARNING = 0.05  # more than this share of non-text bytes: a warning


def binary_share(data: bytes, sample: int = 1 << 20) -> float:
    """The share of bytes (in the first MiB) that are not text: bytes of invalid UTF-8 sequences,
    and control characters other than tab, newline, carriage return and form feed."""
    head = data[:sample]
    if not head:
        return 0.0
    decoded = head.decode("utf-8", errors="replace")
    bad = decoded.count("\ufffd") + sum(
        1 for c in decoded if ord(c) < 32 and c not in "\t\n\r\f")
    return bad / max(len(decoded), 1)


def load_corpus(text_file: str | None = None, *, heldout_every: int = 20,
                max_bytes: int | None = None) -> TextCorpus:
    """Reads the corpus: ``text_file`` (split by position: the last 1/heldout_every held out), or
    the standard library's ``.py`` files (split by file).

    Raises:
      ValueError: an unreadable or too small text file, or no standard library files found.
    """
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2; got {heldout_every}")
    if text_file is not None:
        try:
            with open(text_file, "rb") as f:
                data = f.read(max_bytes) if max_bytes else f.read()
        except OSError as e:
            raise ValueError(f"--text_file {text_file!r} cannot be read: {e.strerror}") from None
        share = binary_share(data)
        if share > BINARY_SHARE_WARNING:
            _log.warning("--text_file %s: %.0f%% of its bytes are not text (invalid UTF-8 or "
                         "control characters); is it a text file?", text_file, 100 * share)
        cut = len(data) - len(data) // heldout_every
        corpus = TextCorpus(train=data[:cut], heldout=data[cut:], source=text_file, num_files=1)
    else:
        files = stdlib_files()
        if not files:
            raise ValueError(f"no .py files under {sysconfig.get_paths()['stdlib']}; pass a text "
                             "file (--text_file)")
        train, heldout, total = [], [], 0
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                data = f.read()
            (heldout if i % heldout_every == heldout_every - 1 else train).append(data)
            total += len(data)
            if max_bytes and total >= max_bytes:
                break
        corpus = TextCorpus(train=b"".join(train), heldout=b"".join(heldout),
                            source=f"Python {sysconfig.get_python_version()} standard library",
                            num_files=len(files))
    if min(len(corpus.train), len(corpus.heldout)) < 1024:
        raise ValueError(f"text {corpus.source!r} is too small: {len(corpus.train)} training and "
                         f"{len(corpus.heldout)} held-out bytes; give at least a few KB")
    return corpus


def windows(data: bytes, *, seq_len: int, stride: int | None = None) -> tf.data.Dataset:
    """Unbatched ``(tokens int32 [seq_len], next tokens int64 [seq_len])`` windows of ``data``.

    Windows start every ``stride`` bytes (``seq_len`` by default: every byte is a target once).
    """
    stride = stride or seq_len
    array = np.frombuffer(data, np.uint8)
    starts = np.arange(0, len(array) - seq_len - 1, stride)
    if not len(starts):
        raise ValueError(f"seq_len {seq_len} (--seq_len) needs windows of {seq_len + 1} bytes, "
                         f"but the text has {len(array)}; use a smaller --seq_len (at most "
                         f"{max(len(array) - 2, 0)}) or a longer text")
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunks = array[index]
    return tf.data.Dataset.from_tensor_slices((chunks[:, :-1].astype(np.int32),
                                               chunks[:, 1:].astype(np.int64)))


def unigram_bits_per_byte(data: bytes) -> float:
    """The corpus's byte-unigram entropy: what a model that ignores context can reach."""
    counts = np.array(list(Counter(data).values()), np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def bits_per_byte(loss_nats: float) -> float:
    """A mean cross-entropy in nats per byte, in bits per byte."""
    return loss_nats / math.log(2)
