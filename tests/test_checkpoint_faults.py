"""Checkpoints always recover: damaged newest checkpoints fall back to the newest intact one, storage
faults are found before the first step, and a failed save leaves no partial files behind."""

import contextlib
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

from dtk.train import checkpoint as ckpt_lib
from tests import procs
from tests.test_trainer import _data, _trainer

EPOCHS = 3
STOP_AT = 15  # 6 steps per epoch: checkpoints at steps 6 and 12 (epoch ends) and 15 (max_steps)


@pytest.fixture(scope="module")
def uninterrupted():
    trainer = _trainer()
    history = trainer.fit(_data(trainer.mesh), epochs=EPOCHS)
    return history.history, [w.copy() for w in ckpt_lib.gather_weights(trainer.model)]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """The checkpoints of one run stopped at step 15 (of 18); each test damages a copy."""
    directory = tmp_path_factory.mktemp("stopped")
    trainer = _trainer(checkpoint_dir=str(directory), max_steps=STOP_AT)
    trainer.fit(_data(trainer.mesh), epochs=EPOCHS)
    assert trainer.global_step == STOP_AT
    return directory


def _stopped_run(directory, stopped):
    shutil.copytree(stopped, directory, dirs_exist_ok=True)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(max(1, os.path.getsize(path) // 2))


def _garble(path):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for i in range(0, len(data), 7):
            data[i] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))


def _newest_data(d):
    return glob.glob(str(d / f"ckpt-{STOP_AT}.data-*"))[0]


DAMAGE = {
    "data file truncated": lambda d: _truncate(_newest_data(d)),
    "data file garbled": lambda d: _garble(_newest_data(d)),
    "index truncated": lambda d: _truncate(str(d / f"ckpt-{STOP_AT}.index")),
    "index missing": lambda d: os.remove(d / f"ckpt-{STOP_AT}.index"),
    "state file garbage": lambda d: (d / "checkpoint").write_text("@@@ not a checkpoint state {"),
    "state file empty": lambda d: (d / "checkpoint").write_text(""),
    "state file names a missing checkpoint": lambda d: (d / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-99"\nall_model_checkpoint_paths: "ckpt-99"\n'),
}
# Where each damage makes the run resume from: the newest intact checkpoint.
RESUMES_AT = {"state file garbage": STOP_AT, "state file empty": STOP_AT,
              "state file names a missing checkpoint": STOP_AT}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, damage, uninterrupted, caplog,
                                                            stopped_run):
    _stopped_run(tmp_path, stopped_run)
    DAMAGE[damage](tmp_path)
    trainer = _trainer(checkpoint_dir=str(tmp_path))
    with caplog.at_level("WARNING", logger="dtk"):
        history = trainer.fit(_data(trainer.mesh), epochs=EPOCHS)
    want = RESUMES_AT.get(damage, 12)
    assert trainer.restored_checkpoint.endswith(f"ckpt-{want}")
    if damage in ("state file garbage", "state file empty"):  # one warning, however often listed
        assert caplog.text.count("cannot be read") == 1, caplog.text
    if want != STOP_AT:
        assert f"ckpt-{STOP_AT} is broken and is skipped" in caplog.text
    want_history, want_weights = uninterrupted
    np.testing.assert_allclose(history.history["loss"], want_history["loss"], rtol=1e-6)
    for got, ref in zip(ckpt_lib.gather_weights(trainer.model), want_weights):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, stopped_run):
    _stopped_run(tmp_path, stopped_run)
    for index in glob.glob(str(tmp_path / "*.index")):
        _truncate(index)
    before = sorted(os.listdir(tmp_path))
    trainer = _trainer(checkpoint_dir=str(tmp_path))
    with pytest.raises(ckpt_lib.CheckpointError,
                       match=r"holds 3 checkpoint\(s\) and none can be read.*restart_from_scratch"):
        trainer.fit(_data(trainer.mesh), epochs=EPOCHS)
    assert sorted(os.listdir(tmp_path)) == before  # nothing overwritten
    # Asked for explicitly, a fresh start removes them and trains from step 0.
    fresh = _trainer(checkpoint_dir=str(tmp_path), restart_from_scratch=True, max_steps=6)
    fresh.fit(_data(fresh.mesh), epochs=EPOCHS)
    assert fresh.global_step == 6
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*.index"))) == [
        "ckpt-6.index"]


def test_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ckpt_lib.CheckpointError, match="is a file, not a directory"):
        _trainer(checkpoint_dir=str(path))


@contextlib.contextmanager
def _tmpfs(path, options):
    """A small tmpfs mounted at ``path`` (root only); skips when mounting is not permitted."""
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                         capture_output=True, text=True, timeout=20)
    if res.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here ({res.stderr.strip()[:80]}), so a "
                    "read-only or full disk cannot be simulated; run these tests as root (CI "
                    "does) to check dtk's storage errors")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)


def test_read_only_checkpoint_dir_fails_before_training(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        with pytest.raises(ckpt_lib.CheckpointError, match="is not writable: Read-only file system"):
            _trainer(checkpoint_dir=str(ro / "ckpt"))


def test_full_disk_fails_before_training(tmp_path):
    with _tmpfs(tmp_path / "full", "size=64k") as full:
        with open(full / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"\0" * 1_000_000)
        with pytest.raises(ckpt_lib.CheckpointError, match="is not writable: No space left"):
            _trainer(checkpoint_dir=str(full / "ckpt"))


def test_disk_full_during_save_removes_partial_files(tmp_path):
    """A disk that fills up after start-up: the failed save cleans up and names the cause.

    Runs in its own process: after a failed DTensor save, DTensor's function runtime in that
    process stays cancelled (``async_clear_error`` does not reset it), so the run must stop.
    """
    with _tmpfs(tmp_path / "small", "size=600k") as small:
        code = f"""
import contextlib, glob, os
import tests.conftest
from tests import procs
from tests.test_trainer import _data, _trainer
from dtk.train import checkpoint as ckpt_lib
trainer = _trainer(checkpoint_dir={str(small)!r})

def fill(step):  # after the start-up check (at fit's start), before the epoch's save
    if step == 1:
        with open({str(small / "filler")!r}, "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"\\0" * 10_000_000)
try:
    trainer.fit(_data(trainer.mesh), epochs=1, on_step_end=[fill])
except ckpt_lib.CheckpointError as e:
    print("ERROR", e)
print("LEFT", sorted(glob.glob({str(small)!r} + "/ckpt-6*")))
"""
        res = procs.run_python(code, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ERROR saving checkpoint" in res.stdout and "ckpt-6 failed" in res.stdout, res.stdout
    assert "No space left on device" in res.stdout or "RESOURCE_EXHAUSTED" in res.stdout
    assert "LEFT []" in res.stdout


def test_a_checkpoint_of_another_run_is_never_overwritten_or_resumed_silently(tmp_path):
    """Two runs that got past the lock (here: one process, where the lock is re-entrant): the
    first one's next save finds the other run's newer checkpoint and refuses, naming both runs."""
    first = _trainer(checkpoint_dir=str(tmp_path), max_steps=6)
    first.fit(_data(first.mesh), epochs=1)
    # the first run, still writing (one that got past the lock): it continues its own id
    writer = ckpt_lib.Checkpointer(str(tmp_path), model=first.model, optimizer=first.optimizer)
    writer.restore()
    other = _trainer(checkpoint_dir=str(tmp_path), restart_from_scratch=True, max_steps=12)
    other.fit(_data(other.mesh), epochs=2)
    assert other.run_id != first.run_id
    assert ckpt_lib.run_id_of(str(tmp_path / "ckpt-12")) == other.run_id
    with pytest.raises(ckpt_lib.CheckpointError,
                       match=rf"holds ckpt-12, written by another run \(run {other.run_id}\) while "
                             rf"this run \(run {first.run_id}\)"):
        writer.save({}, step=7)
    writer.close()
    assert not glob.glob(str(tmp_path / "ckpt-7*"))
    # A resumed run continues the id of the run it resumes.
    again = _trainer(checkpoint_dir=str(tmp_path))
    again.fit(_data(again.mesh), epochs=2)
    assert again.run_id == other.run_id
