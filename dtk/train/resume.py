"""What a checkpoint records about the run that wrote it, and the check a resume makes.

A resume continues a trajectory only if what shapes it is unchanged. Every dtk checkpoint stores
the run's id and its **settings**: the seed, the optimizer and its learning rate (or schedule),
the global batch size, the data's size, the model's layers and their hyper-parameters (dropout
rates included), and whatever the caller adds (a script adds its data source). On resume,
``changes`` compares them with the current run's; the Trainer refuses any difference in one
``ValueError`` that lists each changed key with its old and new value, unless the user allowed
it (``TrainerConfig.allow_change``, ``--allow_change``), in which case the new value is really
applied (a new learning rate is set on the restored optimizer) and reported. The mesh and the
number of clients are recorded too but may change freely: dtk resumes exactly across meshes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import tf_keras

_log = logging.getLogger("dtk")

# Recorded, may change on resume (one info line): dtk resumes exactly across meshes.
FREE_KEYS = ("mesh", "num_clients")
# Layer config keys that are names or bookkeeping, not hyper-parameters.
# rng_type: how Keras would draw, which dtk's steps replace (dtk.parallel.randomness draws by
# seed, step, layer and index whatever it is); a pipeline's lazy whole model and a laid-out
# build report different ones for the same draws.
_NOT_HYPER = {"name", "trainable", "dtype", "batch_input_shape", "input_shape", "rng_type"}


def _plain(value: Any) -> Any:
    """``value`` as JSON-comparable data (tuples become lists; objects their JSON)."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def learning_rate_of(optimizer: Any) -> Any:
    """The optimizer's learning rate: a float, or a schedule's class and config."""
    lr = getattr(optimizer, "_learning_rate", None)
    if isinstance(lr, tf_keras.optimizers.schedules.LearningRateSchedule):
        return {"schedule": type(lr).__name__, **_plain(lr.get_config())}
    try:
        return float(f"{float(optimizer.learning_rate.numpy()):.7g}")  # float32: 7 digits
    except (AttributeError, TypeError, ValueError):
        return None


def model_settings(model: tf_keras.Model) -> dict[str, Any]:
    """Every layer's scalar hyper-parameters, keyed ``model.<position>:<class>.<key>``.

    Layers are named by their position and class (``model.3:Dropout.rate``), never by name: the
    names of unnamed layers and models (``model_79``) depend on what else the process built.
    """
    out: dict[str, Any] = {}
    for index, layer in enumerate(model._flatten_layers(include_self=False)):  # pylint: disable=protected-access
        try:
            config = layer.get_config()
        except (NotImplementedError, TypeError, AttributeError):
            continue
        for key, value in sorted(config.items()):
            if key in _NOT_HYPER or isinstance(value, dict):
                continue
            if isinstance(value, (bool, int, float, str)) or value is None or (
                    isinstance(value, (list, tuple)) and all(
                        isinstance(v, (bool, int, float, str)) for v in value)):
                out[f"model.{index}:{type(layer).__name__}.{key}"] = _plain(value)
    return out


def settings(*, seed: int, optimizer: Any, model: tf_keras.Model, data: Any, mesh: str,
             num_clients: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings that shape a run's trajectory (see the module docstring)."""
    config = getattr(data, "config", None)
    out = {
        "seed": seed,
        "optimizer": type(optimizer).__name__,
        "learning_rate": learning_rate_of(optimizer),
        "global_batch_size": getattr(config, "global_batch_size", None),
        "train_examples": getattr(data, "num_examples", None),
        "data_seed": getattr(config, "seed", None),
        "mesh": mesh,
        "num_clients": num_clients,
        **model_settings(model),
    }
    for key, value in (extra or {}).items():
        out[str(key)] = _plain(value)
    return _plain(out)


def named(record: Mapping[str, Any], names: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """``record`` with the keys each ``(glob, name)`` matches replaced by ``name``: a script
    names the model settings a flag sets by the flag (``("model.*:Dropout.rate", "dropout")``),
    so a changed ``--dropout`` is reported, and allowed, as ``dropout``. The name's value is the
    keys' common value, or the sorted list of their distinct values."""
    import fnmatch  # pylint: disable=g-import-not-at-top
    out = dict(record)
    grouped: dict[str, list[Any]] = {}
    for pattern, name in names:
        for key in [k for k in out if fnmatch.fnmatchcase(k, pattern)]:
            grouped.setdefault(name, []).append(out.pop(key))
    for name, values in grouped.items():
        distinct = sorted({json.dumps(v) for v in values})
        out[name] = values[0] if len(distinct) == 1 else [json.loads(v) for v in distinct]
    return out


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every key whose value differs between two settings records: ``{key: (old, new)}``."""
    keys = sorted(set(old) | set(new))
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def is_allowed(key: str, allowed: Iterable[str]) -> bool:
    """Whether ``key`` is named in ``allowed`` (``model`` or ``model.2:Dropout`` allow the keys
    under them)."""
    return any(key == name or key.startswith(name + ".") or key.startswith(name + ":")
               for name in allowed)


def describe(diff: Mapping[str, tuple[Any, Any]]) -> str:
    """``seed 5 -> 6; learning_rate 0.45 -> 0.5``."""
    return "; ".join(f"{k} {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in diff.items())


def check(saved: Mapping[str, Any] | None, current: Mapping[str, Any], *,
          allow_change: Iterable[str], restored: str, lead: bool = True
          ) -> dict[str, dict[str, Any]]:
    """The resume check: ``saved`` (a checkpoint's named settings) against ``current``.

    Returns the changes allowed on purpose, ``{key: {"old": ..., "new": ...}}`` (the caller
    applies them: a new learning rate on the restored optimizer); the mesh and the number of
    clients change freely (one info line). ``lead``: this client logs.

    Raises:
      ValueError: settings changed that ``allow_change`` does not name, each with its values.
    """
    if saved is None:
        _log.warning("checkpoint %s records no run settings (written by an older dtk): "
                     "changed flags cannot be detected on this resume", restored)
        return {}
    allow_change = tuple(allow_change)
    # keys an older dtk recorded that are not hyper-parameters (rng_type): not compared
    saved = {k: v for k, v in saved.items() if k.rsplit(".", 1)[-1] not in _NOT_HYPER}
    diff = changes(saved, current)
    refused = {k: v for k, v in diff.items() if k not in FREE_KEYS
               and not is_allowed(k, allow_change)}
    if refused:
        raise ValueError(
            f"checkpoint {restored} was written with other settings: {describe(refused)}. "
            "Resume with the same settings, use a new checkpoint directory, or allow the change "
            f"on purpose (--allow_change {','.join(refused)}; TrainerConfig(allow_change=...))")
    allowed = {}
    for key, (old, new) in diff.items():
        if key in FREE_KEYS:
            if lead:
                _log.info("Resuming with %s %s (the checkpoint was written with %s): dtk "
                          "resumes exactly across meshes", key, new, old)
            continue
        allowed[key] = {"old": old, "new": new}
        if lead:
            _log.warning("Resuming with %s changed on purpose: %s -> %s", key, old, new)
    return allowed
