"""``dtk-env``: what a bug report about dtk needs, in one paste.

    dtk-env                 # versions, devices, the DTensor settings dtk makes, DTK_* variables
    python -m dtk.env_cli

Prints the versions of dtk and the stack it runs on (Python, TensorFlow, tf_keras, Keras 3,
NumPy, Ray if installed), the devices TensorFlow sees, the DTensor and TensorFlow settings that
dtk makes unless you set them (and which of them you set), the ``DTK_*`` variables in the
environment, where the layout tables and the planner's calibration cache are. Nothing is built
or trained; TensorFlow is loaded to list the devices.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence

from dtk import usage


def _version(module: str) -> str:
    import importlib.metadata  # pylint: disable=g-import-not-at-top
    for dist in {"tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly"),
                 "tf_keras": ("tf-keras",), "absl": ("absl-py",),
                 "ray": ("ray",)}.get(module, (module,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def report() -> str:
    """The report's text (``dtk-env`` prints it)."""
    from dtk import _env  # pylint: disable=g-import-not-at-top
    from dtk._version import __version__  # pylint: disable=g-import-not-at-top
    given = {k: v for k, v in os.environ.items() if k in _env.USER_SET}  # not dtk's defaults
    lines = [f"dtk {__version__} ({os.path.dirname(os.path.abspath(__file__))})",
             f"python {platform.python_version()} ({sys.executable}), {platform.platform()}"]
    lines.append("packages: " + ", ".join(
        f"{name} {_version(name)}" for name in ("tensorflow", "tf_keras", "keras", "numpy",
                                                 "absl", "ray")) +
        ("" if _version("ray") != "not installed" else " (Ray: dtk's ray extra)"))
    settings = [  # what dtk sets unless the user did, and why
        (_env.GATHER_V2_ENV, "1", "DTensor's gathers as collective gathers (parity-safe)"),
        (_env.COMBINE_ALL_REDUCES_ENV, "0", "all-reduces not combined (1 breaks parity)"),
        (_env.GPU_NCCL_ENV, "1", "GPU meshes: NCCL collectives"),
        ("TF_CPP_MIN_LOG_LEVEL", "1 (library), 3 (scripts)", "TensorFlow's C++ log lines"),
        ("TF_USE_LEGACY_KERAS", "1 (scripts)", "tf.keras is tf_keras in dtk's scripts"),
    ]
    lines.append("settings dtk makes unless you set them:")
    for name, value, why in settings:
        mine = f"you set {given[name]!r}" if name in given else f"dtk's {value}"
        lines.append(f"  {name}: {mine}: {why}")
    ours = sorted(k for k in given if k.startswith("DTK_") or k.startswith("DTENSOR_"))
    lines.append("DTK_* and DTENSOR_* set: " + (", ".join(f"{k}={given[k]}" for k in ours)
                                                 if ours else "none"))
    lines.extend(f"  {line}" for line in _env.unknown_names())
    _env.import_tensorflow_quietly(always=True)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    with _env.quiet_stderr(always=True):  # CUDA's probe on a machine without the driver
        kinds = {kind: len(tf.config.list_physical_devices(kind))
                 for kind in ("CPU", "GPU", "TPU")}
    lines.append(f"devices: {os.cpu_count()} CPU cores; TensorFlow sees "
                 + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
                 + (f"; {_env.VIRTUAL_DEVICES}={given[_env.VIRTUAL_DEVICES]} virtual CPUs a "
                    "process" if _env.VIRTUAL_DEVICES in given else
                    "; CPU meshes split the CPU into as many virtual devices as the mesh needs"))
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk.planning import planner  # pylint: disable=g-import-not-at-top
    tables = layouts.available_tables()
    lines.append(f"layout tables: {len(tables)} ({', '.join(tables)})")
    lines.append(f"planner calibration cache: {planner.cache_path()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = usage.ArgumentParser(prog="dtk-env", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
