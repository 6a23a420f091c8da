"""What dtk's command-line tools share: flags, quiet start-up, output checks, one ``error:`` line.

Used by ``scripts/train_mnist.py``, ``scripts/train_lm.py``, ``scripts/tune_mnist.py`` (and
``dtk-explain``); library code never calls it. The flags that several scripts take are defined
once here (``define_flags``), so they have one spelling, one meaning and one help text; a test
compares the scripts' flags. Only the default may differ by script (each script's own model).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from dtk import _env
from dtk.usage import ArgumentParser, entry_point, parse_flags, run_app  # noqa: F401  (the scripts' entry)


class UsageError(ValueError):
    """A user error found by a script's own checks: printed as one line, exit status 2."""


# -- shared flags ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedFlag:
    """One flag that several scripts take: its kind (absl DEFINE_*), default and help text."""

    kind: str
    default: Any
    help: str
    enum_values: tuple[str, ...] = ()


SHARED_FLAGS: dict[str, SharedFlag] = {
    "mesh": SharedFlag(kind="string", default="batch=8", help=(
        "Mesh spec: axis=size pairs in order, e.g. batch=8 or batch=4,model=2 (the 'batch' axis "
        "shards the data; 'model' shards weights as the layout table says; batch=-1 takes every "
        "device), or 'auto': the planner (dtk.plan) chooses the mesh, FSDP, remat and "
        "--grad_accum from --device_memory_gb and a cost model measured on this machine "
        "(--explain_plan shows why).")),
    "device": SharedFlag(kind="enum", default="auto", enum_values=("auto", "cpu", "gpu", "tpu"),
                         help="Device type (auto: TPU > GPU > CPU)."),
    "virtual_devices": SharedFlag(kind="integer", default=None, help=(
        "CPU only: logical CPU devices to create per client (default: as many as the mesh "
        "needs).")),
    "layout": SharedFlag(kind="string", default=None, help=(
        "Layout table: a name from layouts/ or a path to a .toml table (default: the model's "
        "table).")),
    "seed": SharedFlag(kind="integer", default=0, help=(
        "Seed for weights and data order (identical on every client).")),
    "learning_rate": SharedFlag(kind="float", default=None, help=(
        "Learning rate (default: the model's tuned value).")),
    "checkpoint_dir": SharedFlag(kind="string", default=None, help=(
        "Save checkpoints here; re-running with the same directory resumes.")),
    "restart_from_scratch": SharedFlag(kind="bool", default=False, help=(
        "Remove the checkpoints in --checkpoint_dir and start again (by default a run resumes "
        "from them).")),
    "allow_change": SharedFlag(kind="list", default=[], help=(
        "Settings a resume may change on purpose, comma-separated (e.g. learning_rate,seed; "
        "'model' for model hyper-parameters). By default a resume whose settings differ from "
        "the checkpoint's is an error that lists them.")),
    "export_dir": SharedFlag(kind="string", default=None, help=(
        "Write the trained model as .keras and SavedModel here.")),
    "tensorboard_dir": SharedFlag(kind="string", default=None, help=(
        "Write TensorBoard scalars here.")),
    "summary_json": SharedFlag(kind="string", default=None, help=(
        "Write a JSON summary of the run to this path (checked before training).")),
    "explain_layouts": SharedFlag(kind="bool", default=False, help=(
        "Print where every weight lives and what it costs per device, then exit.")),
    "explain_plan": SharedFlag(kind="bool", default=False, help=(
        "Print the planner's candidates (mesh x FSDP x remat x microbatches): memory per "
        "device, predicted ms/step, chosen or why not; then exit.")),
    "plot": SharedFlag(kind="string", default=None, help=(
        "With --explain_plan or --mesh auto: also draw the planner's candidates (predicted "
        "ms/step against memory per device, the budget line, the chosen plan) as a PNG here "
        "(needs matplotlib; checked before planning).")),
    "device_memory_gb": SharedFlag(kind="float", default=None, help=(
        "Per-device memory budget in GiB for weights + optimizer state, checked before any "
        "variable exists.")),
    "shard_optimizer_state": SharedFlag(kind="bool", default=None, help=(
        "ZeRO-style update: shard optimizer state and the weight update over the batch axis "
        "(same numbers, less memory). Default: on where the batch axis has 2+ devices; "
        "--noshard_optimizer_state turns it off.")),
    "fsdp": SharedFlag(kind="bool", default=False, help=(
        "Fully sharded data parallel (ZeRO-3): store weights, gradients and optimizer state "
        "sharded over the batch axis too, gathered for compute (same numbers, weights memory "
        "divided by the batch axis size).")),
    "remat": SharedFlag(kind="list", default=[], help=(
        "Recompute these layers' activations in the backward pass: layer-name regular "
        "expressions, comma-separated, or 'blocks' for the model's own choice (the LM: every "
        "block's attention and MLP). Same numbers, less activation memory.")),
    "grad_accum": SharedFlag(kind="integer", default=1, help=(
        "Gradient accumulation (also --microbatches): split each batch into this many "
        "microbatches and make one "
        "update from their summed gradients (same numbers as one batch; it must divide the "
        "per-device batch).")),
    "async_checkpoints": SharedFlag(kind="bool", default=True, help=(
        "Write checkpoints in the background (the default): each save copies the state to host "
        "memory and training goes on while a thread writes it; it becomes the latest "
        "checkpoint only once complete. --noasync_checkpoints writes before the next step.")),
    "mixed_precision": SharedFlag(kind="bool", default=False, help=(
        "Compute in bfloat16 (mixed_bfloat16 policy; float32 outputs).")),
    "allow_replicated": SharedFlag(kind="bool", default=False, help=(
        "Accept a --layout table that shards no weight of the model (by default an error: "
        "everything would train replicated).")),
    "global_batch_size": SharedFlag(kind="integer", default=128, help=(
        "Examples per step over the whole mesh (a multiple of the 'batch' axis).")),
    "epochs": SharedFlag(kind="integer", default=3,
                         help="Epochs to train: passes over the training data."),
    "dataset": SharedFlag(kind="enum", default="tfds", enum_values=("tfds", "idx", "sample"),
                          help=("MNIST source: tensorflow_datasets (falls back to the bundled "
                                "sample when offline and no --data_dir), LeCun IDX files in "
                                "--data_dir, or the sample bundled with dtk (2,000 + 1,000 "
                                "images).")),
    "data_dir": SharedFlag(kind="string", default=None, help=(
        "TFDS data dir, or the directory of MNIST IDX files (--dataset idx).")),
}

# What the training scripts both take (tested: same names, same help, same kind).
TRAINING_FLAGS = ("mesh", "device", "virtual_devices", "layout", "seed", "learning_rate",
                  "checkpoint_dir", "restart_from_scratch", "allow_change", "export_dir", "tensorboard_dir",
                  "summary_json", "explain_layouts", "device_memory_gb", "shard_optimizer_state",
                  "mixed_precision", "allow_replicated", "fsdp", "remat", "grad_accum",
                  "async_checkpoints", "explain_plan", "plot")
# Output paths: every one is checked before training by ``check_output_path``.
OUTPUT_DIR_FLAGS = ("checkpoint_dir", "export_dir", "tensorboard_dir")
OUTPUT_FILE_FLAGS = ("summary_json", "plot")


# Other names a flag answers to: the planner speaks of microbatches (--explain_plan's
# "microbatches=4" is --grad_accum 4).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"grad_accum": ("microbatches",)}


def define_flags(names, **defaults: Any) -> None:
    """Defines the shared flags ``names`` in absl's global FLAGS (a script's default may differ).

    They count as the calling script's own flags: ``--help`` lists them.
    """
    import inspect  # pylint: disable=g-import-not-at-top
    from absl import flags  # pylint: disable=g-import-not-at-top
    module = inspect.getmodule(inspect.stack()[1].frame)
    module_name = getattr(module, "__name__", None) or "__main__"
    if module_name == "__main__":
        module_name = sys.argv[0]  # how absl names the main module
    for name in names:
        spec = SHARED_FLAGS[name]
        default = defaults.pop(name, spec.default)
        if spec.kind == "enum":
            flags.DEFINE_enum(name, default, list(spec.enum_values), spec.help,
                              module_name=module_name)
        else:
            getattr(flags, f"DEFINE_{spec.kind}")(name, default, spec.help,
                                                  module_name=module_name)
        for alias in FLAG_ALIASES.get(name, ()):
            flags.DEFINE_alias(alias, name, module_name=module_name)
    if defaults:
        raise TypeError(f"defaults for flags not defined here: {sorted(defaults)}")


def refuse_unused(flag_values, unused: dict[str, str], script: str) -> None:
    """The one rule for a flag a script defines (a shared flag) and does not use: refused where
    it is given, with the reason, never dropped silently (``unused``: name -> why).

    Raises:
      UsageError: naming the flag, the script and why.
    """
    for name, why in unused.items():
        if flag_values[name].present:
            raise UsageError(f"--{name} is not used by {script}: {why}; drop it")


def check_shared_flags(values: Callable[[str], Any]) -> None:
    """Checks the shared flags a script defined; ``values(name)`` reads one (None if undefined).

    Raises:
      UsageError: a bad value, naming the flag, the value and the fix.
    """
    devices = values("virtual_devices")
    if devices is not None and devices < 1:
        raise UsageError(f"--virtual_devices must be a positive integer; got {devices} (leave it "
                         "out to create as many as the mesh needs)")
    accum = values("grad_accum")
    if accum is not None and accum < 1:
        given = next((f"--{alias}" for alias in FLAG_ALIASES["grad_accum"]
                      if any(a.split("=")[0] == f"--{alias}" for a in sys.argv[1:])),
                     "--grad_accum")  # the name the user typed
        raise UsageError(f"{given} must be a positive integer; got {accum} (1: "
                         f"{'one microbatch a step' if given != '--grad_accum' else 'no accumulation'})")
    for name in ("learning_rate", "device_memory_gb"):
        value = values(name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name} must be a positive, finite number; got {value}")
    if values("plot") and not (values("explain_plan") or values("mesh") == AUTO_MESH):
        raise UsageError(f"--plot {values('plot')} draws the planner's candidates: give "
                         "--explain_plan or --mesh auto with it")
    for name in OUTPUT_DIR_FLAGS:
        if values(name):
            check_output_path(name, values(name), kind="dir")
    for name in OUTPUT_FILE_FLAGS:
        if values(name):
            check_output_path(name, values(name), kind="file")


def check_device(values: Callable[[str], Any]) -> None:
    """``--device gpu``/``tpu`` on a machine without one: one line, before DTensor sees it.

    Raises:
      UsageError: no device of that kind is visible to TensorFlow.
    """
    device = values("device")
    if device in ("gpu", "tpu"):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        if not tf.config.list_physical_devices(device.upper()):
            raise UsageError(f"--device {device}: this machine has no {device.upper()} that "
                             "TensorFlow can see; use --device cpu (or auto)")


# -- the planner ----------------------------------------------------------------------------------
AUTO_MESH = "auto"
DEFAULT_CPU_DEVICES = 8  # --mesh auto on CPU without --virtual_devices: as the default batch=8


def devices_to_plan_for(values: Callable[[str], Any], kind: str) -> int:
    """The devices ``--mesh auto`` plans for: every device of every client, as the mesh will
    have them (``--virtual_devices``, else ``DTK_VIRTUAL_DEVICES`` a launcher sets per client,
    else ``DEFAULT_CPU_DEVICES`` on CPU), the same on every client."""
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    virtual = values("virtual_devices")
    if kind == "CPU" and virtual is None and _env.get_int(_env.VIRTUAL_DEVICES) is None:
        virtual = DEFAULT_CPU_DEVICES
    return mesh_lib.build_mesh("batch=-1", device_type=kind, virtual_devices=virtual).size


def plan_from_flags(values: Callable[[str], Any], factory, *, input_shape, input_dtype: str,
                    num_classes: int, table, remat_patterns, optimizer: str,
                    global_batch_size: int, pipeline: bool = False):
    """Runs the planner for ``--mesh auto`` / ``--explain_plan`` over every device this run has.

    Returns the ``dtk.planning.planner.Plan``. ``--fsdp``, ``--remat``, ``--grad_accum`` and the update
    (``--noshard_optimizer_state``) are the planner's to choose under ``--mesh auto``: given
    too, they are a usage error (a plan that reports ``zero`` must be what runs).

    Raises:
      UsageError: conflicting flags, or no plan fits (the planner's arithmetic and fix).
    """
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from dtk.planning import planner  # pylint: disable=g-import-not-at-top
    given = [f"--{n}" for n, chosen in (("fsdp", bool(values("fsdp"))),
                                         ("remat", bool(values("remat"))),
                                         ("grad_accum", (values("grad_accum") or 1) != 1),
                                         ("noshard_optimizer_state",
                                          values("shard_optimizer_state") is False))
             if chosen]
    if values("mesh") == AUTO_MESH and given:
        raise UsageError(f"--mesh auto chooses {', '.join(given)} itself; drop "
                         f"{'them' if len(given) > 1 else 'it'}, or give a mesh")
    if values("explain_plan"):
        # The plan compares the planner's candidates; a flag it would not show is an error.
        if given:
            raise UsageError(f"--explain_plan compares the planner's candidates, which choose "
                             f"{', '.join(given)} themselves, so the plan would not show "
                             f"{'them' if len(given) > 1 else 'it'}; drop "
                             f"{'them' if len(given) > 1 else 'it'}, or see this configuration's "
                             "weights with --explain_layouts")
    check_device(values)
    kind = mesh_lib.resolve_device_type(values("device") or "auto")
    if values("plot"):
        try:
            import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
        except ImportError:
            raise UsageError(f"--plot {values('plot')}: drawing the plan needs matplotlib: pip "
                             "install 'dtk-dtensor[bench]'") from None
        from matplotlib import figure  # pylint: disable=g-import-not-at-top
        formats = figure.Figure().canvas.get_supported_filetypes()
        suffix = os.path.splitext(values("plot"))[1].lstrip(".").lower()
        if suffix not in formats:  # before planning (minutes), not after it
            raise UsageError(
                f"--plot {values('plot')}: the chart is an image; name a file ending in .png, "
                f".svg or .pdf (matplotlib writes {', '.join('.' + f for f in sorted(formats))})"
                + ("" if suffix else ", not a name without a suffix"))
    devices = devices_to_plan_for(values, kind)
    try:
        plan = planner.plan(factory, devices=devices, global_batch_size=global_batch_size,
                            device_memory_gb=values("device_memory_gb"), table=table,
                            input_shape=input_shape, input_dtype=input_dtype,
                            num_classes=num_classes, optimizer=optimizer,
                            remat_patterns=remat_patterns, device_type=kind,
                            pipeline=pipeline)
    except planner.PlanError as e:
        raise UsageError(f"--mesh auto: {e}") from None
    if values("plot"):
        planner.plot_plan(plan, values("plot"))
    return plan


def check_explain_plan(flags) -> None:
    """``--explain_plan`` compares every candidate mesh over this run's devices and exits: a
    ``--mesh`` given with it would be ignored, and ``--explain_layouts`` never printed, so both
    are refused (``flags``: the script's absl FlagValues).

    Raises:
      UsageError: ``--explain_plan`` with ``--mesh SPEC`` (other than ``auto``) or with
        ``--explain_layouts``.
    """
    if not flags.explain_plan:
        return
    if flags.explain_layouts:
        raise UsageError("--explain_plan and --explain_layouts each print one report and exit; "
                         "give one of them")
    if flags["mesh"].present and flags.mesh != AUTO_MESH:
        raise UsageError(f"--explain_plan compares the planner's candidate meshes over every "
                         f"device, so it would ignore --mesh {flags.mesh}; drop --mesh (or see "
                         "that mesh's weights with --explain_layouts)")


def apply_plan(flags, plan) -> None:
    """Sets the flags the plan chose (``--mesh``, ``--fsdp``, ``--remat``, ``--grad_accum``)."""
    chosen = plan.chosen.config
    flags.mesh = chosen["mesh"]
    flags.fsdp = chosen["fsdp"]
    flags.remat = ["blocks"] if chosen["remat"] else []
    flags.grad_accum = chosen["gradient_accumulation_steps"]


def refuse_stage_axis(spec, script: str) -> None:
    """A ``stage`` axis in ``--mesh`` for a script that does not train in pipeline stages.

    Raises:
      UsageError: naming the axis, the script that runs stages, and the fix.
    """
    if spec is not None and "stage" in spec.axis_names:
        raise UsageError(f"--mesh {spec}: a 'stage' axis splits a model into pipeline stages, "
                         f"which train_lm.py runs (its blocks are the stages); {script} trains "
                         "one model on every device: drop the stage axis")


def mesh_and_table(values: Callable[[str], Any]):
    """The mesh (``--mesh``, ``--device``, ``--virtual_devices``) and the layout table
    (``--layout``) a script's flags name: ``(spec, mesh, table)``.

    Raises:
      UsageError: a mesh without the batch axis, one that cannot be built, or an unknown table,
        naming the flag.
    """
    import dtk  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    check_device(values)
    try:
        spec = dtk.parse_mesh_spec(values("mesh"))
        if dtk.BATCH_AXIS not in spec.axis_names:
            raise ValueError(f"it has no '{dtk.BATCH_AXIS}' axis, the data-parallel axis that "
                             f"inputs are sharded on; add one, e.g. {dtk.BATCH_AXIS}=1,{spec}")
        mesh = dtk.build_mesh(spec, device_type=values("device"),
                              virtual_devices=values("virtual_devices"))
    except ValueError as e:
        raise UsageError(f"--mesh {values('mesh')}: {e}") from None
    try:
        table = layouts.load_table(values("layout"))
    except ValueError as e:
        raise UsageError(f"--layout: {e}") from None
    return spec, mesh, table


def plan_summary(plan) -> dict[str, Any] | None:
    """The summary JSON's record of the plan ``--mesh auto`` chose (None without one)."""
    if plan is None:
        return None
    return {"chosen": plan.chosen.label, "predicted_ms_per_step": plan.chosen.predicted_ms,
            "bytes_per_device": plan.chosen.memory,
            **({"experts_bytes_per_device": plan.chosen.experts_bytes,
                "all_to_all_bytes_per_step": plan.chosen.all_to_all_bytes}
               if plan.chosen.experts_bytes else {}),
            **({"stages": plan.chosen.stages, "microbatches": plan.chosen.microbatches,
                "bubble": plan.chosen.bubble,
                "boundary_bytes_per_step": plan.chosen.boundary_bytes}
               if plan.chosen.stages > 1 else {})}


# -- output paths ---------------------------------------------------------------------------------
def check_output_path(flag: str, path: str, *, kind: str) -> None:
    """Checks, before any training, that ``path`` can be written: a directory (``kind="dir"``)
    or a file (``kind="file"``) that exists or can be created, with every missing parent.

    The check creates and removes a probe directory in the nearest existing ancestor rather than
    reading permission bits: root passes every ``os.access`` test, and ``/proc`` or a read-only
    mount say "writable" by their bits, yet refuse a write.

    Raises:
      UsageError: naming the flag, the path, what stands in the way, and the fix.
    """
    problem = _env.path_problem(path, kind=kind)
    if problem:
        raise UsageError(f"--{flag} {problem}")


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` atomically (a temp file, then a rename).

    Raises:
      OSError: the write failed (see ``write_summary`` for the fallback).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_summary(path: str, value: Any) -> int:
    """Writes the run's summary; if that fails at the end (a disk filled during the run), the
    summary is kept in a fallback file (or printed) and the error says where. Returns the exit
    status: 0, or 1 when the summary did not reach ``path``."""
    try:
        write_json(path, value)
        return 0
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
    fallback = os.path.join(tempfile.gettempdir(), f"dtk-summary-{os.getpid()}.json")
    try:
        write_json(fallback, value)
        where = f"it was written to {fallback} instead"
    except OSError:
        print(json.dumps(value), flush=True)
        where = "it was printed above as one JSON line instead"
    print(f"error: writing --summary_json {path!r} failed after training ({reason}); {where}",
          file=sys.stderr, flush=True)
    return 1


# -- quiet output ---------------------------------------------------------------------------------
def setup_output(*, verbose: bool) -> None:
    """dtk's status lines to stdout; TensorFlow's C++ and absl lines hidden unless ``verbose``
    (the user passed ``--verbosity``). See ``dtk._env.quiet_tensorflow_env``.

    Also, unless the user set it: ``TF_USE_LEGACY_KERAS=1``, so that TensorFlow does not import
    Keras 3 at start-up, which dtk's models never use (they are ``tf_keras``): 0.8 s of CPU in
    every process start (3.9 -> 3.1 s for ``import dtk, tensorflow`` and a mesh, here).
    """
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    if not verbose:
        from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
        absl_logging.set_verbosity(absl_logging.ERROR)
        os.environ.update(_env.quiet_tensorflow_env())
        _env.import_tensorflow_quietly(always=True)
    else:  # --verbosity: show what a launcher started quietly (dtk.cluster.launch, Ray) hid
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    log = logging.getLogger("dtk")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_AdviceInFlags())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


# The library's advice names the call that changes a setting; a script's user reads the flag that
# does it (when the running script defines that flag).
ADVICE_FLAGS = {
    "TrainerConfig(sparse_tables=True)": "--sparse_tables",
    "TrainerConfig(allow_change=...)": "--allow_change",
    "TrainerConfig(restart_from_scratch=True)": "--restart_from_scratch",
}


def advice_in_flags(text: str) -> str:
    """``text`` with each library call of ``ADVICE_FLAGS`` replaced by its flag, where the running
    script defines it; a call named twice (``--x / Call(...)``) keeps the flag once."""
    from absl import flags  # pylint: disable=g-import-not-at-top
    for call, flag in ADVICE_FLAGS.items():
        if call in text and flag.lstrip("-").removeprefix("no") in flags.FLAGS:
            text = text.replace(f"{flag} / {call}", flag).replace(call, flag)
    return text


class _AdviceInFlags(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = advice_in_flags(record.getMessage()), None
        return True


def run_reporting_errors(run: Callable[[], Any]) -> tuple[int, Any]:
    """Calls ``run``; a ``ValueError``/``TypeError`` (dtk's user errors) becomes one ``error:``
    line on stderr and exit status 2, with no traceback; a stop on SIGTERM/SIGINT
    (``dtk.train.preemption.Preempted``) one ``stopped:`` line naming the checkpoint, and exit
    status 128 + the signal's number. Returns ``(status, run's result)``."""
    try:
        return 0, run()
    except SystemExit as e:
        if not hasattr(e, "signum"):
            raise
        # dtk.train.preemption.Preempted: saved at a step boundary on SIGTERM/SIGINT
        print(str(e), file=sys.stderr, flush=True)  # "stopped by SIGTERM at step ...: saved ..."
        return int(e.code), None
    except (ValueError, TypeError) as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        line = advice_in_flags(lines[0]) if lines else type(e).__name__
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2, None
    except Exception as e:  # pylint: disable=broad-except
        line = _lost_peer_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 1, None


def _lost_peer_line(e: BaseException) -> str | None:
    """One ``error:`` line for a client of a multi-client run whose peer died (the launcher
    names the client that failed); None for anything else (it keeps its traceback)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(e, tf.errors.OpError):
        return None
    from dtk.cluster import env as cluster, launch  # pylint: disable=g-import-not-at-top
    from dtk.errors import first_line  # pylint: disable=g-import-not-at-top
    if cluster.num_clients() < 2:
        return None
    text = str(e)
    if not any(w in text.lower() for w in launch._PEER_ERROR_WORDS):  # pylint: disable=protected-access
        return None
    peers = sorted({int(t) for t in launch._TASK_IN_ERROR.findall(text)}  # pylint: disable=protected-access
                   - {cluster.client_id()})
    who = f"client {peers[0]}" if peers else "another client"
    return (f"error: client {cluster.client_id()} lost contact with {who} ({type(e).__name__}: "
            f"{first_line(e, limit=200)}); stopping")


_KEPT: list[Any] = []


def keep_until_exit(*objects: Any) -> None:
    """Keeps a script's datasets alive until its process ends (``cluster.exit_process``).

    Tearing down a ``tf.data`` pipeline's iterators takes 0.2-0.9 s per dataset, measured on
    MNIST, and a script that returns its summary would pay it before it leaves. The process ends
    just after, so there is nothing to free.
    """
    _KEPT.extend(objects)


def main(argv: list[str], run: Callable[[], Any], *, verbose: bool,
         summary_json: str | None, precheck: Callable[[], Any] | None = None) -> int:
    """The ``main`` of a training script: checks argv, sets up output, runs, writes the summary.

    ``run`` returns the summary (a dict, empty when there is nothing to write); only the lead
    client writes it. ``precheck``: flag checks that need no TensorFlow (a file that is not
    there), run before TensorFlow loads (seconds, 14 on a slow machine), not after.
    """
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; all options are --flags (see --helpfull)",
              file=sys.stderr)
        return 2
    if precheck is not None:
        status, _ = run_reporting_errors(precheck)
        if status:
            return status
    setup_output(verbose=verbose)
    for line in _env.unknown_names():  # a misspelled DTK_* variable: one line, not ignored
        print(f"warning: {line}", file=sys.stderr, flush=True)
    status, summary = run_reporting_errors(
        lambda: (_env.check_all(warn_unknown=False), run())[1])
    if status == 0 and summary_json and summary:
        from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
        if cluster.is_lead_client():
            status = write_summary(summary_json, summary)
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top,redefined-outer-name
    cluster.exit_process(status)  # does not return: the group leaves within a second
    return status  # for readers: exit_process ends the process with this status


