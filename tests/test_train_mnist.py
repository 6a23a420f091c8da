"""scripts/train_mnist.py end to end, in subprocesses on 8 virtual CPUs, on the real offline MNIST."""

import re
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import procs

SCRIPT = str(procs.REPO / "scripts" / "train_mnist.py")
DATA = str(procs.REPO.parent / "shared" / "data" / "mnist")
TIMEOUT = 240
pytestmark = [pytest.mark.slow, pytest.mark.full_mnist]


def _run(*flags, timeout=TIMEOUT, env=None):
    return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                          timeout=timeout, env=env or procs.base_env(), cwd=procs.REPO)


def _train(tmp_path, name, *flags):
    """Runs a short training on the IDX files; returns the summary JSON."""
    summary = tmp_path / f"{name}.json"
    res = _run("--dataset", "idx", "--data_dir", DATA, "--summary_json", str(summary), *flags)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(summary.read_text()), res.stdout


@pytest.fixture(scope="module")
def batch8(tmp_path_factory):
    """One run shared by several tests: 2 epochs cut short at 30 steps (epoch 2 is partial)."""
    tmp = tmp_path_factory.mktemp("batch8")
    return _train(tmp, "batch8", "--mesh", "batch=8", "--epochs", "2", "--max_steps", "30",
                  "--global_batch_size", "256", "--export_dir", str(tmp / "export"))


def test_summary_fields_and_output(batch8):
    summary, out = batch8
    for key in ("mesh", "device_type", "num_clients", "model", "epochs", "global_batch_size",
                "steps", "train_loss", "train_accuracy", "test_loss", "test_accuracy",
                "test_examples", "ms_per_step_median", "first_step_s", "wall_s", "versions"):
        assert key in summary, key
    assert summary["mesh"] == "batch=8" and summary["device_type"] == "CPU"
    assert summary["num_clients"] == 1 and summary["steps"] == 30
    assert summary["test_examples"] == 10_000          # every test example counted
    assert summary["train_dropped_per_epoch"] == 24_345 % 256
    assert len(summary["train_loss"]) == 1             # 30 steps < 95 steps per epoch
    assert summary["test_accuracy"] > 0.8              # 30 Adam steps on real data
    assert 0 < summary["ms_per_step_median"] < 1000 * summary["first_step_s"]  # tracing is slow
    assert 0 < summary["first_step_s"] < summary["wall_s"]
    assert set(summary["versions"]) >= {"dtk", "tensorflow", "tf_keras"}
    assert "mesh batch=8: 8 CPU devices" in out
    assert "Training drops 25 of 24345 examples" in out
    assert "test accuracy" in out


@pytest.mark.parametrize("mesh, extra", [  # the in-process parity suite covers the rest
    ("batch=1", []),
    ("batch=4,model=2", ["--layout", "mlp_model_parallel", "--shard_optimizer_state"])])
def test_losses_match_across_meshes(tmp_path, batch8, mesh, extra):
    flags = ["--mesh", mesh, "--epochs", "2", "--max_steps", "30", "--global_batch_size", "256",
             *extra]
    summary, _ = _train(tmp_path, "other", *flags)
    want = batch8[0]
    np.testing.assert_allclose(summary["train_loss"], want["train_loss"], rtol=1e-4)
    np.testing.assert_allclose(summary["test_loss"], want["test_loss"], rtol=1e-4)
    assert summary["test_examples"] == 10_000


def test_export_matches_run(batch8):
    summary, _ = batch8
    export_dir = summary["export"]["keras"]
    code = f"""
import numpy as np, tf_keras
from dtk.data import mnist
data = mnist.load_mnist("test", source="idx", data_dir={DATA!r}).batch(1000)
model = tf_keras.models.load_model({export_dir!r})
model.compile(metrics=["sparse_categorical_accuracy"],
              loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
loss, acc = model.evaluate(data, verbose=0)
print("RESULT", loss, acc)
"""
    res = procs.run_python(code, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    loss, acc = map(float, res.stdout.split("RESULT")[1].split())
    assert acc == pytest.approx(summary["test_accuracy"], abs=1e-6)
    assert loss == pytest.approx(summary["test_loss"], rel=1e-5)


def test_explain_layouts_prints_and_exits():
    res = _run("--mesh", "batch=4,model=2", "--layout", "mlp_model_parallel", "--explain_layouts",
               "--dataset", "idx", "--data_dir", DATA, "--device_memory_gb", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "d1.kernel" in res.stdout and "model" in res.stdout
    # issue 70: with a budget, whether the plan fits it, and the arithmetic
    assert re.search(r"memory budget: weights .* \+ optimizer state .* = .* per device: fits the "
                     r"budget of 1\.0 GiB", res.stdout), res.stdout[-1000:]


def test_offline_tfds_fails_in_one_line(tmp_path):
    res = _run("--mesh", "batch=8", "--dataset", "tfds", "--data_dir", str(tmp_path), timeout=120,
               env=procs.base_env(DTK_OFFLINE="1"))
    assert res.returncode != 0
    lines = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "--dataset idx --data_dir" in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.zoo  # 28 s; every run covers the kill in a save across clients (test_launch.py)
def test_killed_run_resumes(tmp_path):
    """Kill the run (SIGKILL) once its epoch-1 checkpoint exists, re-run: same result."""
    import signal
    import time
    ckpt = tmp_path / "ckpt"
    base = ["--mesh", "batch=8", "--epochs", "2", "--global_batch_size", "256"]
    data = ["--dataset", "idx", "--data_dir", DATA]
    proc = subprocess.Popen([sys.executable, SCRIPT, *base, *data, "--checkpoint_dir", str(ckpt)],
                            env=procs.base_env(),
                            cwd=procs.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (ckpt / "checkpoint").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    resumed, out = _train(tmp_path, "resumed", *base, "--checkpoint_dir", str(ckpt))
    assert "Resumed from" in out
    full, _ = _train(tmp_path, "full", *base)
    assert resumed["steps"] == full["steps"] == 2 * 95
    np.testing.assert_allclose(resumed["train_loss"], full["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(resumed["test_loss"], full["test_loss"], rtol=1e-5)


def test_mixed_precision_trains(tmp_path, batch8):
    summary, _ = _train(tmp_path, "bf16", "--mesh", "batch=8", "--epochs", "2", "--max_steps", "30",
                        "--global_batch_size", "256", "--mixed_precision")
    np.testing.assert_allclose(summary["train_loss"], batch8[0]["train_loss"], rtol=5e-2)
    # Within 0.1 of float32's accuracy after the same 30 steps (bfloat16: 0.7989 against
    # 0.8712 here, stop 80; a fixed bar of 0.8 failed by 0.001 in a fresh venv, on 6a8fda4 too).
    assert summary["test_accuracy"] > batch8[0]["test_accuracy"] - 0.1


def test_one_writer_per_directory_and_resume_checks_changed_flags(tmp_path):
    """A run on a directory another live process holds fails before training, naming the holder.
    Resuming with changed flags is one error line listing them; allowed on purpose, the new
    learning rate is used and the summary shows both values. (Two real Trainers colliding:
    tests/test_trainer.py.)"""
    ckpt = tmp_path / "ckpt"
    base = ["--mesh", "batch=8", "--dataset", "sample", "--global_batch_size", "256",
            "--checkpoint_dir", str(ckpt)]
    summary = tmp_path / "first.json"
    res = _run(*base, "--epochs", "2", "--summary_json", str(summary))
    assert res.returncode == 0, res.stderr[-3000:]
    done = json.loads(summary.read_text())

    holder = procs.hold_checkpoint_lock(ckpt, host="h2", run_id="r2")
    try:
        second = _run(*base, "--epochs", "3")
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert second.returncode == 2, second.stderr[-2000:]
    errors = [l for l in second.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "is in use by another run (host h2, pid " \
        f"{holder.pid}," in errors[0], second.stderr[-2000:]
    assert "Traceback" not in second.stderr

    changed = _run(*base, "--epochs", "3", "--seed", "6", "--learning_rate", "0.5")
    assert changed.returncode == 2
    errors = [l for l in changed.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and f"data_seed 0 -> 6; learning_rate {done['learning_rate']} -> " \
        "0.5; seed 0 -> 6" in errors[0] and "--allow_change data_seed,learning_rate,seed" in \
        errors[0], changed.stderr[-2000:]

    summary = tmp_path / "allowed.json"
    res = _run(*base, "--epochs", "3", "--learning_rate", "0.5", "--allow_change",
               "learning_rate", "--summary_json", str(summary))
    assert res.returncode == 0, res.stderr[-3000:]
    allowed = json.loads(summary.read_text())
    assert "taking over the lock left by a run that is no longer running (host h2" in \
        changed.stdout + changed.stderr  # the killed holder's record
    assert "taking over" not in res.stdout + res.stderr  # a run that exits leaves none
    assert allowed["learning_rate"] == 0.5 and allowed["run_id"] == done["run_id"]
    assert allowed["resume_changes"] == {
        "learning_rate": {"old": done["learning_rate"], "new": 0.5}}
    assert allowed["train_loss"][:2] == done["train_loss"]
