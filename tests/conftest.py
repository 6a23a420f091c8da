"""Every test process gets 8 virtual CPUs, configured before TensorFlow initializes its devices.

dtk is imported first so its DTensor settings are in force before anything is traced.
"""

import gc
import inspect
import os
import re
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
FULL_MNIST = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mnist"

import dtk  # noqa: E402  (sets DTensor's parity-safe environment before TensorFlow loads)
import tensorflow as tf  # noqa: E402

NUM_VIRTUAL_CPUS = 8

dtk.configure_virtual_cpus(NUM_VIRTUAL_CPUS)
# dtk turns Grappler's meta optimizer off when it builds a CPU mesh (dtk/parallel/mesh.py: it took half of
# DTensor's first step; MobileNetV2 on batch=8: 39.5 s with it, 18.6 s without). The test process
# turns it off from the start, so the plain single-device references computed before any mesh
# exists run the same way. DTK_GRAPPLER=1 keeps it on (for dtk and here).
if os.environ.get("DTK_GRAPPLER", "").strip().lower() not in ("1", "true", "yes", "on"):
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
# Initialize now, so every test sees the same 8 devices whatever runs first.
assert len(tf.config.list_logical_devices("CPU")) == NUM_VIRTUAL_CPUS


# Tests that start TensorFlow processes (clients, scripts, Ray workers) run on one pytest-xdist
# worker (``-n 2`` in setup.cfg), one at a time, so that at most 4 TensorFlow processes run at
# once: that worker, its test's 2 clients, and the other worker. A test starts processes when its
# body, a fixture it uses, or a helper of its module that they call (transitively) mentions
# ``procs.`` or ``subprocess``; the other tests of a module spread over both workers.
_SPAWNS = re.compile(r"\bprocs\.|\bsubprocess\b")


def _spawning_names(module) -> set[str]:
    """Names of the module's functions that start processes, directly or through each other."""
    sources = {}
    for name, obj in vars(module).items():
        target = getattr(obj, "__wrapped__", obj)
        if inspect.isfunction(target) and target.__module__ == module.__name__:
            try:
                sources[name] = inspect.getsource(target)
            except (OSError, TypeError):
                pass
    spawning = {n for n, src in sources.items() if _SPAWNS.search(src.split(":", 1)[-1])}
    changed = True
    while changed:
        changed = False
        for name, src in sources.items():
            if name not in spawning and any(re.search(rf"\b{re.escape(s)}\b", src)
                                            for s in spawning):
                spawning.add(name)
                changed = True
    return spawning


def _shares_work(item) -> bool:
    """Whether ``item`` reuses work its module keeps between tests: a module-scoped fixture it
    uses, or a memoized helper of the module (``functools.lru_cache``, such as a one-device
    reference run). Such work is done once per worker process, so the module's tests run on one
    worker (each worker computed the references the tests it got needed, many of them twice)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d.scope == "module" for fixture in defs.values() for d in fixture):
        return True
    return any(hasattr(obj, "cache_info") and getattr(obj, "__module__", None) == item.module.__name__
               for obj in vars(item.module).values())  # its own helpers, not an imported one


def _starts_processes(item, cache: dict) -> bool:
    module = item.module
    if module not in cache:
        cache[module] = _spawning_names(module)
    names = {item.function.__name__, *item.fixturenames}
    return bool(names & cache[module])


# The time budget of a test in the fast lane (not marked slow): over it, the run reports the test
# (a warning, never a failure: a busy machine is not a defect of the code; speed targets live in
# scripts/bench*.py).
FAST_TEST_BUDGET_S = float(os.environ.get("DTK_FAST_TEST_BUDGET_S", "20"))
_over_budget: list[tuple[str, float]] = []


@pytest.hookimpl(tryfirst=True)
def _join_group(item, name: str, config) -> None:
    """Puts ``item`` in pytest-xdist group ``name`` (``--dist loadgroup``: one worker runs them).

    pytest-xdist marks a group by appending ``@name`` to the test's id, through ``item._nodeid``,
    which pytest 9 no longer reads (ids live in ``item._id``): its groups were silently ignored
    and the process-starting tests ran on both workers at once. The suffix is set here too.
    """
    item.add_marker(pytest.mark.xdist_group(name))
    if getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers
        if "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id  # pylint: disable=g-import-not-at-top
            item._id = coerce_node_id(f"{item.nodeid}@{name}")  # pylint: disable=protected-access


def pytest_collection_finish(session):
    """Freezes what importing TensorFlow, tf_keras, dtk and the test modules made (about 380,000
    objects, alive until the worker exits): Python's full collections, which run every few
    hundred thousand allocations, then no longer walk them (tests/test_keras_io.py in one
    process: 7.0 against 4.7 s of collections)."""
    del session
    gc.collect()
    gc.freeze()


# The smoke lane (``pytest -m smoke``, about 2 minutes on 2 cores): meshes, layout tables, the
# import layers, the model styles (their fast tests), and one parity test each for dtk.distribute's
# custom loop, the optimizer against an independent reference, and Keras 3's distribution.
SMOKE_FILES = ("tests/test_mesh.py::", "tests/test_layouts.py::", "tests/test_architecture.py::",
               "tests/test_model_styles.py::")
SMOKE_TESTS = (
    "tests/test_user_keras_code.py::test_the_guides_custom_loop_runs_with_one_change_and_keras_"
    "numbers[batch=8]",
    "tests/test_references.py::test_distributed_adamw_with_ema_equals_plain_tf_keras",
    "tests/test_keras3.py::test_the_guides_data_parallel_equals_plain_keras",
    "tests/test_keras3.py::test_dtk_distribute_takes_a_keras3_factory_and_equals_plain_keras"
    "[batch=4,model=2]",
)


def pytest_collection_modifyitems(config, items):
    """Groups the process-starting tests (see _starts_processes); skips or requires the tests
    marked ``full_mnist``, which need the real MNIST files beside the checkout.

    In a user's fresh clone they skip with the reason; in CI (``DTK_REQUIRE_FULL_MNIST=1``) the
    files must be there, so a skip cannot hide a missing accuracy check.
    """
    cache: dict = {}
    for item in items:
        if item.nodeid.startswith(SMOKE_TESTS) or (item.nodeid.startswith(SMOKE_FILES) and
                                                  item.get_closest_marker("slow") is None):
            item.add_marker(pytest.mark.smoke)
    for item in items:
        if _starts_processes(item, cache):
            _join_group(item, "processes", config)
        elif _shares_work(item):
            _join_group(item, item.module.__name__.rsplit(".", 1)[-1], config)
    # The longest first: the release lane's, then the other slow tests, then the rest (a stable
    # sort: file order within each). pytest-xdist hands the workers groups and tests in this order
    # (--no-loadscope-reorder in setup.cfg: sorted by a group's test count, the 107 quick rows of
    # the layer table went first and the application tests later, beside the heaviest process
    # tests: 1,891.6 s against 1,726.6 s in this order), so the suite ends on short tests. In file order the 193 s
    # DenseNet121 test ran last, alone: the suite took 1.10-1.12x half the per-test sum (the
    # perfect packing of 2 workers), against 1.01x in this order (issue 39, BUILD.md "Test budget").
    items.sort(key=lambda item: (item.get_closest_marker("zoo") is None,
                                 item.get_closest_marker("slow") is None))

    if (FULL_MNIST / "t10k-images-idx3-ubyte.gz").exists():
        return
    marked = [item for item in items if item.get_closest_marker("full_mnist")]
    if marked and os.environ.get("DTK_REQUIRE_FULL_MNIST") == "1":
        raise pytest.UsageError(f"{len(marked)} tests need the full MNIST files at {FULL_MNIST}, "
                                "which are missing (DTK_REQUIRE_FULL_MNIST=1)")
    skip = pytest.mark.skip(reason=(
        f"needs MNIST's IDX gz files (t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz and "
        f"the train-* pair) at {FULL_MNIST}, which a fresh clone does not ship; put them there to "
        "run these accuracy checks. The rest of the suite runs on the bundled sample; CI has the "
        "files and fails without them (DTK_REQUIRE_FULL_MNIST=1)"))
    for item in marked:
        item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Records fast-lane tests over FAST_TEST_BUDGET_S (setup + call; runs in the controller
    under xdist too)."""
    if report.when == "call" and "slow" not in report.keywords and \
            report.duration > FAST_TEST_BUDGET_S:
        _over_budget.append((report.nodeid, report.duration))


def pytest_sessionfinish(session, exitstatus):
    """Reports fast-lane tests over budget (mark them slow, or make them faster); the exit status
    is left as it is: timing is measured, never asserted (issue 39)."""
    del exitstatus
    if _over_budget and not hasattr(session.config, "workerinput"):
        lines = "\n".join(f"  {t:.1f} s  {n}" for n, t in _over_budget)
        print(f"\nwarning: tests not marked slow took more than {FAST_TEST_BUDGET_S:.0f} s "
              "(BUILD.md, 'Test budget'; a loaded machine can cause it); if they do on an idle "
              f"machine, mark them @pytest.mark.slow or make them faster:\n{lines}")


@pytest.fixture(autouse=True)
def _eager_executor_cleared(request):
    """A DTensor op that fails at run time poisons the eager executor ("This error cancels all
    future operations and poisons their output tensors") until the error is cleared. A test that
    provokes such a failure on purpose (and checks dtk's message for it) must not fail the tests
    that run after it in the same worker: the whole suite once failed 14 unrelated tests that way
    ("Unable to copy tensor value for broadcast" at the next model's first variable).

    Clearing the context's error is not always enough: twice in 4 runs at stop 77 a worker's
    DTensor device stayed unusable (the same "Unable to copy tensor value for broadcast" at every
    later test's first variable, 21-24 tests, after tests that all passed; not reproduced alone
    or in order). So the device is probed after each test (a scalar copied to an 8-device mesh),
    and one found unusable is replaced with a fresh one, with a warning that names the test after
    which it was found (pytest's warnings summary): never silent, and no later test fails for
    it."""
    yield
    tf.experimental.async_clear_error()
    if not _dtensor_device_usable():
        warnings.warn(f"DTensor's device was unusable after {request.node.nodeid}; "
                      "tests/conftest.py reset it (see _eager_executor_cleared)")
        tf.experimental.dtensor._reset_dtensor_device(is_async=True)  # pylint: disable=protected-access
        tf.experimental.async_clear_error()
        for _ in range(3):  # the next function call re-raises the old error once: take it here
            if _dtensor_device_usable(function=True):
                break


_PROBE_MESH = []


@tf.function
def _add_one(x):
    return x + 1.0


def _dtensor_device_usable(function: bool = False) -> bool:
    """Whether a scalar copies to an 8-device mesh and back (the first step of every variable),
    and (``function``) whether a function runs on it."""
    from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
    try:
        if not _PROBE_MESH:
            _PROBE_MESH.append(dtk.build_mesh("batch=8"))
        value = dtensor.copy_to_mesh(tf.constant(1.0),
                                     dtensor.Layout.replicated(_PROBE_MESH[0], 0))
        if function:
            return float(_add_one(value)) == 2.0
        return float(value) == 1.0
    except Exception:  # pylint: disable=broad-except
        tf.experimental.async_clear_error()
        return False

