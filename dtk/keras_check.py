"""Which Keras: dtk needs Keras 2 (``tf_keras``) and says so when handed a Keras 3 object.

In TensorFlow >= 2.16 ``tf.keras`` is Keras 3, which has no DTensor path. A Keras 3 model, layer,
loss, optimizer or metric passed to dtk otherwise fails deep inside (``'Sequential' object has no
attribute '_flatten'``) or, for a loss, inside the graph at step 1. Every entry point of dtk that
takes a Keras object calls ``require_keras2`` first.
"""

from __future__ import annotations

import inspect
import re
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


def call_factory(model_factory: Any) -> Any:
    """``model_factory()``, where a Keras 3 object inside a tf_keras model is one line naming the
    two Kerases and the fix: a layer (``tf_keras.Sequential([keras.layers.Dense(10)])``: tf_keras
    says only "must be an instance of class Layer"), or an optimizer or loss given to tf_keras's
    ``compile`` ("Could not interpret optimizer identifier: <keras.src...>")."""
    try:
        return model_factory()
    except (TypeError, ValueError) as e:
        text = str(e)
        if "keras.src." not in text:
            raise
        found = re.search(r"Could not interpret (\w+) identifier: <(keras\.src\.[\w.]+)", text)
        if found is not None:  # tf_keras's compile in the factory, handed a Keras 3 object
            raise ValueError(
                f"model_factory compiled a tf_keras model with a Keras 3 {found.group(1)} "
                f"({found.group(2).rsplit(' ', 1)[0]}): tf_keras takes its own objects; use "
                f"tf_keras.{found.group(1)}s (tf_keras.optimizers.Adam(...)), or build the whole "
                "model with Keras 3 (import keras), which dtk.distribute takes too") from None
        found = re.search(r"<class '(keras\.src\.[\w.]+)'>", text)
        what = found.group(1).rsplit(".", 1)[-1] if found else None
        raise TypeError(
            f"model_factory mixes Keras 3 ({what or 'an object'}, from the keras package) into a "
            "tf_keras model: the two Kerases' layers do not compose. Build it all with tf_keras ("
            f"tf_keras.layers{'.' + what if what else ''}), or all with keras and pass the Keras 3 "
            "factory to dtk.distribute") from e
