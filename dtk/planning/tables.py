"""Where each embedding table goes: replicated, sharded on its rows or on its columns.

TorchRec's planner chooses per table among data-parallel (replicated), row-wise and column-wise
(and table-wise) sharding, from each option's memory and communication. dtk does the same for the
tables of a recommender (``dtk.models.dlrm``; any model whose tables are ``<layer>.embeddings``
weights) on each candidate mesh (``batch`` x ``model``), and writes the choice as a layout table
that ``build_model`` applies like the shipped ones. The cost of an option is the bytes a device
moves per step, summed over what the option does:

* **replicated**: the whole table and its optimizer state on every device; a dense gradient of
  the table's size all-reduced over ``batch`` (ring: ``2 (n - 1) / n`` of it), and an update
  over every row.
* **rows over an axis of size S** (``dtk.parallel.ops.row_sharded_lookup``): ``1/S`` of the table
  and state; the lookup is one all-reduce of the looked-up rows over the axis (over ``batch``:
  every device looks up the whole global batch; over ``model``: its batch rows); the dense update
  covers the block, and over ``model`` its gradient is all-reduced over ``batch`` too. With
  sparse updates (``dtk.train.sparse``) the gradient is the touched rows, gathered over
  ``batch``, and the update covers only them.
* **columns over ``model`` (size C)**: ``1/C`` of each row; the looked-up rows are gathered over
  the axis; the gradient and update as for rows. Not over ``batch``: the lookup's output,
  sharded on its columns over the axis its rows need, must change axes, which measured slower
  than rows over ``batch`` (2^20 x 16 on ``batch=8``: 113.0 against 67.9 ms a step dense, 51.5
  against 46.2 sparse).

Tables are split over ``model`` where the mesh has one, else over ``batch`` (every device): the
layouts dtk ships and tests. The rest of the model is data parallel: its gradient's all-reduce
and its activations (which a smaller ``batch`` axis repeats on more devices) count for every
mesh.

Table-wise placement (a whole table on some devices) is not an option: a DTensor tensor is laid
out over the whole mesh. Bytes are a proxy for time, valid to compare options on one machine
(a link and a memory pass both move bytes); the choice is the fewest bytes among the options
that fit the budget, for each table; for the mesh, the least memory a device among those within
``NEAR`` (1.25x) of the fewest bytes (the proxy cannot tell closer ones apart: sparse updates move
a few MiB on any mesh), then the larger ``batch`` axis. ``explain`` prints every option with its
memory, its bytes and why it was not chosen.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

ITEMSIZE = 4  # float32 tables
NEAR = 1.25  # meshes whose bytes moved are within this factor of the fewest are a tie
KINDS = ("replicated", "rows", "columns")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Table:
    """One embedding table: its weight path (``table0.embeddings``), rows and dim."""

    path: str
    rows: int
    dim: int

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"Table path must be a weight's path, e.g. 'table0.embeddings'; "
                             f"got {self.path!r}")
        for name in ("rows", "dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Table {self.path}: {name} must be a positive integer; got "
                                 f"{value!r}")

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * ITEMSIZE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One way to place one table on one mesh, with what it costs a device per step."""

    table: Table
    kind: str  # one of KINDS
    axis: str | None  # the mesh axis the table is split over (None: replicated)
    memory: int  # bytes per device: the table's share and its optimizer state
    moved: float  # bytes a device moves per step (collectives and the update's passes)
    why_not: str = ""  # why the option cannot be had ("" when it can)

    @property
    def dims(self) -> tuple[str | None, str | None]:
        """The table's layout dims, as a layout rule gives them."""
        return {"replicated": (None, None), "rows": (self.axis, None),
                "columns": (None, self.axis)}[self.kind]

    def label(self) -> str:
        return self.kind if self.axis is None else f"{self.kind} over {self.axis}"


def tables_of(weights: Sequence[tuple[str, Sequence[int], str]]) -> list[Table]:
    """The embedding tables among a model's weights (``planner.ModelProfile.weights``): the
    rank-2 weights named ``<layer>.embeddings``."""
    return [Table(path=p, rows=int(s[0]), dim=int(s[1])) for p, s, _ in weights
            if p.endswith(".embeddings") and len(s) == 2]


def _check_counts(**counts) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _ring(nbytes: float, n: int) -> float:
    """Bytes a device sends in a ring all-reduce of ``nbytes`` over ``n`` devices."""
    return 2 * nbytes * (n - 1) / n if n > 1 else 0.0


def options(table: Table, sizes: dict[str, int], *, global_batch_size: int, lookups: int = 1,
            optimizer_slots: int = 2, sparse: bool = False) -> list[Option]:
    """Every placement of ``table`` on a mesh of axis ``sizes`` (``batch``, maybe ``model``).

    Args:
      table: the table.
      sizes: the mesh's axis sizes, e.g. ``{"batch": 4, "model": 2}``.
      global_batch_size: examples per step.
      lookups: ids looked up in the table per example.
      optimizer_slots: the optimizer's state per weight (Adam 2, Adagrad 1, SGD 0).
      sparse: sharded tables updated sparsely (``TrainerConfig(sparse_tables=True)``).
    """
    _check_counts(global_batch_size=global_batch_size, lookups=lookups)
    if isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots, int) or \
            optimizer_slots < 0:
        raise ValueError(f"optimizer_slots must be an integer >= 0 (Adam 2, Adagrad 1, SGD 0); "
                         f"got {optimizer_slots!r}")
    if "batch" not in sizes or set(sizes) - {"batch", "model"}:
        raise ValueError(f"sizes {sizes!r}: the table planner places tables on meshes of a "
                         "'batch' axis and maybe a 'model' axis, e.g. {'batch': 4, 'model': 2}")
    nb, nm = sizes.get("batch", 1), sizes.get("model", 1)
    state = 1 + optimizer_slots
    ids = global_batch_size * lookups
    looked_up = ids * table.dim * ITEMSIZE  # the global batch's rows, [ids, dim]
    update_passes = 2 * state  # each of weights and slots read and written

    def sparse_terms(shards: int) -> float:
        # the touched rows' gradients gathered over batch, their state read (an all-reduce over
        # the rows' axis) and written in place
        return looked_up * (nb - 1) / nb + _ring(looked_up, shards) * optimizer_slots + \
            looked_up * update_passes

    out = [Option(table=table, kind="replicated", axis=None, memory=table.nbytes * state,
                  moved=_ring(table.nbytes, nb) + table.nbytes * update_passes)]
    # A table is split over `model` where the mesh has one, else over `batch` (every device):
    # the layouts dtk ships and tests (recsys, recsys_batch_rows).
    axis, n = ("model", nm) if nm > 1 else ("batch", nb)
    if n < 2:
        return out
    block = table.nbytes / n
    # over batch every device looks up all ids; over model, its batch rows
    rows_of_device = looked_up if axis == "batch" else looked_up / nb
    grad_reduce = 0.0 if axis == "batch" else _ring(block, nb)
    dense = grad_reduce + block * update_passes
    why = "" if table.rows % n == 0 else f"{table.rows} rows do not divide over {axis}={n}"
    out.append(Option(table=table, kind="rows", axis=axis, memory=int(block * state),
                      moved=_ring(rows_of_device, n) + (sparse_terms(n) if sparse else dense),
                      why_not=why))
    if axis == "model":  # over batch the lookup's output would change axes (measured slower)
        why = "" if table.dim % n == 0 else f"dim {table.dim} does not divide over {axis}={n}"
        out.append(Option(table=table, kind="columns", axis=axis, memory=int(block * state),
                          moved=rows_of_device * (n - 1) / n + (sparse_terms(1) if sparse
                                                                 else dense), why_not=why))
    return out


def choose(table: Table, sizes: dict[str, int], *, budget: float | None = None,
           **kwargs) -> tuple[Option, list[Option]]:
    """The option that moves the fewest bytes among those that can be had and fit ``budget``
    (bytes per device for this table; None: no limit), and every option.

    Raises:
      ValueError: no option fits, naming the table, the smallest option and the budget.
    """
    every = options(table, sizes, **kwargs)
    can = [o for o in every if not o.why_not and (budget is None or o.memory <= budget)]
    if not can:
        smallest = min((o for o in every if not o.why_not), key=lambda o: o.memory)
        raise ValueError(
            f"embedding table {table.path} ({table.rows} x {table.dim}) does not fit: its "
            f"smallest placement on mesh {_mesh(sizes)} ({smallest.label()}) needs "
            f"{smallest.memory / 2**20:.1f} MiB a device with its optimizer state, over the "
            f"{budget / 2**20:.1f} MiB left for it; use more devices on the axis, a smaller "
            "table, or a larger --device_memory_gb")
    return min(can, key=lambda o: (o.moved, o.memory)), every


def _mesh(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


@dataclasses.dataclass(frozen=True, kw_only=True)
class TablePlan:
    """The placement of every table on one mesh."""

    sizes: dict[str, int]
    chosen: tuple[Option, ...]
    every: tuple[tuple[Option, ...], ...]

    @property
    def moved(self) -> float:
        return sum(o.moved for o in self.chosen)

    @property
    def memory(self) -> int:
        return sum(o.memory for o in self.chosen)

    def layout_table(self, *, name: str = "recsys_planned", others: Sequence[Any] = ()):
        """The choice as a layout table (``dtk.parallel.layouts.LayoutTable``): one rule per
        table (a replicated one too), then ``others``, the rules of the model's other weights
        (the recommender's MLPs); a weight none names is replicated, with the plan's warning."""
        from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
        rules = tuple(layouts.LayoutRule(pattern=re.escape(o.table.path), dims=o.dims,
                                         note=f"planned: {o.label()}")
                      for o in self.chosen) + tuple(others)
        used = {o.axis for o in self.chosen if o.axis}
        return layouts.LayoutTable(
            name=name, description=f"embedding tables placed by dtk.planning.tables on "
            f"{_mesh(self.sizes)}", axes=tuple(self.sizes), rules=rules,
            replicated_axes=tuple(a for a in self.sizes if a not in used))


def plan(tables: Sequence[Table], sizes: dict[str, int], *, budget: float | None = None,
         **kwargs) -> TablePlan:
    """Places every table on one mesh, the largest first, each within what the budget leaves.

    Args:
      tables: the model's tables (``tables_of``).
      sizes: the mesh's axis sizes.
      budget: bytes per device for all the tables with their optimizer state (None: no limit).
      **kwargs: ``options``' arguments.
    """
    chosen, every = {}, {}
    left = budget
    for table in sorted(tables, key=lambda t: -t.nbytes):
        option, all_options = choose(table, sizes, budget=left, **kwargs)
        chosen[table.path], every[table.path] = option, tuple(all_options)
        if left is not None:
            left -= option.memory
    order = [t.path for t in tables]
    return TablePlan(sizes=dict(sizes), chosen=tuple(chosen[p] for p in order),
                     every=tuple(every[p] for p in order))


def dense_moved(sizes: dict[str, int], *, global_batch_size: int, dense_bytes: int,
                example_bytes: int) -> float:
    """Bytes a device moves per step for the rest of the model (replicated, data parallel):
    its gradient's all-reduce over ``batch``, and its activations for the device's rows
    (forward, and twice in the backward pass)."""
    return _ring(dense_bytes, sizes["batch"]) + \
        3 * example_bytes * global_batch_size / sizes["batch"]


def plan_mesh(tables: Sequence[Table], devices: int, *, global_batch_size: int,
              budget: float | None = None, dense_bytes: int = 0, example_bytes: int = 0,
              **kwargs) -> tuple[TablePlan, list[tuple[dict[str, int], TablePlan | None, str]]]:
    """The mesh (``batch`` x ``model`` over ``devices``) and its tables' placement: among the
    meshes that hold the tables and move at most ``NEAR`` x the fewest bytes, the one with the
    least memory a device; and every candidate with its plan or why it has none.

    Args:
      dense_bytes: the model's other (replicated) weights: their gradient's all-reduce over
        ``batch`` counts for every candidate, and their memory comes off the budget.
      example_bytes: the activations of one example (the rest of the model's compute, which a
        smaller batch axis repeats on more devices).

    Raises:
      ValueError: no candidate mesh can hold the tables.
    """
    _check_counts(devices=devices, global_batch_size=global_batch_size)
    if not tables:
        raise ValueError("tables is empty: give the model's embedding tables, e.g. "
                         "tables_of(profile.weights) (weights named '<layer>.embeddings')")
    paths = [t.path for t in tables]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise ValueError(f"tables names {twice} more than once: each table is placed once; give "
                         "each of the model's tables one Table")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0 < budget < float("inf")):
        raise ValueError(f"budget must be None or a positive, finite number of bytes per device; "
                         f"got {budget!r}")
    candidates = []
    for model in (m for m in range(1, devices + 1) if devices % m == 0):
        sizes = {"batch": devices // model, **({"model": model} if model > 1 else {})}
        if global_batch_size % sizes["batch"]:
            candidates.append((sizes, None, f"global batch {global_batch_size} does not divide "
                               f"over batch={sizes['batch']}"))
            continue
        left = None if budget is None else budget - dense_bytes * (1 + kwargs.get(
            "optimizer_slots", 2))
        try:
            candidates.append((sizes, plan(tables, sizes, budget=left,
                                           global_batch_size=global_batch_size, **kwargs), ""))
        except ValueError as e:
            candidates.append((sizes, None, str(e)))
    feasible = [(s, p) for s, p, _ in candidates if p is not None]
    if not feasible:
        raise ValueError("no mesh of " + str(devices) + " devices holds the tables: " +
                         "; ".join(f"{_mesh(s)}: {why}" for s, _, why in candidates))

    def moved(item):
        sizes, p = item
        return p.moved + dense_moved(sizes, global_batch_size=global_batch_size,
                                     dense_bytes=dense_bytes, example_bytes=example_bytes)
    fewest = min(moved(item) for item in feasible)
    # Bytes within NEAR of the fewest are a tie (a proxy cannot tell them apart; sparse updates
    # move a few MiB on any mesh): then the least memory a device, then the larger batch axis.
    near = [item for item in feasible if moved(item) <= NEAR * fewest]
    best = min(near, key=lambda item: (item[1].memory, -item[0]["batch"], moved(item)))[1]
    return best, candidates


def explain(best: TablePlan, candidates, *, global_batch_size: int, dense_bytes: int = 0,
            example_bytes: int = 0) -> str:
    """Every candidate mesh with its tables' placement, memory and bytes moved; then each
    table's options on the chosen mesh, and why the others were not chosen."""
    lines = ["embedding tables: candidate meshes (bytes a device moves per step: lookups, "
             "gradient reductions, updates, the rest of the model's activations)"]
    for sizes, p, why in candidates:
        mark = "*" if p is best else " "
        if p is None:
            lines.append(f" {mark} {_mesh(sizes):<18} cannot: {why}")
            continue
        moved = p.moved + dense_moved(sizes, global_batch_size=global_batch_size,
                                      dense_bytes=dense_bytes, example_bytes=example_bytes)
        placed = ", ".join(f"{o.table.path.split('.')[0]} {o.label()}" for o in p.chosen)
        lines.append(f" {mark} {_mesh(sizes):<18} {moved / 2**20:9.2f} MiB moved, tables "
                     f"{p.memory / 2**20:8.1f} MiB a device: {placed}")
    lines.append(f"chosen: {_mesh(best.sizes)}: of the meshes that hold the tables and move at "
                 f"most {NEAR:.2f}x the fewest bytes, the least memory a device (then the "
                 "larger batch axis)")
    for option, every in zip(best.chosen, best.every):
        lines.append(f"  {option.table.path} [{option.table.rows}, {option.table.dim}]: "
                     f"{option.label()}")
        for o in every:
            if o is option:
                continue
            # an option that moves fewer bytes was left out for its memory
            cheaper = (o.moved, o.memory) < (option.moved, option.memory)
            why = o.why_not or ("over the memory left for it" if cheaper else
                                "moves more bytes")
            lines.append(f"      not {o.label():<18} {o.memory / 2**20:8.1f} MiB, "
                         f"{o.moved / 2**20:8.2f} MiB moved: {why}")
    return "\n".join(lines)
