"""``ModelSpec``: a model with the defaults and the layout table that travel with it.

As torchtitan's ``ModelSpec`` bundles a model with its parallelism plan, a spec bundles a factory
with the layout table (in ``layouts/``) its weights are named for, its optimizer and tuned rates,
its input and the layers ``--remat blocks`` recomputes. Scripts, ``dtk-explain``, the planner's
callers, tests and benchmarks read their defaults from ``dtk.models.MODEL_SPECS``, so they cannot
disagree. No TensorFlow here: the model modules import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model with the defaults that travel with it (as torchtitan's ``ModelSpec``).

    Scripts, tests and benchmarks derive their defaults from here, so they cannot disagree.

    Attributes:
      name: the short name (``--model``).
      factory: builds a new, plain tf_keras model (laid out when called under a layout scope).
      layout: the layout table (in ``layouts/``) written for the model's weight names: what
        ``--layout`` defaults to, and ``dtk-explain --model`` shows.
      optimizer: the default optimizer name.
      learning_rates: tuned learning rate per optimizer name; others use ``fallback_rate``.
      input_shape: one example's input shape, without the batch dim (None: several named
        inputs, e.g. DLRM's ``{"dense", "ids"}``).
      num_classes: output classes (labels must lie in ``[0, num_classes)``); None for one logit.
      note: why the defaults are what they are.
      remat: the layers ``remat=("blocks",)`` (``--remat blocks``) recomputes: layer-name
        patterns of the model's repeated blocks.
    """

    name: str
    factory: Callable[[], Any]
    layout: str
    optimizer: str
    learning_rates: dict[str, float]
    input_shape: tuple[int, ...] | None
    num_classes: int | None
    note: str = ""
    remat: tuple[str, ...] = ()

    def remat_patterns(self, requested) -> tuple[str, ...]:
        """``requested`` layer-name patterns, with ``"blocks"`` replaced by the model's own."""
        out = []
        for pattern in requested:
            out.extend(self.remat if pattern == "blocks" else [pattern])
        return tuple(out)

    def learning_rate(self, optimizer: str) -> float:
        """The tuned rate for ``optimizer``, else 0.1 for SGD and 1e-3 for adaptive optimizers."""
        key = optimizer.lower()
        return self.learning_rates.get(key, 0.1 if key == "sgd" else 1e-3)
