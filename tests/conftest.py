"""Every test process gets 8 virtual CPUs, configured before TensorFlow initializes its devices.

dtk is imported first so its DTensor settings are in force before anything is traced.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
FULL_MNIST = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mnist"

import dtk  # noqa: E402  (sets DTensor's parity-safe environment before TensorFlow loads)
import tensorflow as tf  # noqa: E402

NUM_VIRTUAL_CPUS = 8

dtk.configure_virtual_cpus(NUM_VIRTUAL_CPUS)
# Initialize now, so every test sees the same 8 devices whatever runs first.
assert len(tf.config.list_logical_devices("CPU")) == NUM_VIRTUAL_CPUS


def pytest_collection_modifyitems(config, items):
    """Tests marked ``full_mnist`` need the real MNIST files beside the checkout.

    In a user's fresh clone they skip with the reason; in CI (``DTK_REQUIRE_FULL_MNIST=1``) the
    files must be there, so a skip cannot hide a missing accuracy check.
    """
    del config
    if (FULL_MNIST / "t10k-images-idx3-ubyte.gz").exists():
        return
    marked = [item for item in items if item.get_closest_marker("full_mnist")]
    if marked and os.environ.get("DTK_REQUIRE_FULL_MNIST") == "1":
        raise pytest.UsageError(f"{len(marked)} tests need the full MNIST files at {FULL_MNIST}, "
                                "which are missing (DTK_REQUIRE_FULL_MNIST=1)")
    skip = pytest.mark.skip(reason=f"needs the full MNIST IDX files at {FULL_MNIST} (not in a "
                                   "fresh clone); the rest of the suite runs on the bundled sample")
    for item in marked:
        item.add_marker(skip)
