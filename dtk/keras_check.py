"""Which Keras: dtk needs Keras 2 (``tf_keras``) and says so when handed a Keras 3 object.

In TensorFlow >= 2.16 ``tf.keras`` is Keras 3, which has no DTensor path. A Keras 3 model, layer,
loss, optimizer or metric passed to dtk otherwise fails deep inside (``'Sequential' object has no
attribute '_flatten'``) or, for a loss, inside the graph at step 1. Every entry point of dtk that
takes a Keras object calls ``require_keras2`` first.
"""

from __future__ import annotations

import inspect
from typing import Any

_FIX = ("This dtk entry point takes tf_keras (Keras 2) objects: build it with tf_keras (`import "
        "tf_keras as keras`, or TF_USE_LEGACY_KERAS=1 before TensorFlow is imported so that "
        "tf.keras is Keras 2). A Keras 3 model trains on the mesh through dtk.distribute(factory, "
        "mesh) or keras.distribution after dtk.enable_keras_distribution()")


class Keras3Model(TypeError):
    """A Keras 3 model where a tf_keras one was expected; carries the model, so that
    ``dtk.distribute`` can take the Keras 3 path instead."""

    def __init__(self, message: str, model: Any):
        super().__init__(message)
        self.model = model


def is_keras3(obj: Any) -> bool:
    """True for an object (or class, or function) that comes from the Keras 3 package."""
    candidates = [obj] if inspect.isclass(obj) or inspect.isroutine(obj) else [type(obj)]
    if inspect.isclass(candidates[0]):
        candidates = list(inspect.getmro(candidates[0]))
    for c in candidates:
        module = getattr(c, "__module__", "") or ""
        if module == "keras" or module.startswith("keras."):
            return True
    return False


def require_keras2(obj: Any, what: str) -> None:
    """Raises a ``TypeError`` that explains the fix when ``obj`` is a Keras 3 object.

    Args:
      obj: the object the user passed.
      what: the argument's name, e.g. ``"model"`` or ``"loss"``.
    """
    if is_keras3(obj):
        kind = type(obj).__name__ if not inspect.isroutine(obj) else getattr(obj, "__name__", "")
        message = (f"{what} is a Keras 3 object ({kind} from "
                   f"{getattr(type(obj) if not inspect.isroutine(obj) else obj, '__module__', '?')}"
                   f"). {_FIX}")
        if not inspect.isroutine(obj) and hasattr(obj, "fit") and hasattr(obj, "variables"):
            raise Keras3Model(message, obj)
        raise TypeError(message)
