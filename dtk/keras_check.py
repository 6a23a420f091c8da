"""Which Keras: dtk needs Keras 2 (``tf_keras``) and says so when handed a Keras 3 object.

In TensorFlow >= 2.16 ``tf.keras`` is Keras 3, which has no DTensor path. A Keras 3 model, layer,
loss, optimizer or metric passed to dtk otherwise fails deep inside (``'Sequential' object has no
attribute '_flatten'``) or, for a loss, inside the graph at step 1. Every entry point of dtk that
takes a Keras object calls ``require_keras2`` first.
"""

from __future__ import annotations

import inspect
from typing import Any

_FIX = ("DTensor needs Keras 2: build it with tf_keras (`import tf_keras as keras`), or set "
        "TF_USE_LEGACY_KERAS=1 in the environment before TensorFlow is imported so that tf.keras "
        "is Keras 2")


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
        raise TypeError(f"{what} is a Keras 3 object ({kind} from "
                        f"{getattr(type(obj) if not inspect.isroutine(obj) else obj, '__module__', '?')}"
                        f"), which has no DTensor support. {_FIX}")
