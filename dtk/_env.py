"""The process environment: DTensor settings dtk puts in force, and dtk's own ``DTK_*`` variables.

Standard library only (the launcher imports it without TensorFlow). Every ``DTK_*`` variable is
named once below and read through ``get_*``, which validate and name the variable in their errors.

Process-wide DTensor settings must be in force before the first trace.

Why this exists: with DTensor's default "combine all-reduces" optimization, a data-parallel train
step on a batch-sharded mesh silently computes wrong updates (SGD and Adam losses 40-70% off within
5 steps; RMSprop and Adagrad diverge; see dtensor-notes.md, trap 1). Turning it off restores parity
with single-device training to float tolerance for a ~13% step-time cost. DTensor reads the variable
when a function is traced, so dtk sets it at import, before any trace, and never overrides a value
the user set on purpose (it warns instead, once, because the results will be wrong).

It also lowers DTensor all-gathers to ``CollectiveGatherV2``. By default DTensor lowers an
all-gather on CPU and GPU to an all-reduce of a zero-padded buffer of the full gathered size (see
``LowerCollectiveGatherToCollectiveGatherV2`` in DTensor's ``dtensor_utils.cc``): every device
adds eight full copies to get one. The ZeRO-style sharded update (``StepConfig(
shard_optimizer_state=True)``) all-gathers every weight after each step, so this decides whether
that option pays off. Measured in one process on 8 virtual CPUs: MNIST MLP step 19.8 ms without
the setting, 17.1 ms with it, 18.2 ms replicated; 784-1024-1024-10 at batch 1024: 341 ms without,
302 ms with, 371 ms replicated. A user's own value is respected (``0`` turns it off).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

COMBINE_ALL_REDUCES_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
_SAFE_VALUE = "0"
GATHER_V2_ENV = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
GPU_NCCL_ENV = "DTENSOR_GPU_USE_NCCL_COMMUNICATION"


def apply_gpu_defaults() -> None:
    """GPU meshes: DTensor uses NCCL collectives only when asked (else its generic ones, slower on
    NVIDIA GPUs); dtk asks unless the user set the variable. Called before the GPU mesh exists."""
    os.environ.setdefault(GPU_NCCL_ENV, "1")


# The variables set before dtk set any (``dtk-env`` tells the user's from dtk's defaults).
USER_SET = frozenset(os.environ)
# Whether the user chose TensorFlow's C++ log level (dtk then shows what that level shows).
_USER_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL" in os.environ


def apply_library_log_defaults() -> None:
    """dtk imported before TensorFlow, as a library: TensorFlow's C++ INFO lines hidden unless the
    user set ``TF_CPP_MIN_LOG_LEVEL`` (DTensor writes two "cache key lookup missed" lines for
    every function it compiles, ten in README's library example). Warnings and errors stay."""
    if not _USER_LOG_LEVEL and "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


@contextlib.contextmanager
def quiet_stderr(when: bool = True, *, always: bool = False):
    """Closes the process's stderr (the C++ one too) within it, unless ``when`` is false or the
    user set ``TF_CPP_MIN_LOG_LEVEL`` (``always``: even then; a command-line tool that is not
    ``--verbosity``). Python exceptions raised inside still propagate."""
    if not when or (_USER_LOG_LEVEL and not always):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def no_nvidia_driver() -> bool:
    """No NVIDIA kernel driver on this machine: TensorFlow's CUDA probe can only fail, and its
    "failed call to cuInit: ... UNKNOWN ERROR (303)" line says nothing a user can act on."""
    return not os.path.exists("/proc/driver/nvidia") and not os.path.exists("/dev/nvidiactl")


def apply_safe_defaults() -> None:
    """Sets the parity-safe DTensor settings unless the user set them; warns on an unsafe value."""
    # DTensor checks only that the variable exists, so a user's "0" means off: remove it.
    if os.environ.setdefault(GATHER_V2_ENV, "1").strip().lower() in ("0", "false", ""):
        del os.environ[GATHER_V2_ENV]
    value = os.environ.setdefault(COMBINE_ALL_REDUCES_ENV, _SAFE_VALUE)
    if value.strip().lower() not in ("0", "false"):
        warnings.warn(
            f"{COMBINE_ALL_REDUCES_ENV}={value!r} is set in the environment: DTensor will combine "
            "all-reduces, which makes data-parallel optimizer updates in train steps written the "
            "usual way differ from single-device training (silently wrong losses), and has failed "
            "to compile some steps ('operand does not dominate this use'). dtk's own steps isolate "
            "their update and stay correct (about 6-9% faster on the MNIST MLP). Unset it or set "
            "it to 0 unless you accept that.",
            RuntimeWarning,
            stacklevel=3,
        )


# glibc's malloc: large blocks always mmapped (returned to the system when freed), two arenas.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX")
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt() parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 256 << 10
ARENA_MAX = 2
# Models whose weights take at least this much per device get those settings (build_model).
LARGE_MODEL_BYTES_PER_DEVICE = 32 << 20


def apply_malloc_defaults() -> bool:
    """Makes glibc give large freed blocks back to the system; returns whether it applied.

    By default glibc raises its mmap threshold to the size of each large block freed (up to 32
    MiB), after which blocks of that size come from its heaps, and freed ones stay resident for
    reuse, one heap per thread group. TensorFlow's CPU tensors are such blocks: a training
    client's resident memory then holds every size of weight, gradient and optimizer temporary
    it ever freed. Measured (issue 24's LM, 772.7 MiB of weights, 4 clients x 2 CPUs,
    ``batch=1,model=8``): peak RSS per client 2,588 MiB by default, 1,985 MiB with a fixed
    threshold of 256 KiB, 1,952 MiB with two arenas as well (a 4 MiB threshold: 2,217 MiB, since
    activations and shards of 0.25-4 MiB then stay in the heaps).

    It costs time where blocks are small and steps short (each block of 256 KiB or more is then
    mapped and faulted in anew): the LM of dim 128 on ``batch=8`` went from 391 to 559 ms/step.
    So ``build_model`` applies it only to models whose weights take
    ``LARGE_MODEL_BYTES_PER_DEVICE`` or more per device, where memory is what limits the run and
    steps take seconds. A user who sets glibc's own variables
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``) keeps them. Not glibc: nothing happens.
    """
    if any(name in os.environ for name in MALLOC_ENV):
        return False
    try:
        import ctypes  # pylint: disable=import-outside-toplevel
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_ARENA_MAX, ARENA_MAX))


def combine_all_reduces_disabled() -> bool:
    """True when the all-reduce combining optimization is off in this process."""
    return os.environ.get(COMBINE_ALL_REDUCES_ENV, "1").strip().lower() in ("0", "false")


# -- dtk's own environment variables: named and validated here, read nowhere else ------------------
VIRTUAL_DEVICES = "DTK_VIRTUAL_DEVICES"        # CPU: logical devices per client (set by launchers)
READY_FILE = "DTK_READY_FILE"                  # written once this client's mesh exists (dtk.cluster.launch)
REGISTER_TIMEOUT_S = "DTK_REGISTER_TIMEOUT_S"  # multi-client start-up deadline
HEARTBEAT_TIMEOUT_S = "DTK_HEARTBEAT_TIMEOUT_S"  # a silent client fails the others after this
PORT_BASE = "DTK_PORT_BASE"                    # Slurm: first port of a node's clients
LAYOUTS_DIR = "DTK_LAYOUTS_DIR"                # extra directory of user layout tables
OFFLINE = "DTK_OFFLINE"                        # 1: never try the network (TFDS)
BLAMED_FILE = "DTK_BLAME_FILE"                 # a client writes here which client it lost
GRAPPLER = "DTK_GRAPPLER"                      # 1: keep Grappler's meta optimizer on CPU meshes
PLAN_CACHE = "DTK_PLAN_CACHE"                  # the planner's calibration file (dtk.planning.planner)

DTK_VARIABLES = (VIRTUAL_DEVICES, READY_FILE, REGISTER_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, PORT_BASE,
                 LAYOUTS_DIR, OFFLINE, BLAMED_FILE, GRAPPLER, PLAN_CACHE)


def get_str(name: str) -> str | None:
    """The variable's value stripped, or None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def get_int(name: str, default: int | None = None, *, minimum: int = 1) -> int | None:
    """An integer variable; ``default`` when unset.

    Raises:
      ValueError: the value is not an integer >= ``minimum``, naming the variable and the fix.
    """
    raw = get_str(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to an integer >= {minimum} "
                         "or unset it") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}; set it to an integer >= {minimum} "
                         "or unset it")
    return value


def get_seconds(name: str, default: float) -> float:
    """A positive number of seconds; ``default`` when unset.

    Raises:
      ValueError: not a positive number.
    """
    raw = get_str(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds; set e.g. {name}=30 or "
                         "unset it") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}={raw!r} must be a positive, finite number of seconds")
    return value


def get_flag(name: str) -> bool:
    """True for 1/true/yes/on, False when unset or 0/false/no/off.

    Raises:
      ValueError: any other value.
    """
    raw = (get_str(name) or "0").lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0")


# TensorFlow's C++ logging: what dtk's entry points and the workers it starts hide by default.
# Level 3 hides C++ ERROR lines too: on a model-parallel graph Grappler's cost estimator writes
# "Incompatible Matrix dimensions" (harmless) on every trace, and a multi-client run's clients
# write "Failed to send RPC to coordination service" while the lead shuts down. dtk reports real
# failures as Python exceptions (one ``error:`` line), which this does not touch.
_QUIET_TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "GRPC_VERBOSITY": "ERROR"}


def quiet_tensorflow_env() -> dict[str, str]:
    """The variables that hide TensorFlow's C++ log lines; a value the user set is kept."""
    return {name: os.environ.get(name, value) for name, value in _QUIET_TF_ENV.items()}


KNOWN = (VIRTUAL_DEVICES, READY_FILE, REGISTER_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, PORT_BASE,
         LAYOUTS_DIR, OFFLINE, BLAMED_FILE, GRAPPLER, PLAN_CACHE)
# Read by dtk's benchmark scripts and test suite, not by the library: known, not suggested.
TOOL_NAMES = ("DTK_BENCH_DEVICE", "DTK_REQUIRE_FULL_MNIST", "DTK_FAST_TEST_BUDGET_S")


def unknown_names() -> list[str]:
    """One line for each ``DTK_*`` variable set in the environment that dtk does not know (a
    misspelling such as ``DTK_PLAN_CACH`` would otherwise be ignored), with the closest name."""
    import difflib  # pylint: disable=g-import-not-at-top
    lines = []
    for name in sorted(n for n in os.environ
                       if n.startswith("DTK_") and n not in KNOWN and n not in TOOL_NAMES):
        near = difflib.get_close_matches(name[4:], [k[4:] for k in KNOWN], n=1, cutoff=0.7)
        hint = f"did you mean DTK_{near[0]}?" if near else f"dtk reads {', '.join(KNOWN)}"
        lines.append(f"{name} is set but dtk reads no such variable ({hint})")
    return lines


def check_all(*, warn_unknown: bool = True) -> None:
    """Validates every ``DTK_*`` variable that is set, whether this run reads it or not, so a
    malformed value is one error at start-up, never ignored on the paths that skip it; warns
    about a ``DTK_*`` name dtk does not know (``unknown_names``).

    Raises:
      ValueError: naming the variable, its value and the fix.
    """
    for line in unknown_names() if warn_unknown else ():
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    get_int(VIRTUAL_DEVICES)
    get_seconds(REGISTER_TIMEOUT_S, 1.0)
    get_seconds(HEARTBEAT_TIMEOUT_S, 1.0)
    port = get_int(PORT_BASE)
    if port is not None and port > 65535:
        raise ValueError(f"{PORT_BASE}={port} is not a TCP port; set 1024-65535 or unset it")
    get_flag(OFFLINE)
    get_flag(GRAPPLER)
    for name in (PLAN_CACHE, BLAMED_FILE, READY_FILE):  # files dtk writes: checked up front
        path = get_str(name)
        problem = path and path_problem(path, kind="file")
        if problem:
            raise ValueError(f"{name}={problem}, or unset it")
    if get_str(PLAN_CACHE):
        _check_plan_cache(os.path.abspath(os.path.expanduser(get_str(PLAN_CACHE))))
    for directory in (get_str(LAYOUTS_DIR) or "").split(":"):
        if directory and not os.path.isdir(directory):
            raise ValueError(f"{LAYOUTS_DIR}={get_str(LAYOUTS_DIR)!r}: {directory!r} is not a "
                             "directory; give directories of .toml tables separated by ':', or "
                             "unset it")


def path_problem(path: str, *, kind: str) -> str | None:
    """Why ``path`` cannot be written as a file (``kind="file"``) or a directory
    (``kind="dir"``), with the fix; None when it can (it exists, or can be created with every
    missing parent).

    The check creates and removes a probe directory in the nearest existing ancestor rather than
    reading permission bits: root passes every ``os.access`` test, and ``/proc`` or a read-only
    mount say "writable" by their bits, yet refuse a write. A dangling symbolic link or a link
    loop is named as such.
    """
    import tempfile  # pylint: disable=g-import-not-at-top
    if kind not in ("dir", "file"):
        raise ValueError(f"kind must be 'dir' or 'file'; got {kind!r}")
    trailing_slash = path.endswith(os.sep)
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.islink(path) and not os.path.exists(path):
        return (f"{path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist (or "
                "is a link loop); remove the link or give another path")
    if kind == "file":
        if os.path.isdir(path) or trailing_slash:
            return (f"{path!r} is a directory; give a file path, e.g. "
                    f"{os.path.join(path, 'summary.json')}")
        directory = os.path.dirname(path)
    else:
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{path!r} is a file; give a directory"
        directory = path
    ancestor = directory
    while not os.path.exists(ancestor):
        if os.path.islink(ancestor):  # a dangling link or a loop on the way: nothing below it
            return (f"{path!r} cannot be created: {ancestor!r} is a symbolic link to "
                    f"{os.readlink(ancestor)!r}, which does not exist (or is a link loop); "
                    "remove the link or give another path")
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return (f"{path!r} cannot be created: {ancestor!r} is a file, where a directory should "
                "be; give another path")
    try:
        probe = tempfile.mkdtemp(prefix=".dtk-write-check-", dir=ancestor)
        os.rmdir(probe)
    except OSError as e:
        return (f"{path!r} is not writable: creating an entry in {ancestor!r} failed "
                f"({os.strerror(e.errno) if e.errno else e}); give a writable path")
    if kind == "file" and os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path!r} is not writable; give a writable path"
    return None


# Keys of the planner's cache file (dtk.planning.planner): what makes a file dtk's own.
PLAN_CACHE_KEY_PREFIXES = ("machine/", "step/", "keras-step/")


def _check_plan_cache(path: str) -> None:
    """The plan cache must be dtk's (or new): the planner rewrites the whole file."""
    import json  # pylint: disable=g-import-not-at-top
    if os.path.isfile(path) and os.path.getsize(path):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not all(
                isinstance(k, str) and k.startswith(PLAN_CACHE_KEY_PREFIXES) for k in data):
            raise ValueError(
                f"{PLAN_CACHE}={path!r} is an existing file that is not dtk's plan cache; the "
                "planner would overwrite it. Point it to a new file (or dtk's own cache), or "
                "unset it for the default ~/.cache/dtk/plan.json")


def import_tensorflow_quietly(*, always: bool = False) -> None:
    """Imports TensorFlow with its load-time C++ lines hidden (command-line tools, not verbose,
    and dtk's library packages when dtk was imported first), unless the user set
    ``TF_CPP_MIN_LOG_LEVEL`` (``always``: even then, for the command-line tools).

    TensorFlow writes a few lines while it loads (oneDNN, CPU features, CUDA stubs) before its log
    level applies, so ``TF_CPP_MIN_LOG_LEVEL`` alone does not hide them: stderr is closed for the
    import. Errors of the import itself are still raised.
    """
    if "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with quiet_stderr(always=always):
        import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
