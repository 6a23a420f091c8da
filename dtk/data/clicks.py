"""A generated click log for recommender models: ids with Zipf popularity, labels from a hidden model.

Recommenders (DLRM, two-tower, wide & deep) are the models that send TensorFlow users to many
devices, because of their embedding tables, yet no public click log fits on every machine or can be
downloaded at test time. This module makes one, deterministically from a seed, at any size, one
chunk at a time (never the whole log in memory), with a known best achievable AUC:

* dense features: ``num_dense`` standard normal floats per example;
* categorical features: one id per table, drawn from a truncated Zipf law over ``[0, rows)``
  (``P(rank k) ~ (k + 1) ** -zipf_exponent``), the ranks scattered over the table by a fixed
  bijection so that popular ids do not all fall into the first row block of a row-sharded table;
* labels: ``Bernoulli(sigmoid(logit))`` with a hidden logit = bias + a linear function of the dense
  features + one effect per (table, id) + a dot product of two tables' latent vectors (a feature
  interaction, which DLRM's pairwise dot products can learn). Each id's effect and latent vector are a
  hash of (seed, table, id), so the hidden model needs no memory either.

The hidden logit ships with each held-out example: the AUC of the hidden model's own probability on
the held-out labels is the best any model can reach (``best_auc``).

Example::

    log = dtk.data.clicks.ClickLog(dtk.data.clicks.ClickLogConfig(seed=0))
    train = log.dataset("train", 200_000)   # tf.data of ({"dense", "ids"}, label), unbatched
    best = log.best_auc(20_000)             # the hidden model's AUC on the held-out split
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

DENSE = "dense"
IDS = "ids"
SPLITS = {"train": 0, "heldout": 1}
_CHUNK = 4096  # examples drawn per generator call (the unit of determinism: chunk i of a split)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickLogConfig:
    """The shape and the hidden model of a generated click log.

    Attributes:
      table_sizes: rows of each categorical feature's table (one id per example per table). The
        defaults span four orders of magnitude, as a real log's user, item, category and
        device-type features do.
      num_dense: dense float features per example.
      zipf_exponent: the popularity law's exponent (> 0; real logs measure about 1 to 1.2).
      effect_scales: the standard deviation of one id's hidden effect, per table (a popular
        table's long tail is weak, as real user ids are, or no model could learn it).
      interaction_scale: the size of the hidden dot product between the latent vectors of the ids
        of two tables (``interaction_tables``).
      interaction_tables: the two tables whose ids interact (the middle-sized ones by default:
        each pair of their ids is seen often enough to be learnt).
      latent_dim: the length of those latent vectors.
      bias: the hidden logit's intercept (negative: clicks are rarer than non-clicks).
      seed: every value of the log is a function of this seed.
    """

    table_sizes: tuple[int, ...] = (1 << 16, 1 << 12, 1 << 8, 16)
    num_dense: int = 8
    zipf_exponent: float = 1.05
    effect_scales: tuple[float, ...] = (0.3, 0.6, 0.8, 0.8)
    interaction_scale: float = 0.5
    interaction_tables: tuple[int, int] = (1, 2)
    latent_dim: int = 4
    bias: float = -1.0
    seed: int = 0

    def __post_init__(self):
        if not self.table_sizes or any(int(n) < 2 for n in self.table_sizes):
            raise ValueError(f"table_sizes must be one or more sizes of at least 2 rows; got "
                             f"{self.table_sizes}")
        if len(self.effect_scales) != len(self.table_sizes):
            raise ValueError(f"effect_scales needs one scale per table: {len(self.table_sizes)} "
                             f"tables, {len(self.effect_scales)} scales ({self.effect_scales})")
        if self.zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be > 0; got {self.zipf_exponent}")
        if self.num_dense < 1:
            raise ValueError(f"num_dense must be >= 1; got {self.num_dense}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2^63); got {self.seed!r}")
        a, b = self.interaction_tables
        if self.interaction_scale and not (a != b and 0 <= min(a, b) and max(a, b) < len(self.table_sizes)):
            raise ValueError(f"interaction_tables must name two different tables of the "
                             f"{len(self.table_sizes)}; got {self.interaction_tables} (or set "
                             "interaction_scale=0)")


def _mix(*keys: np.ndarray) -> np.ndarray:
    """splitmix64 over the keys: a counter-based hash, the same on every machine."""
    with np.errstate(over="ignore"):
        h = np.uint64(0x9E3779B97F4A7C15)
        for k in keys:
            h = np.asarray(h, np.uint64) ^ (np.asarray(k, np.uint64) + np.uint64(0x9E3779B97F4A7C15))
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
    return h


def _uniform(h: np.ndarray) -> np.ndarray:
    """A hash as a float in (0, 1)."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _normal(*keys) -> np.ndarray:
    """A standard normal per key (Box-Muller over two hashes)."""
    u1 = _uniform(_mix(*keys, 1))
    u2 = _uniform(_mix(*keys, 2))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class ClickLog:
    """The generated log of one ``ClickLogConfig``: its examples, datasets and best AUC."""

    def __init__(self, config: ClickLogConfig | None = None):
        if config is not None and not isinstance(config, ClickLogConfig):
            raise TypeError(f"config must be a dtk.data.clicks.ClickLogConfig (or None for the "
                            f"default log); got {type(config).__name__}")
        self.config = config or ClickLogConfig()
        c = self.config
        self._dense_w = _normal(c.seed, 101, np.arange(c.num_dense)) / math.sqrt(c.num_dense)
        # An odd multiplier is a bijection of [0, 2^k); for other sizes, one coprime to the size.
        self._scatter = []
        for size in c.table_sizes:
            a = 2654435761 % size or 1
            while math.gcd(a, size) != 1:
                a += 1
            self._scatter.append(a)

    def chunk(self, split: str, index: int, rows: int = _CHUNK) -> tuple[dict, np.ndarray, np.ndarray]:
        """Examples ``index * _CHUNK ...`` of ``split``: (features, labels float32 [n, 1], logits).

        The same (seed, split, index) gives the same examples on every machine and every call.
        """
        c = self.config
        stream = SPLITS[split]
        rng = np.random.default_rng([c.seed, stream, index])
        dense = rng.standard_normal((rows, c.num_dense)).astype(np.float32)
        ids = np.empty((rows, len(c.table_sizes)), np.int32)
        s = c.zipf_exponent
        for t, size in enumerate(c.table_sizes):
            u = rng.random(rows)
            if abs(s - 1.0) < 1e-9:
                rank = np.exp(u * math.log(size + 1.0)) - 1.0
            else:  # the inverse CDF of the continuous power law on [1, size + 1)
                top = (size + 1.0) ** (1.0 - s)
                rank = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - s)) - 1.0
            rank = np.minimum(rank.astype(np.int64), size - 1)
            ids[:, t] = (rank * self._scatter[t]) % size
        logits = self.logits(dense, ids)
        labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return {DENSE: dense, IDS: ids}, labels[:, None], logits

    def logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The hidden model's logit for each example (what the best possible model predicts)."""
        c = self.config
        out = c.bias + dense.astype(np.float64) @ self._dense_w
        for t, scale in enumerate(c.effect_scales):
            out += scale * _normal(c.seed, 200 + t, ids[:, t].astype(np.uint64))
        if c.interaction_scale:
            dims = np.arange(c.latent_dim, dtype=np.uint64)[None, :]
            a, b = c.interaction_tables
            u = _normal(c.seed, 300, ids[:, a:a + 1].astype(np.uint64), dims)
            v = _normal(c.seed, 301, ids[:, b:b + 1].astype(np.uint64), dims)
            out += c.interaction_scale * (u * v).sum(axis=1) / math.sqrt(c.latent_dim)
        return out

    def _chunks(self, split: str, num_examples: int):
        for index in range(-(-num_examples // _CHUNK)):
            yield self.chunk(split, index, min(_CHUNK, num_examples - index * _CHUNK))

    def dataset(self, split: str, num_examples: int):
        """Unbatched ``({"dense": float32 [num_dense], "ids": int32 [tables]}, float32 [1])``.

        Streamed: one chunk of 4,096 examples is in memory at a time.
        """
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}; got {split!r}")
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1; got {num_examples}")
        c = self.config
        spec = ({DENSE: tf.TensorSpec((None, c.num_dense), tf.float32),
                 IDS: tf.TensorSpec((None, len(c.table_sizes)), tf.int32)},
                tf.TensorSpec((None, 1), tf.float32))
        gen = lambda: ((f, y) for f, y, _ in self._chunks(split, num_examples))  # noqa: E731
        # The size is known: no counting pass over the generator (dtk.data.input counts a dataset
        # of unknown cardinality once).
        return tf.data.Dataset.from_generator(gen, output_signature=spec).unbatch().apply(
            tf.data.experimental.assert_cardinality(num_examples))

    def labels_and_logits(self, split: str, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
        """All labels and hidden logits of a split's first ``num_examples`` (small: 12 bytes each)."""
        parts = [(y[:, 0], z) for _, y, z in self._chunks(split, num_examples)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def best_auc(self, num_examples: int, split: str = "heldout") -> float:
        """The hidden model's own AUC on the split: what no model can beat (up to sampling noise)."""
        labels, logits = self.labels_and_logits(split, num_examples)
        return auc(labels, logits)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve, exactly (Mann-Whitney U; ties count one half).

    Raises:
      ValueError: labels of only one class (the AUC is undefined), or lengths that differ.
    """
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores, np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels and scores differ in length: {labels.shape[0]} labels, "
                         f"{scores.shape[0]} scores")
    positives = int((labels > 0.5).sum())
    negatives = labels.size - positives
    if not positives or not negatives:
        raise ValueError(f"AUC needs both classes; got {positives} positive and {negatives} "
                         "negative labels")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, np.float64)
    sorted_scores = scores[order]
    # average ranks over ties
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], scores.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[labels > 0.5].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of logits, computed stably."""
    labels = np.asarray(labels, np.float64).reshape(-1)
    logits = np.asarray(logits, np.float64).reshape(-1)
    return float(np.mean(np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits)))))
