"""Layouts: rule tables (data, in ``layouts/``) that give every Keras weight its place on the mesh.

A table is an ordered list of rules ``pattern -> per-dim sharding``: the pattern is a regular
expression that must match a weight's whole path (``d1.kernel`` in a Sequential or Functional model,
``block.mha._query_dense.kernel`` in a subclassed one), and each dim names a mesh axis or
``unsharded``. Example, ``layouts/mlp_model_parallel.toml`` on ``batch=4,model=2``::

    d1.kernel [784, 128]  [unsharded, model]  each device holds 784 x 64 (column parallel)
    d2.kernel [128, 10]   [model, unsharded]  each device holds 64 x 10  (row parallel)

Unlike DTensor's ``LayoutMap`` (first prefix ``re.match`` wins, unmatched weights silently
replicated, bad layouts reported as MLIR dumps when variables are created), dtk plans every weight
BEFORE any DTensor variable exists: a weight matching two rules, a rank mismatch, an unknown axis,
a dim not divisible by its axis size are ``ValueError``s naming the weight, its shape, the dim and
the axis; a rule that matches no weight is reported (an error with ``strict=True``); a weight no
rule matches gets the table's ``default`` (``replicated``, shown in the explainer, or ``error``).

Tables name the axes they expect. An axis listed in ``optional_axes`` that the mesh lacks makes
those dims unsharded (a model-parallel table still runs on ``batch=8``); any other missing axis is
an error.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor
from tensorflow.python.framework.ops import EagerTensor as _EagerTensor

from dtk import _env
from dtk.parallel import experts, materialize, ops as op_support, randomness, sequence
from dtk.parallel import fsdp as fsdp_lib
from dtk import keras_check
from dtk.parallel.mesh import BATCH_AXIS, as_mesh

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore

_log = logging.getLogger("dtk")
UNSHARDED = "unsharded"
DEFAULTS = ("replicated", "error")
TRACKING_ATTRIBUTES = (  # bookkeeping that repeats weights found elsewhere, or is no weight
    "_self_tracked_trackables", "_trainable_weights", "_non_trainable_weights",
    "_captured_weight_regularizer",
    "_steps_per_execution")  # a preprocessing layer's adapt() counter, not model state


# -- tables ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutRule:
    """One rule: weights whose whole path matches ``pattern`` get ``dims`` (axis name or None)."""

    pattern: str
    dims: tuple[str | None, ...]
    note: str = ""
    # A rule for a variant of the model (the dense blocks beside expert blocks when only every
    # other block is one): matching nothing is a note in the plan, not a WARNING.
    optional: bool = False

    def spec(self) -> str:
        return "[" + ", ".join(d or UNSHARDED for d in self.dims) + "]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutTable:
    """An ordered rule table, as read from ``layouts/<name>.toml``."""

    name: str
    description: str
    axes: tuple[str, ...]
    rules: tuple[LayoutRule, ...]
    optional_axes: tuple[str, ...] = ()
    default: str = "replicated"
    source: str = ""
    # Mesh axes the table replicates every weight over on purpose (e.g. a data-parallel CNN on a
    # mesh with a `model` axis); any other axis that shards nothing is an error (plan_weights).
    replicated_axes: tuple[str, ...] = ()
    # Activations' sequence dim (dim 1 of the residual stream, dtk.parallel.sequence): sharded
    # over ``sequence_axis`` (context parallelism) or, on a mesh without it, over
    # ``sequence_parallel_axis`` (Megatron's sequence parallelism on the tensor-parallel axis).
    sequence_axis: str | None = None
    sequence_parallel_axis: str | None = None
    # How attention meets a sequence sharded over ``sequence_axis``: "all_gather" (keys and values
    # gathered), "all_to_all" (Ulysses: heads split over the axis), or "auto" (timed on the mesh).
    sequence_attention: str = "auto"


def shipped_tables_dir() -> Path:
    """The tables that come with dtk: ``dtk/tables`` when installed, ``layouts/`` in a checkout."""
    here = Path(__file__).resolve().parent.parent  # dtk/
    installed = here / "tables"
    if any(installed.glob("*.toml")):
        return installed
    return here.parent / "layouts"  # a source checkout (or an editable install of one)


def table_dirs() -> list[Path]:
    """Where tables are looked up by name, in order: ``$DTK_LAYOUTS_DIR`` (user tables, several
    directories separated by ``os.pathsep``), then the shipped tables."""
    user = _env.get_str(_env.LAYOUTS_DIR)
    dirs = [Path(d) for d in user.split(os.pathsep) if d] if user else []
    return [*dirs, shipped_tables_dir()]


def available_tables() -> list[str]:
    """Names of the tables that ``load_table`` finds by name."""
    return sorted({p.stem for d in table_dirs() for p in d.glob("*.toml")})


def _tables_naming(axis: str) -> str:
    """`` (shipped: a, b)``: the shipped tables that shard on ``axis`` (rules or sequence), for
    an error's advice; empty if none does."""
    names = []
    for path in sorted(shipped_tables_dir().glob("*.toml")):
        try:
            t = load_table(path)
        except ValueError:
            continue
        if t.sequence_axis == axis or any(axis in r.dims for r in t.rules):
            names.append(t.name)
    return f" (shipped: {', '.join(names)})" if names else ""


def load_table(name_or_path: str | os.PathLike) -> LayoutTable:
    """Reads a table by name (``data_parallel``) or from a path to a ``.toml`` file.

    Raises:
      ValueError: unknown name (lists the shipped tables), unreadable file, or a malformed table
        (naming the file and the rule).
    """
    if isinstance(name_or_path, LayoutTable):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"layout table must be a name (e.g. 'data_parallel'), a path to a .toml "
                        f"file or a LayoutTable; got {type(name_or_path).__name__}: "
                        f"{name_or_path!r}")
    text = os.fspath(name_or_path)
    path = Path(text)
    if not (text.endswith(".toml") or os.sep in text or isinstance(name_or_path, Path)):
        found = [d / f"{text}.toml" for d in table_dirs() if (d / f"{text}.toml").is_file()]
        if not found:
            raise ValueError(f"layout table {text!r} is unknown; tables: "
                             f"{', '.join(available_tables()) or '(none found)'}; or pass a path "
                             "to a .toml file")
        path = found[0]
    if path.is_dir():
        raise ValueError(f"layout table {path} is a directory; pass a .toml file, or put the "
                         f"tables in a directory named by ${_env.LAYOUTS_DIR} and pass a name")
    if not path.is_file():
        raise ValueError(f"layout table file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"layout table {path} cannot be read: {e}") from e
    return _parse_table(data, str(path))


def _parse_table(data: dict[str, Any], source: str) -> LayoutTable:
    def fail(message):
        raise ValueError(f"layout table {source}: {message}")

    unknown = set(data) - {"name", "description", "axes", "optional_axes", "default", "rules",
                           "replicated_axes", "sequence_axis", "sequence_parallel_axis",
                           "sequence_attention"}
    if unknown:
        fail(f"unknown keys {sorted(unknown)}; allowed: name, description, axes, optional_axes, "
             "replicated_axes, sequence_axis, sequence_parallel_axis, sequence_attention, "
             "default, rules")
    axes = tuple(data.get("axes", ()))
    optional = tuple(data.get("optional_axes", ()))
    if not set(optional) <= set(axes):
        fail(f"optional_axes {list(optional)} must be among axes {list(axes)}")
    for key in ("sequence_axis", "sequence_parallel_axis"):
        if key in data and data[key] not in axes:
            fail(f"{key} {data[key]!r} must be one of the table's axes {list(axes)}")
    if data.get("sequence_attention", "auto") not in sequence.ATTENTION_MODES:
        fail(f"sequence_attention {data['sequence_attention']!r} must be \"auto\", "
             "\"all_gather\" or \"all_to_all\"")
    default = data.get("default", "replicated")
    if default not in DEFAULTS:
        fail(f"default {default!r} is not one of {', '.join(DEFAULTS)}")
    rules = []
    for i, raw in enumerate(data.get("rules", [])):
        pattern, dims = raw.get("pattern"), raw.get("dims")
        if not isinstance(pattern, str) or not isinstance(dims, list):
            fail(f"rule {i + 1} needs pattern = \"regex\" and dims = [\"axis\" or \"unsharded\", ...]")
        try:
            re.compile(pattern)
        except re.error as e:
            fail(f"rule {i + 1}: pattern {pattern!r} is not a valid regular expression: {e}")
        parsed = tuple(None if d in (UNSHARDED, "") else d for d in dims)
        for d in parsed:
            if d is not None and d not in axes:
                fail(f"rule {i + 1} ({pattern!r}) names axis {d!r}, which is not in the table's "
                     f"axes {list(axes)}")
        variant = raw.get("optional", False)
        if not isinstance(variant, bool):
            fail(f"rule {i + 1} ({pattern!r}): optional must be true or false; got {variant!r}")
        rules.append(LayoutRule(pattern=pattern, dims=parsed, note=str(raw.get("note", "")),
                                optional=variant))
    return LayoutTable(name=str(data.get("name", Path(source).stem)),
                       description=str(data.get("description", "")), axes=axes,
                       optional_axes=optional, default=default, rules=tuple(rules), source=source,
                       replicated_axes=tuple(data.get("replicated_axes", ())),
                       sequence_axis=data.get("sequence_axis"),
                       sequence_parallel_axis=data.get("sequence_parallel_axis"),
                       sequence_attention=data.get("sequence_attention", "auto"))


# -- planning -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightPlan:
    """Where one weight goes: its path, shape, the rule that matched, and its sharding."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    rule: LayoutRule | None
    dims: tuple[str | None, ...]
    bytes_per_device: int
    bytes_total: int
    # FSDP: the table's sharding, used for compute (``dims`` is then how the weight is stored,
    # with the batch axis added); None when the weight is stored as it computes.
    compute_dims: tuple[str | None, ...] | None = None

    def spec(self) -> str:
        return "[" + ", ".join(d or UNSHARDED for d in self.dims) + "]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """A validated plan for every weight of a model on a mesh; ``warnings`` lists what to know."""

    table: LayoutTable
    mesh_axes: tuple[tuple[str, int], ...]
    weights: tuple[WeightPlan, ...]
    unused_rules: tuple[LayoutRule, ...]
    warnings: tuple[str, ...]

    def layout(self, path: str, mesh: dtensor.Mesh) -> dtensor.Layout:
        for weight in self.weights:
            if weight.path == path:
                return dtensor.Layout([d or dtensor.UNSHARDED for d in weight.dims], mesh)
        raise KeyError(path)

    @property
    def fsdp(self) -> bool:
        """Whether weights are stored sharded over the batch axis (``dtk.parallel.fsdp``)."""
        return any(w.compute_dims is not None for w in self.weights)


def shard_over_axis(dims: Sequence[str | None], shape: Sequence[int], axis: str,
                    size: int) -> tuple[str | None, ...]:
    """``dims`` plus ``axis`` on the first unsharded dim that ``size`` divides; unchanged when
    the axis already shards a dim or no dim qualifies. The placement of the sharded optimizer
    update (``dtk.train.mesh_optimizer.update_layout``) and of FSDP weights (``dtk.parallel.fsdp``)."""
    dims = list(dims)
    if size > 1 and axis not in dims:
        for dim, n in enumerate(shape):
            if dims[dim] is None and n % size == 0:
                dims[dim] = axis
                break
    return tuple(dims)


# The sharded update (``shard_optimizer_state``) splits a weight's update over the batch axis from
# this many elements a device on. A smaller weight is updated in place on every device: its
# update costs less than the float32 copy, the relayouts and the all-gather after each step that
# splitting it needs, and each of those is one more op for DTensor to compile (DenseNet121, 606
# weights on ``batch=8``: first step 41.8 s with every weight split, BUILD.md "Benchmarks").
SHARDED_UPDATE_MIN_ELEMENTS = 1 << 16


def sharded_update_dims(dims: Sequence[str | None], shape: Sequence[int], axis: str,
                        sizes: dict[str, int]) -> tuple[str | None, ...]:
    """The dims of a weight's optimizer state under the sharded update: ``shard_over_axis`` for a
    weight of at least ``SHARDED_UPDATE_MIN_ELEMENTS`` elements a device (its whole size over
    the devices its own ``dims`` divide it over; ``sizes``: the mesh's axis sizes), else ``dims``
    unchanged (updated in place, replicated over ``axis``). The one rule for
    ``dtk.train.mesh_optimizer.update_layout`` and ``memory_per_device``."""
    if math.prod(int(n) for n in shape) // _split(dims, sizes) < SHARDED_UPDATE_MIN_ELEMENTS:
        return tuple(dims)
    return shard_over_axis(dims, shape, axis, sizes.get(axis, 1))


def _apply_fsdp(planned: list[WeightPlan], paths, sizes: dict[str, int], batch_axis: str,
                warnings: list[str]) -> list[WeightPlan]:
    """Stores the weights named in ``paths`` sharded over the batch axis too (see dtk.parallel.fsdp)."""
    size = sizes.get(batch_axis, 1)
    out, kept = [], []
    for w in planned:
        dims = shard_over_axis(w.dims, w.shape, batch_axis, size) if w.path in paths else w.dims
        if dims == w.dims:
            if w.path in paths and size > 1 and batch_axis not in w.dims:
                kept.append(w)
            out.append(w)
            continue
        out.append(dataclasses.replace(w, dims=dims, compute_dims=w.dims,
                                       bytes_per_device=w.bytes_per_device // size))
    if kept:
        warnings.append(
            f"fsdp: {len(kept)} weight(s) have no unsharded dim that batch axis {batch_axis!r} (size "
            f"{size}) divides and stay replicated over it ({_bytes(sum(w.bytes_per_device for w in kept))} "
            f"per device): {_some([f'{w.path} {list(w.shape)}' for w in kept])}")
    return out


def is_graph_model(layer: Any) -> bool:
    """A Sequential or Functional model (its weights are named by layer, not by attribute)."""
    return isinstance(layer, tf_keras.Model) and (
        getattr(layer, "_is_graph_network", False) or isinstance(layer, tf_keras.Sequential))


def weight_roots(model: tf_keras.Model, name: Callable[[int, Any], str]
                 ) -> list[tuple[str, Any]]:
    """Where a model's weights are found: ``(path prefix, object)`` pairs.

    A Sequential/Functional model: each layer, named ``name(index, layer)``; a Sequential or
    Functional model nested in it (ConvNeXt's stem, keras.io's ``self.ffn = Sequential(...)`` in
    a layer is an attribute, found by the attribute walk) is entered, its layers named under
    its own name (``stem.stem_conv.kernel``). A subclassed model: the model itself.
    """
    if not is_graph_model(model):
        return [("", model)]
    roots = []
    for i, layer in enumerate(model.layers):
        if is_graph_model(layer):
            roots.extend((f"{name(i, layer)}.{prefix}", root)
                         for prefix, root in weight_roots(layer, name))
        else:
            roots.append((f"{name(i, layer)}.", layer))
    return roots


def variable_paths(model: tf_keras.Model, name: Callable[[int, Any], str], *,
                   predicate: Callable[[Any], bool] = lambda o: isinstance(o, tf.Variable),
                   skip: Sequence[str] = ()) -> list[tuple[str, Any, tuple, Any]]:
    """Every object ``predicate`` selects in a model, where it lives: ``(path, owner, path in
    owner, object)``, ``owner`` the layer or model that ``path in owner`` starts from.

    Paths follow ``weight_roots`` (layers of Sequential/Functional models by ``name``), then
    attributes; a Sequential/Functional model held as an attribute (keras.io's ``self.ffn =
    Sequential([...])`` in a layer) is entered by its layers too, since only its output layer
    is reachable by attributes (``_output_coordinates``). Bookkeeping attributes
    (``TRACKING_ATTRIBUTES`` and ``skip``) are not followed. An object reachable by several
    paths is listed under each.
    """
    out = []
    for prefix, root in weight_roots(model, name):
        out.extend(_walk(prefix, root, name, predicate, (*TRACKING_ATTRIBUTES, *skip)))
    return out


def _walk(prefix, root, name, predicate, skip):
    found = [(path, obj) for path, obj in root._flatten(  # pylint: disable=protected-access
        predicate=lambda o: predicate(o) or is_graph_model(o), with_path=True)
        if not any(a in path for a in skip)]
    nested = [path for path, obj in found if is_graph_model(obj)]

    def inside(path):
        return any(len(path) > len(g) and path[:len(g)] == g for g in nested)

    out = []
    for path, obj in found:
        if inside(path):
            continue  # reached again, by its layers, through the nested model
        here = prefix + ".".join(str(p) for p in path)
        if is_graph_model(obj):
            for sub_prefix, sub_root in weight_roots(obj, name):
                out.extend(_walk(f"{here}.{sub_prefix}", sub_root, name, predicate, skip))
        elif predicate(obj):
            out.append((here, root, path, obj))
    return out


def weight_paths(model: tf_keras.Model) -> list[tuple[str, tf.Variable]]:
    """Every weight of a built model with its path as DTensor's LayoutMap names it.

    Sequential/Functional: ``<layer name>.<attribute path>`` (``d1.kernel``; a nested
    Sequential/Functional model's layers under its name, see ``variable_paths``); subclassed:
    the attribute path from the model (``block.ff.0.kernel``). A weight reachable by several
    paths is listed once, by its first path.
    """
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        # RNN cells cache their dropout masks per graph; a cache of masks from two graphs cannot
        # be walked (tf.Module sorts its keys). The masks live for one call only: drop them.
        for cache in ("_dropout_mask_cache", "_recurrent_dropout_mask_cache"):
            if hasattr(getattr(layer, cache, None), "clear"):
                getattr(layer, cache).clear()
    seen, out = set(), []
    for path, _, _, variable in variable_paths(model, lambda i, layer: layer.name):
        if id(variable) not in seen:
            seen.add(id(variable))
            out.append((path, variable))
    return out


def _match(table: LayoutTable, path: str) -> list[LayoutRule]:
    return [rule for rule in table.rules if re.fullmatch(rule.pattern, path)]


def _some(paths: list[str], n: int = 6) -> str:
    return str(paths[:n])[:-1] + (f", ... {len(paths) - n} more]" if len(paths) > n else "]")


def plan_weights(table: LayoutTable, mesh: dtensor.Mesh, weights, *, strict: bool = False,
                 allow_replicated: bool = False, batch_axis: str = "batch",
                 fsdp_paths: Sequence[str] = ()) -> LayoutPlan:
    """Matches and validates ``weights`` (``(path, shape, dtype)`` triples) against ``table``.

    Args:
      table: the rule table.
      mesh: the mesh.
      weights: ``(path, shape, dtype)`` of every weight.
      strict: a rule that matches no weight is an error (else a warning in the plan).
      allow_replicated: a table whose rules shard on axes the mesh has, but that shards no weight
        of this model (a renamed layer, the wrong table), is an error unless this is True; so is
        a mesh axis other than ``batch_axis`` that shards no weight (its devices would repeat
        the same work), unless the table lists it in ``replicated_axes``.
      batch_axis: the axis that shards the inputs.
      fsdp_paths: weights to store sharded over ``batch_axis`` too (FSDP, see ``dtk.parallel.fsdp``);
        one with no dim the axis divides stays replicated over it, listed in the warnings.

    Raises:
      ValueError: see the module docstring; every message names the weight and the fix.
    """
    sizes = {name: mesh.dim_size(name) for name in mesh.dim_names}
    missing = [a for a in table.axes if a not in sizes and a not in table.optional_axes]
    if missing:
        raise ValueError(
            f"layout table {table.name!r} needs mesh axes {missing}, which mesh "
            f"{','.join(f'{k}={v}' for k, v in sizes.items())} does not have; add them to the "
            "mesh, or use a table for this mesh (e.g. data_parallel)")
    planned, used, warnings = [], set(), []
    for path, shape, dtype in weights:
        shape = tuple(int(s) for s in shape)
        rules = _match(table, path)
        if len(rules) > 1:
            raise ValueError(
                f"weight {path} {list(shape)} matches {len(rules)} rules of table {table.name!r}: "
                f"{rules[0].pattern!r} and {rules[1].pattern!r}; make the patterns disjoint")
        rule = rules[0] if rules else None
        if rule is None:
            if table.default == "error":
                raise ValueError(f"weight {path} {list(shape)} matches no rule of table "
                                 f"{table.name!r} (default = \"error\"); add a rule for it")
            dims = (None,) * len(shape)
        else:
            used.add(rule.pattern)
            if len(rule.dims) != len(shape):
                raise ValueError(
                    f"rule {rule.pattern!r} {rule.spec()} of table {table.name!r} gives "
                    f"{len(rule.dims)} dims, but weight {path} has shape {list(shape)} (rank "
                    f"{len(shape)}); give one entry per dim")
            dims = []
            for dim, (axis, n) in enumerate(zip(rule.dims, shape)):
                if axis is not None and axis not in sizes:
                    axis = None  # an optional axis this mesh lacks: unsharded
                if axis is not None and n % sizes[axis]:
                    raise ValueError(
                        f"weight {path} {list(shape)}: dim {dim} ({n}) is not divisible by mesh "
                        f"axis {axis!r} (size {sizes[axis]}) (rule {rule.pattern!r}); change the "
                        f"layer size to a multiple of {sizes[axis]} or leave that dim unsharded")
                if axis is not None and axis in dims:
                    raise ValueError(f"rule {rule.pattern!r} shards two dims of weight {path} on "
                                     f"axis {axis!r}; an axis can shard one dim only")
                dims.append(axis)
            dims = tuple(dims)
        itemsize = tf.as_dtype(dtype).size
        total = itemsize
        for n in shape:
            total *= n
        split = 1
        for axis in dims:
            split *= sizes[axis] if axis else 1
        planned.append(WeightPlan(path=path, shape=shape, dtype=tf.as_dtype(dtype).name, rule=rule,
                                  dims=dims, bytes_per_device=total // split, bytes_total=total))
    unused = tuple(r for r in table.rules if r.pattern not in used and not r.optional)
    variants = [r.pattern for r in table.rules if r.pattern not in used and r.optional]
    if variants:
        warnings.append(f"optional rule(s) {variants} (for other variants of the model) match no "
                        "weight of this one")
    if unused:
        message = (f"layout table {table.name!r}: rule(s) {[r.pattern for r in unused]} match no "
                   "weight of this model")
        if strict:
            raise ValueError(message + "; fix the patterns or pass strict=False")
        warnings.append(message)
    defaulted = [w.path for w in planned if w.rule is None]
    if table.rules and defaulted:
        warnings.append(f"{len(defaulted)} weight(s) matched no rule of table {table.name!r} and "
                        f"are {table.default}: {_some(defaulted)}")
    sharding_axes = {a for r in table.rules for a in r.dims if a and sizes.get(a, 1) > 1}
    if sharding_axes and not any(any(w.dims) for w in planned) and not allow_replicated:
        raise ValueError(
            f"layout table {table.name!r} shards weights on mesh axes {sorted(sharding_axes)}, but "
            f"on this model it shards none: its rules {[r.pattern for r in table.rules]} match "
            f"none of the weights {_some([w.path for w in planned])}, so everything would train "
            "replicated. Fix the patterns to match these weight paths (layer names or attribute "
            "paths; see dtk.explain), use another table, or pass allow_replicated=True "
            "(train_mnist.py: --allow_replicated)")
    idle = [a for a, n in sizes.items() if n > 1 and a != batch_axis and a not in
            table.replicated_axes and a != table.sequence_axis
            and not any(a in w.dims for w in planned)]
    if idle and not allow_replicated:
        axis = idle[0]
        raise ValueError(
            f"mesh axis {axis!r} of size {sizes[axis]} shards no weight and no input with layout "
            f"table {table.name!r}: its {sizes[axis]} devices would repeat the same work. Use a "
            f"table whose rules name {axis!r}{_tables_naming(axis)}, drop the axis from the mesh, "
            "or pass allow_replicated=True (scripts: --allow_replicated)")
    if any(a not in sizes for a in table.optional_axes):
        warnings.append(f"mesh has no axis {[a for a in table.optional_axes if a not in sizes]}: "
                        "dims laid out on it are unsharded")
    if fsdp_paths:
        planned = _apply_fsdp(planned, set(fsdp_paths), sizes, batch_axis, warnings)
    return LayoutPlan(table=table, mesh_axes=tuple(sizes.items()), weights=tuple(planned),
                      unused_rules=unused, warnings=tuple(warnings))


def plan_layouts(table: LayoutTable | str, mesh: dtensor.Mesh,
                 model_factory: Callable[[], tf_keras.Model], *, strict: bool = False,
                 allow_replicated: bool = False, input_shape: Sequence[int] | None = None,
                 fsdp: bool = False) -> LayoutPlan:
    """Plans every weight of ``model_factory()`` on ``mesh``, before any DTensor variable exists.

    The factory is called once outside any layout scope, to read weight paths and shapes from
    ordinary variables (a subclassed model is built by one call on zeros of ``input_shape``).
    """
    mesh = as_mesh(mesh, "mesh")
    if isinstance(model_factory, tf_keras.Model):  # callable, so Keras said "first argument"
        raise TypeError(f"plan_layouts needs the model FACTORY (a function that builds the "
                        f"model, e.g. dtk.models.mnist_mlp), not a built model "
                        f"({type(model_factory).__name__} {model_factory.name!r}); pass the "
                        "function that builds it")
    model, _ = _reference_model(model_factory, input_shape, mesh)
    return _plan_model(load_table(table), mesh, model, strict=strict,
                       allow_replicated=allow_replicated, fsdp=fsdp)


def _plan_model(table: LayoutTable, mesh: dtensor.Mesh, model: tf_keras.Model, *,
                strict: bool, allow_replicated: bool = False, fsdp: bool = False) -> LayoutPlan:
    paths = weight_paths(model)
    weights = [(path, tuple(v.shape), v.dtype) for path, v in paths]
    if not weights:
        raise ValueError("model_factory built a model with no weights; build it (give the first "
                         "layer an input_shape, or pass input_shape= for a subclassed model)")
    trainable = {id(v) for v in model.trainable_variables}
    plan = plan_weights(table, mesh, weights, strict=strict, allow_replicated=allow_replicated,
                        fsdp_paths=[p for p, v in paths if id(v) in trainable] if fsdp else ())
    _check_gathered_tables(model, plan)
    return plan


def _check_gathered_tables(model: tf_keras.Model, plan: LayoutPlan) -> None:
    """Embedding tables sharded on dim 0 (rows) are looked up by ``op_support.row_sharded_lookup``
    (under FSDP too: the lookup reads the table gathered to its table layout); refuses, before
    any variable exists, the case it does not cover.

    Raises:
      ValueError: a row-sharded table with ``sparse=True`` outputs.
    """
    layers = {id(layer.embeddings): layer for layer in model._flatten_layers()  # pylint: disable=protected-access
              if isinstance(layer, tf_keras.layers.Embedding) and hasattr(layer, "embeddings")}
    by_path = {path: layers[id(v)] for path, v in weight_paths(model) if id(v) in layers}
    for weight in plan.weights:
        layer = by_path.get(weight.path)
        dims = weight.compute_dims if weight.compute_dims is not None else weight.dims
        if layer is None or not dims or not dims[0]:
            continue
        if layer.sparse:
            raise ValueError(
                f"Embedding {layer.name!r} has sparse=True and its table {weight.path} "
                f"{list(weight.shape)} is sharded on dim 0 (rows) on axis {dims[0]!r}: dtk "
                "looks such a table up as a dense tensor. Build the layer with sparse=False")


def _check_factory_result(model: Any) -> tf_keras.Model:
    keras_check.require_keras2(model, "the model returned by model_factory")
    if not isinstance(model, tf_keras.Model):
        raise TypeError(f"model_factory must return a tf_keras.Model; it returned "
                        f"{type(model).__name__}: {str(model)[:80]!r}. Return the model from the "
                        "factory (e.g. `def factory(): return tf_keras.Sequential([...])`)")
    if getattr(model, "_dtk_laid_out_in", None) is None:  # (one dtk laid out itself: below)
        for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
            _refuse_laid_out(layer)
    for weight in materialize.weights_so_far(model):
        layout = getattr(getattr(weight, "_variable", weight), "layout", None)
        if layout is None:
            continue
        axes = ",".join(f"{a}={layout.mesh.dim_size(a)}" for a in layout.mesh.dim_names)
        raise ValueError(
            f"model_factory returned a model already laid out on a mesh ({axes}; weight "
            f"{weight.name} is a DTensor variable laid out as {layout.sharding_specs}): dtk "
            "lays the model out itself, so the factory must build a new plain tf_keras model "
            "(not call dtk.distribute or dtk.build_model)")
    return model


def _plain_model(model_factory, input_shape, mesh, *, dtype="float32") -> tf_keras.Model:
    """``model_factory()`` outside any layout scope, built (a subclassed model by one call)."""
    model = _check_factory_result(keras_check.call_factory(model_factory))
    if not materialize.is_built(model):
        if input_shape is None:
            raise ValueError(
                f"model_factory returned an unbuilt {type(model).__name__} (a subclassed model "
                "creates its weights on its first call); pass input_shape= (one example's shape "
                "without the batch dim, e.g. input_shape=(28, 28, 1)) to dtk.build_model / "
                "dtk.Trainer, or give the first layer an input_shape")
        model(tf.zeros([1, *(int(d) for d in input_shape)], dtype))
    return model


def _seeds_itself_when_built(model: tf_keras.Model) -> bool:
    """Whether a layer of ``model`` makes a ``tf.random.Generator`` while the model is built (the
    augmentation layers always do; other random layers in tf_keras's generator mode) without a
    seed of its own: that draws Python's ``random`` between the weights' initializers, so the
    initial weights after it depend on it."""
    from tf_keras.src import backend as keras_backend  # pylint: disable=g-import-not-at-top
    stateful = keras_backend.RandomGenerator.RNG_STATEFUL
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        generator = getattr(layer, "_random_generator", None)
        if getattr(generator, "_rng_type", None) == stateful and \
                getattr(generator, "_seed", 0) is None:
            return True
    return False


class _refuse_laid_out_layers:  # pylint: disable=invalid-name
    """While dtk calls a factory for its reference build: a layer of a model dtk already laid out
    (two-stage training: a trained encoder under a new head) is refused at its first call or
    when the factory returns it, with the real cause and the fix. Its weights are DTensors on a
    mesh, and dtk builds every model from plain layers; otherwise the error is whatever that
    layer's laid-out form fails on first (a RandomFlip's static-shape check, an unbuilt
    Sequential)."""

    def __enter__(self):
        self._call = call = tf_keras.layers.Layer.__call__

        def checked(layer, *args, **kwargs):
            _refuse_laid_out(layer)
            return call(layer, *args, **kwargs)

        tf_keras.layers.Layer.__call__ = checked
        return self

    def __exit__(self, *exc):
        tf_keras.layers.Layer.__call__ = self._call
        return False


class _LaidOutLayer(ValueError):
    pass


def _refuse_laid_out(layer: Any) -> None:
    owner = getattr(layer, "_dtk_laid_out_in", None)
    if owner is not None:
        raise _LaidOutLayer(
            f"model_factory uses layer {layer.name!r} ({type(layer).__name__}) of model "
            f"{owner!r}, which dtk already laid out on a mesh (its weights are DTensors there): "
            "a factory must build new, plain layers. To reuse trained weights (a pretrained "
            "encoder under a new head), build the layer anew in the factory and copy them in: "
            "new_layer.set_weights(dtk.gather_weights(trained_layer)) (or load a checkpoint "
            "saved with model.save_weights)")


def _reference_model(model_factory, input_shape, mesh, *, seed: int | None = None,
                     dtype="float32") -> tuple[tf_keras.Model, bool]:
    """The model to plan from, and whether it is lazy (shapes only, see ``dtk.parallel.materialize``).

    Lazy when the factory builds with lazy variables; otherwise (it needs real values while it
    builds, e.g. ``adapt()``) the plain build, which holds every weight on this host.
    """
    with _refuse_laid_out_layers():
        return _reference_model_checked(model_factory, input_shape, mesh, seed=seed, dtype=dtype)


def _reference_model_checked(model_factory, input_shape, mesh, *, seed, dtype):
    names = _layer_name_counters()
    try:
        model = _check_factory_result(materialize.lazy_model(model_factory, input_shape, dtype))
        if materialize.is_built(model) and not _seeds_itself_when_built(model):
            return model, True
        reason = ("its random layers draw their own seeds as the model is built, between its "
                  "weights' initializers, which a lazy build cannot replay"
                  if materialize.is_built(model)
                  else "a lazy build leaves it unbuilt (a subclassed model without input_shape)")
    except (TypeError, _LaidOutLayer):
        raise
    except Exception as e:  # pylint: disable=broad-except  (whatever needed real values)
        reason = (f"a build with lazy variables failed: {type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}")
    names.restore()
    if seed is not None:
        tf_keras.utils.set_random_seed(seed)
    _log.info("layouts: built a full plain copy of the model to read its initial values: %s",
              reason)
    return _plain_model(model_factory, input_shape, mesh, dtype=dtype), False


# String and lookup preprocessing layers: their ops have no DTensor expansion (dtk.distribute
# runs them on the host when a Sequential model starts with them: dtk.train.host_inputs).
HOST_INPUT_LAYERS = ("TextVectorization", "StringLookup", "IntegerLookup", "Hashing",
                     "HashedCrossing")


def runs_on_host(layer: Any) -> bool:
    """Whether ``dtk.distribute`` runs ``layer`` on the host when it leads a ``Sequential``:
    ``HOST_INPUT_LAYERS``, and a ``Discretization`` dtk cannot compute in the step (its
    ``Bucketize`` has no DTensor layout; dtk's replacement covers ``output_mode='int'`` with bin
    boundaries only)."""
    name = type(layer).__name__
    if name == "Discretization":
        return layer.output_mode != "int" or layer.bin_boundaries is None
    return name in HOST_INPUT_LAYERS


class HostInputsFirst(Exception):
    """``build_model(host_inputs=True)`` of a ``Sequential`` whose first layer is one of
    ``HOST_INPUT_LAYERS``: the caller splits them off to the host (``dtk.train.host_inputs``)."""


class _PlannedLayoutMap(tf_keras.dtensor.experimental.LayoutMap):
    """A LayoutMap that answers with the validated plan (exact paths only, never a prefix match)."""

    def __init__(self, plan: LayoutPlan, mesh: dtensor.Mesh):
        super().__init__(mesh=mesh)
        self._plan = {w.path: dtensor.Layout([d or dtensor.UNSHARDED for d in w.dims], mesh)
                      for w in plan.weights}

    def __getitem__(self, key):
        return self._plan.get(key)


def build_model(model_factory: Callable[[], tf_keras.Model], mesh: dtensor.Mesh,
                table: LayoutTable | str, *, seed: int, strict: bool = False,
                allow_replicated: bool = False, input_shape: Sequence[int] | None = None,
                input_dtype: str = "float32", fsdp: bool = False, log_warnings: bool = True,
                host_inputs: bool = False,
                initial_values: Callable[[set[str]], Any] | None = None
                ) -> tuple[tf_keras.Model, LayoutPlan]:
    """Builds ``model_factory()`` with every weight laid out on ``mesh`` as ``table`` says.

    Seeds with ``tf_keras.utils.set_random_seed(seed)``, builds the model once with lazy
    variables (its weight paths and shapes are planned and validated before any DTensor variable
    exists; no weight is stored), then builds it under the planned layouts and draws the initial
    values one weight at a time in the plain build's order, so the initial weights equal
    ``set_random_seed(seed); model_factory()`` on one device exactly (the parity tests rely on
    it). Each client sends only its own shards to its devices: at most one full weight is on a
    host at a time (``dtk.parallel.materialize``; a factory that needs real values while it builds, such
    as ``adapt()``, gets a plain build instead, with an info line).

    ``fsdp=True`` stores every trainable weight sharded over the batch axis too and gathers it
    for compute inside dtk's steps (``dtk.parallel.fsdp``).

    DTensor settings dtk applies (see ``explain``): ``LayerNormalization`` and
    ``BatchNormalization`` run unfused (DTensor's fused kernel has no layout propagation;
    batch statistics are then computed over the global batch, as on one device); Dropout and other
    random layers draw from ``dtk.parallel.randomness`` in dtk's train steps: the same values on every
    mesh, keyed by (seed, step, layer, global index).

    Subclassed models (weights created on the first call) need ``input_shape``: dtk builds the
    plain copy with a call on zeros ``[1, *input_shape]`` and the laid-out model with a symbolic
    call under the layout map (see ``_build_subclassed``; ``model.build(shape)`` and tf_keras'
    first-call route do not work under a layout scope).

    The plan's warnings (rules that matched nothing, weights that fell to the default) are
    logged on the ``dtk`` logger (unless ``log_warnings=False``: a pipeline stage's part of the
    model, whose whole plan was checked and logged once). ``initial_values(paths)``, where given,
    yields ``(path, value)`` for the weights of ``paths`` in place of the factory's own initial
    values (a pipeline stage's are the whole model's).

    Raises:
      TypeError: the factory returns no tf_keras model (or a Keras 3 one).
      ValueError: a bad plan (see ``plan_weights``), or a subclassed model without input_shape.
    """
    mesh = as_mesh(mesh, "mesh")
    if not callable(model_factory):
        raise TypeError(f"model_factory must be a callable that returns a new tf_keras model; got "
                        f"{type(model_factory).__name__}")
    if isinstance(model_factory, tf_keras.Model):
        raise TypeError("build_model needs the model FACTORY (a function that builds the model), "
                        "not a built model: DTensor weights must be created under the layouts")
    op_support.install_equivalents()  # before the factory: a layer may keep the function
    # The plain build draws its initial values with the user's RNG mode, so they equal a
    # single-device `set_random_seed(seed); model_factory()` in this process exactly.
    tf_keras.utils.set_random_seed(seed)
    names = _layer_name_counters()
    reference, lazy = _reference_model(model_factory, input_shape, mesh, seed=seed,
                                       dtype=input_dtype)
    if host_inputs and isinstance(reference, tf_keras.Sequential) and reference.layers and \
            runs_on_host(reference.layers[0]):
        raise HostInputsFirst(reference.layers[0].name)
    op_support.check_layers(reference)  # before the laid-out build, whose errors name no layer
    plan = _plan_model(load_table(table), mesh, reference, strict=strict,
                       allow_replicated=allow_replicated, fsdp=fsdp)
    for warning in plan.warnings if log_warnings else ():  # a pipeline stage's: said once
        _log.warning("layouts: %s", warning)
    if sum(w.bytes_per_device for w in plan.weights) >= _env.LARGE_MODEL_BYTES_PER_DEVICE:
        if _env.apply_malloc_defaults():  # before the weights, their gradients and state exist
            _log.info("layouts: a large model: freed blocks of %d KiB or more go back to the "
                      "system (glibc mallopt; dtk/_env.py)", _env.MMAP_THRESHOLD_BYTES >> 10)
    tf_keras.utils.set_random_seed(seed)
    layout_map = _PlannedLayoutMap(plan, mesh)
    # Random layers of the laid-out model (Dropout) need tf.random.Generator, which DTensor
    # supports; the layers pick their generator when they are made, so the mode is switched for
    # this build only and the process keeps the user's.
    user_rng = tf_keras.backend.experimental.is_tf_random_generator_enabled()
    tf_keras.backend.experimental.enable_tf_random_generator()
    names.restore()  # unnamed layers get the same names (dense_3 ...) as in the plain build
    placeholders = materialize.placeholder_values([w.path for w in plan.weights])
    try:
        # Preprocessing state (Normalization's adapted mean and variance) comes from the plain
        # build with the other weights: adapt() and finalize_state() wait until it is copied.
        with placeholders, layout_map.scope(), _preprocessing_deferred(), _nested_models(), \
                materialize.shared_handle_compilation():
            model = keras_check.call_factory(model_factory)
            if not materialize.is_built(model):
                _build_subclassed(model, layout_map, input_shape, input_dtype)
            else:  # a subclassed model the factory built itself (build(), or a call on Input)
                _map_lazy_variables(model, layout_map)
                # A model whose parts are built (keras.io's Distiller) but never called itself:
                # built, as its first call would make it. Unbuilt, tf_keras's first call of a
                # model with a layout map takes the batch's shape for one example's and fails.
                model.built = True
            _lay_out_autocast_variables(model, layout_map)
    finally:
        if not user_rng:
            tf_keras.backend.experimental.disable_tf_random_generator()
    # Under a layout scope, initializers run in another order than in a plain build (layer by
    # layer, attributes sorted), which changes the random draws of some layers (e.g. attention).
    # The reference's values (drawn in the plain build's order, one weight at a time when it is
    # lazy: dtk.parallel.materialize) make the initial weights exactly the single-device ones.
    # Matched by path, not by position: the two builds may list weights in another order.
    targets = dict(weight_paths(model))
    sources = weight_paths(reference)
    if initial_values is not None:
        for path, value in initial_values(set(targets)):
            variable = targets.pop(path)
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(f"initial value of {path} has shape {value.shape}; the weight "
                                 f"is {tuple(variable.shape)}")
            materialize.assign_global(variable, lambda value=value: value)
        sources = []
    elif lazy:
        tf_keras.utils.set_random_seed(seed)  # the plain build's draws, in its order
        sources = materialize.creation_order(sources)
    for path, source in sources:
        variable = targets.pop(path, None)
        if variable is None or tuple(source.shape) != tuple(variable.shape):
            raise ValueError(f"model_factory built different models on two calls: weight {path} "
                             "of the plain build is missing or has another shape in the laid-out "
                             "build; the factory must build the same model every time")
        materialize.assign_global(variable, functools.partial(
            materialize.initial_value if lazy else lambda v: v.numpy(), source),
            source=source if lazy else None)
    materialize.release_free_memory()  # what the last weights freed (assign_global trims in steps)
    if targets:
        raise ValueError(f"model_factory built different models on two calls: weights "
                         f"{sorted(targets)[:4]} of the laid-out build are not in the plain build; "
                         "the factory must build the same model every time")
    _check_layouts_follow_plan(model, plan, mesh)
    if fsdp_lib.adapt_variables(weight_paths(model), {
            w.path: dtensor.Layout([d or dtensor.UNSHARDED for d in w.compute_dims], mesh)
            for w in plan.weights if w.compute_dims is not None}):
        fsdp_lib.schedule(model)
    # What the factory compiled the model with, read from the plain build (the laid-out build's
    # optimizer holds placeholder values): dtk.Trainer trains with it when given none.
    # Untracked: the metric objects in it are not the model's state (a checkpoint would try to
    # save their never-initialized placeholders).
    object.__setattr__(model, "_dtk_compiled", compiled_settings(reference))
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        object.__setattr__(layer, "_dtk_laid_out_in", model.name)  # (untracked) see below
    if getattr(model, "optimizer", None) is not None:
        # The optimizer the factory compiled under the layout scope holds variables that were
        # never given values (its iteration count): a checkpoint of the model would fail on
        # them. dtk.Trainer puts the mesh-bound optimizer it trains with in its place.
        model.optimizer = None
    _bind_metrics(model, mesh)
    _finalize_preprocessing(model)
    _place_constants(model, mesh)
    for line in [*op_support.adapt_layers(model), *randomness.adapt_layers(model, seed=seed),
                 *sequence.configure(model, mesh, batch_axis=BATCH_AXIS,
                                     sequence_axis=plan.table.sequence_axis,
                                     sequence_parallel_axis=plan.table.sequence_parallel_axis,
                                     table_name=plan.table.name, fsdp=fsdp,
                                     attention=plan.table.sequence_attention),
                 *experts.configure(model, mesh, batch_axis=BATCH_AXIS,
                                    sequence_axis=sequence.choose_axis(
                                        mesh, sequence_axis=plan.table.sequence_axis,
                                        sequence_parallel_axis=None if fsdp else
                                        plan.table.sequence_parallel_axis)[0])]:
        _log.info("layouts: %s", line)
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        # DTensor has no layout propagation for FusedBatchNormV3 (used by both layers when fused).
        if isinstance(layer, tf_keras.layers.LayerNormalization):
            layer._fused = False  # pylint: disable=protected-access
        if isinstance(layer, tf_keras.layers.BatchNormalization):
            layer.fused = False
    return model, plan


def compiled_settings(model: tf_keras.Model) -> dict[str, Any]:
    """The loss, optimizer (class and config) and metrics ``model.compile`` was given, or Nones."""
    optimizer = getattr(model, "optimizer", None)
    compiled_loss = getattr(model, "compiled_loss", None)
    return {
        "loss": getattr(model, "loss", None) if compiled_loss else None,
        "loss_weights": getattr(compiled_loss, "_user_loss_weights", None),
        "output_names": list(getattr(model, "output_names", None) or []) or None,
        "optimizer": (type(optimizer), _optimizer_config(optimizer)) if optimizer is not None
        else None,
        "metrics": list(getattr(getattr(model, "compiled_metrics", None), "_user_metrics", None)
                        or []) or None,
        # Optimizers a model's own compile() keeps as attributes (a GAN's d_optimizer and
        # g_optimizer): the laid-out build's copies hold unset state, made again from these.
        "attributes": {attr: (type(value), _optimizer_config(value))
                       for attr, value in vars(model).items()
                       if not attr.startswith("_")
                       and isinstance(value, tf_keras.optimizers.Optimizer)},
    }


def _bind_metrics(model: tf_keras.Model, mesh: dtensor.Mesh) -> None:
    """Metric objects the model holds (keras.io, "Customizing fit": ``self.loss_tracker =
    keras.metrics.Mean(name="loss")`` in ``__init__``), made again bound to the mesh.

    Made in the factory, under the layout scope, their variables never get values (a checkpoint
    or ``gather_weights`` fails on them), and a metric not bound to the mesh reports wrong values
    under DTensor (dtensor-notes, trap 3).

    Raises:
      ValueError: a metric class that cannot be made with ``mesh=``, naming the attribute.
    """
    for attr, value in list(vars(model).items()):
        if not isinstance(value, tf_keras.metrics.Metric) or getattr(value, "_mesh", None):
            continue
        try:
            bound = type(value)(**value.get_config(), mesh=mesh)
        except TypeError as e:
            raise ValueError(
                f"model attribute {attr!r} holds a {type(value).__name__} metric made without the "
                f"mesh, which dtk cannot make again bound to it ({e}); use a tf_keras metric that "
                "takes mesh= (Mean, Sum, the MeanMetricWrapper metrics), or keep the metric "
                "outside the model (Trainer(metrics=...))") from None
        if value in model._metrics:  # pylint: disable=protected-access
            model._metrics.remove(value)  # pylint: disable=protected-access
        setattr(model, attr, bound)


def _optimizer_config(optimizer) -> dict[str, Any]:
    """The optimizer's config, with its learning rate as the factory set it.

    The reference model is built with lazy variables (``dtk.parallel.materialize``), and so is the
    optimizer its factory compiled: its learning-rate variable has no storage, and ``get_config``
    reads it as an empty array, which a rebuilt optimizer then multiplies into every update
    ("Dimensions must be equal, but are 32 and 0"). The variable's initial value is the rate.
    """
    config = optimizer.get_config()
    rate = getattr(optimizer, "_learning_rate", None)
    if isinstance(rate, tf.Variable) and not isinstance(config.get("learning_rate"), dict):
        value = np.asarray(config.get("learning_rate"))
        if value.size != 1:
            value = materialize.initial_value(rate)
        config["learning_rate"] = float(value)
    return config


def _check_layouts_follow_plan(model: tf_keras.Model, plan: LayoutPlan,
                               mesh: dtensor.Mesh) -> None:
    """Every laid-out variable's actual layout is its plan's (not merely the same values).

    A build that left weights replicated while the plan showed them sharded would train to the
    same numbers with none of the memory saving; this makes that an error, at build time.

    Raises:
      RuntimeError: naming the weight, its layout and the planned one (a dtk bug).
    """
    variables = dict(weight_paths(model))
    for weight in plan.weights:
        variable = variables[weight.path]
        got = dtensor.fetch_layout(getattr(variable, "_variable", variable))
        want = plan.layout(weight.path, mesh)
        if got != want:
            raise RuntimeError(
                f"weight {weight.path} was laid out {list(got.sharding_specs)} but its plan says "
                f"{list(want.sharding_specs)} (rule {weight.rule.pattern if weight.rule else '-'}"
                "); this is a dtk bug: please report it with the model")


def _preprocessing_classes() -> list[type]:
    from tf_keras.src.engine import base_preprocessing_layer  # pylint: disable=g-import-not-at-top
    found, todo = [], [base_preprocessing_layer.PreprocessingLayer]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


class _nested_models:  # pylint: disable=invalid-name
    """While the laid-out model is built: a model called on symbolic inputs (a ``Sequential``
    nested in a functional model, as ConvNeXt's stem or keras.io's transformer block's ``ffn``)
    builds as a layer of the model that calls it.

    Under a layout map, tf_keras's ``Model.__call__`` first calls an unbuilt model on fresh
    ``Input``s made from its arguments, but turns a ``KerasTensor`` argument into None: "Inputs
    to a layer should be tensors. Got 'None'". Its weights are laid out with the enclosing
    model's (the layout map names them by their full path).
    """

    def __enter__(self):
        from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
        from tf_keras.src.engine import keras_tensor  # pylint: disable=g-import-not-at-top
        self._original = original = tf_keras.Model.__call__
        self._original_maps = (keras_layout_map._map_functional_model_variable,  # pylint: disable=protected-access
                               keras_layout_map._map_subclass_model_variable)  # pylint: disable=protected-access
        keras_layout_map._map_functional_model_variable = _map_model_variables  # pylint: disable=protected-access
        keras_layout_map._map_subclass_model_variable = _map_model_variables  # pylint: disable=protected-access

        def call(model, *args, **kwargs):
            symbolic = any(isinstance(t, keras_tensor.KerasTensor)
                           for t in tf.nest.flatten((args, kwargs)))
            saved = getattr(model, "_layout_map", None)
            if symbolic and saved is not None and not model.built:
                model._layout_map = None  # pylint: disable=protected-access
                try:
                    return original(model, *args, **kwargs)
                finally:
                    model._layout_map = saved  # pylint: disable=protected-access
            example = args[0] if args else kwargs.get("inputs")
            if isinstance(example, (list, tuple)) and example and all(
                    isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                    for v in example):
                # A batch written as a list of numbers (keras.io's GNN: ``model([1, 10, 100])``,
                # node indices): one tensor of them, as the model reads it (tf.gather packs
                # the list), not one input per number.
                example = np.asarray(example)
                args = (example, *args[1:]) if args else args
                kwargs = kwargs if args else {**kwargs, "inputs": example}
            concrete = example is not None and all(isinstance(t, (_EagerTensor, np.ndarray))
                                                   for t in tf.nest.flatten(example))
            traced = example is not None and all(
                (isinstance(t, tf.Tensor) and bool(t.shape.rank)) or
                (isinstance(t, np.ndarray) and t.ndim > 0) for t in tf.nest.flatten(example))
            if saved is not None and not model.built and traced and \
                    not tf.executing_eagerly():
                # A nested model called on a tensor while the enclosing model builds (keras.io's
                # GNN: ``self.preprocess(self.node_features)``, a [nodes, features] constant,
                # and its graph layer's ffn on the gathered neighbours): built from its shapes
                # per row, as below (outside the graph, where its variables' initial values are
                # made), then called as it is.
                with tf.init_scope():
                    _build_subclassed(model, saved, None, None, example=example)
                return original(model, *args, **kwargs)
            if saved is not None and not model.built and concrete:
                # The factory builds its subclassed model by a call on a batch (keras.io:
                # ``model(tf.zeros((1, 10), "int32"))``): built here from that batch's shapes
                # and dtypes per example; tf_keras would take the batch dim for a feature dim
                # and every dtype for float32.
                _build_subclassed(model, saved, None, None, example=example)
                mesh = saved.get_default_mesh()
                on_mesh = tf.nest.map_structure(
                    lambda t: dtensor.copy_to_mesh(tf.convert_to_tensor(t), dtensor.Layout.replicated(
                        mesh, np.ndim(t))), example)
                try:
                    return original(model, on_mesh, *args[1:], **kwargs) if args else \
                        original(model, **{**kwargs, "inputs": on_mesh})
                except tf.errors.UnimplementedError as e:
                    if "got a regular tensor" not in str(e):
                        raise
                # The call uses a tensor the model holds (keras.io's GNN keeps its graph's node
                # features): eagerly a host tensor beside DTensor weights, which DTensor
                # refuses; traced, it is copied to the mesh as a step's constants are.

                @tf.function
                def traced(inputs):
                    op_support.constants_on_mesh(mesh)
                    return original(model, inputs, *args[1:], **kwargs) if args else \
                        original(model, **{**kwargs, "inputs": inputs})
                return traced(on_mesh)
            return original(model, *args, **kwargs)

        tf_keras.Model.__call__ = call
        return self

    def __exit__(self, *exc):
        from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
        tf_keras.Model.__call__ = self._original
        (keras_layout_map._map_functional_model_variable,  # pylint: disable=protected-access
         keras_layout_map._map_subclass_model_variable) = self._original_maps  # pylint: disable=protected-access
        return False


def _map_model_variables(model, layout_map):
    """tf_keras's ``_map_functional_model_variable`` / ``_map_subclass_model_variable``, with
    dtk's paths (``variable_paths``: nested Sequential/Functional models entered, by layer) and
    each lazy variable made into one DVariable however many paths reach it (tf_keras made one
    per path, missed a nested model's inner layers, and failed on a nested model called in a
    functional one)."""
    from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
    lazy = keras_layout_map._is_lazy_init_variable  # pylint: disable=protected-access
    made: dict[int, Any] = {}
    found = variable_paths(model, lambda i, layer: layer.name, predicate=lazy,
                           skip=keras_layout_map._KERAS_ATTRIBUTES_TO_SKIP)  # pylint: disable=protected-access
    for path, owner, owner_path, variable in found:
        if id(variable) not in made:
            made[id(variable)] = keras_layout_map._create_dvariable(  # pylint: disable=protected-access
                layout_map, path, variable)
        keras_layout_map._set_object_by_path(owner, owner_path, made[id(variable)])  # pylint: disable=protected-access
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        keras_layout_map._config_dvariable_regularization(layer, made)  # pylint: disable=protected-access
    # State no layer path reaches (a subclassed model's own metric objects, keras.io's VAE:
    # self.total_loss_tracker = Mean()): replicated, as tf_keras's map would make it.
    trackables, _ = tf.__internal__.tracking.ObjectGraphView(model).breadth_first_traversal()
    for trackable in trackables:
        for name, ref in trackable._trackable_children().items():  # pylint: disable=protected-access
            if lazy(ref) and id(ref) not in made:
                made[id(ref)] = keras_layout_map._create_dvariable(  # pylint: disable=protected-access
                    layout_map, f"{type(trackable).__name__}/{name}", ref)
    # Cached references (a layer's _trainable_weights lists...) to the new variables.
    for path, variable in model._flatten(predicate=lazy, with_path=True):  # pylint: disable=protected-access
        if id(variable) in made:
            keras_layout_map._set_object_by_path(model, path, made[id(variable)])  # pylint: disable=protected-access
    keras_layout_map._init_state_variable_for_rng(model, layout_map)  # pylint: disable=protected-access
    keras_layout_map._update_trackable_reference(model, made)  # pylint: disable=protected-access
    return model


class _preprocessing_deferred:  # pylint: disable=invalid-name
    """While the laid-out model is built: ``adapt()`` and ``finalize_state()`` of preprocessing
    layers do nothing.

    Under a layout scope the layers' state variables exist only as placeholders until dtk lays
    them out, so ``finalize_state`` (called by ``Normalization.build``) fails with "Input to
    reshape is a tensor with 0 values" and ``adapt()`` in a factory fails too. The plain build
    ran the user's ``adapt()``; its state is copied with the other weights, then
    ``_finalize_preprocessing`` runs.
    """

    def __enter__(self):
        self._saved = []
        for cls in _preprocessing_classes():
            for name in ("adapt", "finalize_state"):
                if name in cls.__dict__:
                    self._saved.append((cls, name, cls.__dict__[name]))
                    setattr(cls, name, _placeholder_state if name == "finalize_state" else
                            lambda self, *a, **k: None)
        return self

    def __exit__(self, *exc):
        for cls, name, method in self._saved:
            setattr(cls, name, method)


def _placeholder_state(layer, *args, **kwargs) -> None:
    """``finalize_state`` while the laid-out model is built: placeholders of the right shape for
    the constants a layer derives from its state (the build's symbolic call reads them)."""
    del args, kwargs
    if isinstance(layer, tf_keras.layers.Normalization) and layer.input_mean is None and \
            layer.built:
        layer.mean = tf.zeros(layer._broadcast_shape, layer.compute_dtype)  # pylint: disable=protected-access
        layer.variance = tf.ones(layer._broadcast_shape, layer.compute_dtype)  # pylint: disable=protected-access


def _finalize_preprocessing(model: tf_keras.Model) -> None:
    """Derives preprocessing layers' constants (Normalization's broadcast mean and variance) from
    their laid-out state, now that it holds the plain build's values."""
    classes = tuple(_preprocessing_classes())
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if isinstance(layer, classes) and layer.built:
            layer.finalize_state()


def _place_constants(model: tf_keras.Model, mesh: dtensor.Mesh) -> None:
    """Puts the constant tensors that layers hold as attributes on the mesh, replicated.

    A step captures them, and DTensor refuses a regular tensor among DTensors ("expecting a
    DTensor ... use copy_to_mesh"): e.g. ``Normalization(mean=..., variance=...)`` keeps its
    mean and variance as constants.
    """
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        for name, value in list(vars(layer).items()):
            if isinstance(value, tf.Tensor) and not isinstance(value, tf.Variable) and \
                    hasattr(value, "numpy") and _layout_of(value) is None:
                placed = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank))
                object.__setattr__(layer, name, placed)


def _layout_of(tensor) -> dtensor.Layout | None:
    try:
        return dtensor.fetch_layout(tensor)
    except (tf.errors.InvalidArgumentError, ValueError):
        return None


class _layer_name_counters:  # pylint: disable=invalid-name
    """Keras' per-graph counters behind automatic layer names (``dense``, ``dense_1`` ...).

    The plan is keyed on weight paths, which hold layer names; a factory called twice would give
    its unnamed layers new names the second time, and the plan would match none of them. dtk
    snapshots the counters before the plain build and restores them before the laid-out one.
    """

    def __init__(self):
        from tf_keras.src import backend as keras_backend  # pylint: disable=g-import-not-at-top
        keras_backend.get_default_graph_uid_map()  # make sure the default graph has its map
        self._uids = keras_backend.PER_GRAPH_OBJECT_NAME_UIDS
        self._saved = {graph: dict(counts) for graph, counts in self._uids.items()}

    def restore(self) -> None:
        for graph, counts in self._uids.items():
            counts.clear()
            counts.update(self._saved.get(graph, {}))


def _build_subclassed(model: tf_keras.Model, layout_map: _PlannedLayoutMap, input_shape,
                      dtype, *, example: Any = None) -> None:
    """Creates a subclassed model's weights under the layout map, as DTensor variables.

    tf_keras' own route (the first ``__call__`` under a layout scope) builds the model on
    ``Input(x.shape)``, which takes the batch dim of ``x`` as a feature dim (a ``[4, 28, 28, 1]``
    batch gives a ``[None, 4, 28, 28, 1]`` input). dtk does the same steps with the right
    symbolic input: call on ``Input(input_shape)`` with lazy variables, then replace them by
    DTensor variables laid out as planned. ``example``: a batch (a nest of tensors) whose
    shapes per example and dtypes give the inputs instead of ``input_shape`` and ``dtype``.
    """
    from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
    if example is not None:
        symbolic = tf.nest.map_structure(lambda t: tf_keras.Input(
            tuple(t.shape[1:]) if isinstance(t, tf.Tensor) else tuple(np.shape(t)[1:]),
            dtype=t.dtype if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t).dtype),
            example)
    else:
        symbolic = tf_keras.Input(tuple(int(d) for d in input_shape), dtype=dtype)
    saved, model._layout_map = model._layout_map, None  # pylint: disable=protected-access
    try:
        with keras_layout_map.layout_map_scope(layout_map):
            model(symbolic)
        keras_layout_map._map_subclass_model_variable(model, layout_map)  # pylint: disable=protected-access
    finally:
        model._layout_map = saved  # pylint: disable=protected-access


def _map_lazy_variables(model: tf_keras.Model, layout_map: _PlannedLayoutMap) -> None:
    """Replaces the lazy variables of a subclassed model that its factory built itself
    (``model.build(shape)``, or a call on ``tf_keras.Input``: the weights were made under the
    layout scope as lazy variables, which tf_keras maps only when it builds the model itself)
    by DTensor variables laid out as planned. A Functional or Sequential model has none left."""
    from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
    if any(keras_layout_map._is_lazy_init_variable(v) for v in model.weights):  # pylint: disable=protected-access
        keras_layout_map._map_subclass_model_variable(model, layout_map)  # pylint: disable=protected-access


def _lay_out_autocast_variables(model: tf_keras.Model, layout_map: _PlannedLayoutMap) -> None:
    """Lays out weights that tf_keras' LayoutMap misses under a mixed-precision policy.

    LayoutMap replaces the lazy variables it finds, but not those wrapped in an
    ``AutoCastVariable`` (every weight of a ``mixed_bfloat16`` layer); dtk creates them.
    """
    from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
    for path, variable in weight_paths(model):
        inner = getattr(variable, "_variable", None)
        if inner is not None and keras_layout_map._is_lazy_init_variable(inner):  # pylint: disable=protected-access
            variable._variable = keras_layout_map._create_dvariable(  # pylint: disable=protected-access
                layout_map, path, inner)


def memory_per_device(plan: LayoutPlan, *, optimizer_slots: int = 2,
                      shard_optimizer_state: bool = False) -> dict[str, int]:
    """Bytes per device of the weights and of the optimizer state, from the plan (no variables).

    ``optimizer_slots``: state tensors per weight (Adam/AdamW: 2, SGD with momentum: 1). With
    ``shard_optimizer_state`` the state of a weight that ``sharded_update_dims`` splits (a dim
    divisible by the batch axis, ``SHARDED_UPDATE_MIN_ELEMENTS`` or more elements a device) is
    split over it too, and the sharded update keeps a float32 copy of that weight laid out like
    its state (see ``dtk.train.mesh_optimizer.update_layout``); the other weights' state stays replicated.
    """
    sizes = dict(plan.mesh_axes)
    batch = sizes.get("batch", 1)
    weights = sum(w.bytes_per_device for w in plan.weights)
    shard_optimizer_state = shard_optimizer_state and not plan.fsdp  # FSDP state is sharded
    state = 0
    for w in plan.weights:
        if shard_optimizer_state and sharded_update_dims(
                w.dims, w.shape, "batch", sizes) != tuple(w.dims):
            state += (optimizer_slots + 1) * w.bytes_per_device // batch  # + the float32 copy
        else:
            state += optimizer_slots * w.bytes_per_device
    # FSDP: the weights gathered for compute while a step runs (all of them without remat).
    gathered = sum(w.bytes_total // _split(w.compute_dims, sizes) - w.bytes_per_device
                   for w in plan.weights if w.compute_dims is not None)
    return {"weights": weights, "optimizer": state, "total": weights + state,
            "gathered_in_step": gathered}


def _split(dims, sizes: dict[str, int]) -> int:
    split = 1
    for axis in dims:
        split *= sizes[axis] if axis else 1
    return split


def check_memory_budget(plan: LayoutPlan, budget_bytes: float, *, stage: int | None = None,
                        **kwargs) -> dict[str, int]:
    """Raises when weights + optimizer state per device exceed ``budget_bytes`` (before any
    variable exists), showing the arithmetic; returns ``memory_per_device``.

    Args:
      plan: the plan of the model (of one pipeline stage, with ``stage``).
      budget_bytes: the budget per device.
      stage: the pipeline stage whose sub-mesh ``plan`` is on: the fixes offered are those a
        pipeline has (FSDP and the sharded optimizer update do not run in stages).
      **kwargs: as ``memory_per_device``.

    Raises:
      ValueError: over budget, with the figures and only the fixes that apply (not FSDP where
        it is on, nor what a pipeline stage refuses).
    """
    memory = memory_per_device(plan, **kwargs)
    if memory["total"] > budget_bytes:
        mesh = ",".join(f"{k}={v}" for k, v in plan.mesh_axes)
        if stage is not None:
            where = f"pipeline stage {stage}'s sub-mesh {mesh}"
            fixes = ["more stages (a larger stage axis)", "a model axis beside the stages (e.g. "
                     "--mesh stage=2,batch=2,model=2)", "fewer or smaller blocks"]
        else:
            where = f"mesh {mesh}"
            fixes = ["shard it on a larger model axis (e.g. model=8)"]
            if not plan.fsdp:
                fixes.append("store it sharded over the batch axis too (fsdp=True, --fsdp)")
            if not kwargs.get("shard_optimizer_state"):
                fixes.append("turn on the sharded optimizer update (--shard_optimizer_state)")
        fixes.append("raise the budget (--device_memory_gb)")
        first = "; ".join(fixes[:-1])
        raise ValueError(
            f"the model does not fit the device memory budget on {where}: weights "
            f"{_bytes(memory['weights'])} + optimizer state {_bytes(memory['optimizer'])} = "
            f"{_bytes(memory['total'])} per device > budget {_bytes(int(budget_bytes))} "
            f"(activations not counted). {first[0].upper()}{first[1:]}, or {fixes[-1]}")
    return memory


def budget_note(memory: dict[str, int], budget_bytes: float) -> str:
    """The line that says a plan fits its budget (``check_memory_budget`` passed), with the
    arithmetic, for ``--explain_layouts --device_memory_gb``."""
    return (f"memory budget: weights {_bytes(memory['weights'])} + optimizer state "
            f"{_bytes(memory['optimizer'])} = {_bytes(memory['total'])} per device: fits the "
            f"budget of {_bytes(int(budget_bytes))} (--device_memory_gb; activations not counted)")


# -- explainer ------------------------------------------------------------------------------------
def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def explain(plan: LayoutPlan) -> str:
    """A table of every weight: path, shape, rule, sharding, bytes per device; then totals.

    The last line is a one-line summary (printed by ``train_mnist.py`` at start-up).
    """
    mesh = ",".join(f"{k}={v}" for k, v in plan.mesh_axes)
    rows = [("weight", "shape", "rule", "sharding", "per device")]
    for w in plan.weights:
        rule = w.rule.pattern if w.rule else f"(default: {plan.table.default})"
        spec = w.spec()
        if w.compute_dims is not None:  # FSDP: stored as spec, gathered to the table's dims
            spec += " (fsdp; computes [" + ", ".join(d or UNSHARDED for d in w.compute_dims) + "])"
        rows.append((w.path, str(list(w.shape)), rule, spec, _bytes(w.bytes_per_device)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"layout table {plan.table.name!r} on mesh {mesh}"]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    for warning in plan.warnings:
        lines.append(f"note: {warning}")
    total = sum(w.bytes_total for w in plan.weights)
    per_device = sum(w.bytes_per_device for w in plan.weights)
    sharded = sum(1 for w in plan.weights if any(w.dims))
    defaulted = sum(1 for w in plan.weights if w.rule is None and plan.table.rules)
    flags = []
    if plan.unused_rules:
        flags.append(f"WARNING: {len(plan.unused_rules)} rule(s) matched nothing")
    if defaulted:
        flags.append(f"WARNING: {defaulted} weight(s) by default ({plan.table.default})")
    if plan.fsdp:
        gathered = memory_per_device(plan)["gathered_in_step"]
        lines.append(f"note: fsdp: weights stored sharded over the batch axis; a step gathers "
                     f"up to {_bytes(gathered)} more per device for compute")
    lines.append(f"layouts: {plan.table.name} on {mesh}: {len(plan.weights)} weights "
                 f"({sharded} sharded{', fsdp' if plan.fsdp else ''}), {_bytes(total)} in all, "
                 f"{_bytes(per_device)} per device" + "".join(f"; {f}" for f in flags))
    return "\n".join(lines)
