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


# Modules whose tests start TensorFlow processes (clients, scripts, Ray workers). Under
# pytest-xdist (``-n 2`` in setup.cfg) they run on one worker, one at a time, so that at most 4
# TensorFlow processes run at once: that worker, its test's 2 clients, and the other worker.
PROCESS_MODULES = {"test_launch", "test_ray", "test_cluster", "test_train_mnist", "test_lm",
                   "test_checkpoint_faults", "test_bad_inputs", "test_mesh", "test_input",
                   "test_steps", "test_cli", "test_entry_points"}

# The time budget of a test in the fast lane (not marked slow): over it, the run fails.
FAST_TEST_BUDGET_S = float(os.environ.get("DTK_FAST_TEST_BUDGET_S", "20"))
_over_budget: list[tuple[str, float]] = []


def pytest_collection_modifyitems(config, items):
    """Groups the process-starting tests (see PROCESS_MODULES); skips or requires the tests
    marked ``full_mnist``, which need the real MNIST files beside the checkout.

    In a user's fresh clone they skip with the reason; in CI (``DTK_REQUIRE_FULL_MNIST=1``) the
    files must be there, so a skip cannot hide a missing accuracy check.
    """
    del config
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))
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


def pytest_runtest_logreport(report):
    """Records fast-lane tests over FAST_TEST_BUDGET_S (setup + call; runs in the controller
    under xdist too)."""
    if report.when == "call" and "slow" not in report.keywords and \
            report.duration > FAST_TEST_BUDGET_S:
        _over_budget.append((report.nodeid, report.duration))


def pytest_sessionfinish(session, exitstatus):
    """A fast-lane test over budget fails the run: mark it slow, or make it faster."""
    del exitstatus
    if _over_budget and not hasattr(session.config, "workerinput"):
        lines = "\n".join(f"  {t:.1f} s  {n}" for n, t in _over_budget)
        print(f"\nerror: tests not marked slow took more than {FAST_TEST_BUDGET_S:.0f} s (BUILD.md, "
              f"'Test budget'); mark them @pytest.mark.slow or make them faster:\n{lines}")
        session.exitstatus = 1
