"""Checkpoints (save, resume, restore into another mesh) and export to plain Keras / SavedModel.

A dtk checkpoint holds the model's weights, the optimizer's state (slots, iteration count), the
running metric states (so a run stopped mid-epoch resumes with the same epoch averages) and a small
JSON record of the loop's position (epoch, batch in epoch, history). It is a
``tf.train.Checkpoint`` with a small manager of dtk's own:

* Atomic: the data files of a new checkpoint are written and waited for first (DTensor runs ops
  asynchronously: ``tf.train.CheckpointManager`` could record a checkpoint whose files were not
  complete yet, and a kill at that moment left a checkpoint that could not be read); then the
  ``checkpoint`` state file that names the latest one is replaced atomically. A crash mid-save
  leaves the previous checkpoint as the latest, and restore uses it.
* Mesh-independent: values are saved as global tensors, so a checkpoint from ``batch=8`` restores
  into ``batch=4,model=2`` (and into a plain, single-device model).
* Multi-client: every client must call ``save`` with the same shared directory (DTensor writes each
  client's shards); saving from one client only "succeeds" and then fails to restore.
* Recoverable: ``restore`` tries the newest checkpoint and, when it cannot be read (a missing or
  truncated file, a checksum mismatch, an unreadable ``checkpoint`` state file), falls back to the
  next older intact one and logs which one was broken and why. A directory that holds checkpoints
  none of which can be read is an error, never a silent fresh start. Every client reads the same
  files and so picks the same checkpoint.
* Asynchronous (``asynchronous=True``, ``TrainerConfig(async_checkpoints=True)``): a save copies
  each client's own shards of the state to host memory (no gather), and a background thread
  writes them, in the same format, while training goes on. Only once its files are complete (at
  the next save, or when training ends) is the checkpoint recorded as the latest, so an
  interrupted asynchronous save is never resumed from. One save is in flight at a time.
* Storage checked first: the directory is created and test-written when the ``Checkpointer`` is
  made (a path that is a file, a read-only directory, a full disk fail before any step), and a
  save that fails removes its partial files and keeps the previous checkpoint as the latest.

Export: DTensor models cannot be saved as ``.keras`` files, so ``export`` copies the global weights
into a plain twin built by the same model factory, and writes that as a ``.keras`` file and a
SavedModel for serving.
"""

from __future__ import annotations

import atexit
import glob
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor
from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.eager import context
from tensorflow.python.ops import gen_io_ops

from dtk import _env
from dtk.cluster import env as cluster
from dtk.parallel import layouts as layouts_lib
from dtk.parallel import mesh as mesh_lib
from dtk.errors import first_line

_log = logging.getLogger("dtk")
_CKPT_NAME = re.compile(r"ckpt-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint directory cannot be used (unwritable, or no readable checkpoint in it)."""


def check_writable(directory: str) -> None:
    """Creates ``directory`` and writes a test file there, so storage faults surface before training.

    Raises:
      CheckpointError: the path is a file, cannot be created, is read-only, or the disk is full.
    """
    probe = os.path.join(directory, f".dtk-write-test-{os.getpid()}")
    try:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory} is a file, not a directory; "
                                  "give a directory path")
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)  # a full disk fails here, not at the first save
            f.flush()
            os.fsync(f.fileno())
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {directory} is not writable: {e.strerror} "
                              f"({e.__class__.__name__}); fix its permissions or free space, or "
                              "give another directory") from None
    finally:
        if os.path.exists(probe):
            os.remove(probe)


# -- one writer per directory ---------------------------------------------------------------------
_LOCK_FILE = ".dtk-lock"
_HELD: dict[str, list[Any]] = {}  # real path -> [open lock file, holders in this process]


def _holder_text(record: dict[str, Any]) -> str:
    started = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started {when}, "
            f"run {record.get('run_id', '?')}")


def lock_directory(directory: str, *, run_id: str) -> None:
    """Takes the exclusive lock on a checkpoint directory for the life of this process.

    One writer per directory: two runs writing one directory interleave their checkpoints (data
    files of two shard counts, a state file naming the other run's checkpoint) and corrupt each
    other in silence. The lock is an ``flock`` on ``<directory>/.dtk-lock``, which holds the
    holder's host, pid, start time and run id. The kernel drops it when the process dies (even by
    SIGKILL), so a lock left by a dead process is taken over, with one warning naming it.
    Re-entrant within a process (several Trainers of one script may share a directory).

    On a network file system, ``flock`` works across machines where the server supports it
    (Linux NFSv4 maps it to byte-range locks; some FUSE and object-store mounts ignore it):
    there, keep one run per directory by other means.

    Raises:
      CheckpointError: another live process holds the lock (it is named).
    """
    import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only)
    import socket  # pylint: disable=g-import-not-at-top
    key = os.path.realpath(directory)
    if key in _HELD:
        _HELD[key][1] += 1
        return
    path = os.path.join(directory, _LOCK_FILE)
    handle = open(path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "{}")
        except ValueError:
            holder = {}
        handle.close()
        raise CheckpointError(
            f"checkpoint directory {directory} is in use by another run ({_holder_text(holder)}); "
            "two runs writing one directory corrupt each other's checkpoints. Wait for that run "
            "to finish or stop it, or give this run another checkpoint directory") from None
    handle.seek(0)
    try:
        previous = json.loads(handle.read() or "{}")
    except ValueError:
        previous = {"host": "?"}
    if previous:  # a holder that released cleanly leaves an empty record
        _log.warning("checkpoint directory %s: taking over the lock left by a run that is no "
                     "longer running (%s)", directory, _holder_text(previous))
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.time(), "run_id": run_id}))
    handle.flush()
    if not _HELD:
        atexit.register(_release_all)  # a run that ends (even by an error) leaves no record
    _HELD[key] = [handle, 1]


def _release_all() -> None:
    for key in list(_HELD):
        _HELD[key][1] = 1
        unlock_directory(key)


def unlock_directory(directory: str) -> None:
    """Releases this process's hold on ``directory`` (the lock goes with the last holder)."""
    key = os.path.realpath(directory)
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        handle = _HELD.pop(key)[0]
        handle.seek(0)
        handle.truncate()  # an empty record: released cleanly, nothing to take over
        handle.flush()
        handle.close()  # closing drops the flock


def _step_of(path: str) -> int:
    match = _CKPT_NAME.search(path)
    return int(match.group(1)) if match else -1



class _JsonState(tf.train.experimental.PythonState):
    """Loop position and history, saved inside the checkpoint (so both are written atomically)."""

    def __init__(self):
        self.value: dict[str, Any] = {}

    def serialize(self) -> str:
        return json.dumps(self.value)

    def deserialize(self, string_value) -> None:
        raw = string_value.numpy() if hasattr(string_value, "numpy") else string_value
        self.value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)


class Checkpointer:
    """Saves and restores a model, its optimizer, metrics and the loop state under ``directory``.

    Args:
      directory: where checkpoints go (shared by all clients in a multi-client run).
      model: the (laid-out) model.
      optimizer: its optimizer, built (``optimizer.build(vars)``) so slots restore before step one.
      metrics: metric objects whose running state is saved too.
      max_to_keep: how many checkpoints to keep.
      mesh: the model's mesh; in a multi-client run, saves wait at a barrier on it, and client 0
        alone records the checkpoint once every client's shards are written.
      lock: take the directory's lock (``lock_directory``; the lead client holds it for the run).
        With ``mesh`` given in a multi-client run, every client raises when the lead is refused,
        before any step, so the whole group stops at once.
      asynchronous: write checkpoints in a background thread (``save`` returns once the values
        are copied; ``wait`` waits for the write).
      host_write: write through host copies of each client's shards (as ``asynchronous``
        does, then wait), not DTensor's save: needed where the variables live on several
        meshes (a pipeline's stages), which one DTensor save cannot span.
    """

    def __init__(self, directory: str, *, model: tf_keras.Model, optimizer: Any,
                 metrics: Sequence[Any] = (), max_to_keep: int = 3,
                 mesh: dtensor.Mesh | None = None, lock: bool = True,
                 asynchronous: bool = False, host_write: bool = False):
        if not directory:
            raise ValueError("checkpoint directory is empty; give a path")
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1; got {max_to_keep}")
        self.directory = os.fspath(directory)
        check_writable(self.directory)
        # The id of the run that writes here: fresh, or the restored checkpoint's (a resumed run
        # continues the run that wrote it). Recorded in every checkpoint and in the lock.
        self.run_id = uuid.uuid4().hex[:12]
        self._locked = False
        refused = None
        if lock and cluster.is_lead_client():  # the lead holds it for every client of the run
            try:
                lock_directory(self.directory, run_id=self.run_id)
                self._locked = True
            except CheckpointError as e:
                refused = e
        if lock and mesh is not None and cluster.is_multi_client():
            # Every client learns the lead's answer before any step. Otherwise the others would
            # train into the first collective and wait there for the refused lead until the
            # group's exit timeout.
            if mesh_lib.values_on_all_clients(mesh, float(refused is not None))[0] and not refused:
                raise CheckpointError(
                    f"checkpoint directory {self.directory} is in use by another run: client 0 "
                    "found its lock (its error names the holder). Wait for that run to finish or "
                    "stop it, or give this run another checkpoint directory")
        if refused is not None:
            raise refused
        self._state_file_warned = False
        self.restored: str | None = None
        self._mesh = mesh
        self._state = _JsonState()
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                               metrics=list(metrics), loop=self._state)
        _ = self._checkpoint.save_counter  # created now, so every checkpoint holds it
        self.max_to_keep = max_to_keep
        self._paths = [p for p in self.candidates() if os.path.exists(p + ".index")][::-1]
        self.asynchronous = asynchronous
        self.host_write = host_write
        self._pending: tuple[str, threading.Thread, list] | None = None
        self._bookkeeping = threading.Lock()

    @property
    def latest(self) -> str | None:
        """Path prefix of the newest checkpoint on disk (whether readable or not), or None."""
        found = self.candidates()
        return found[0] if found else None

    def _state_file_paths(self) -> list[str] | None:
        """The checkpoints the ``checkpoint`` state file names, newest first; None if unreadable."""
        state_file = os.path.join(self.directory, "checkpoint")
        try:
            state = tf.train.get_checkpoint_state(self.directory)
            problem = None if state is not None or not os.path.exists(state_file) else \
                "it names no checkpoint"
        except Exception as e:  # pylint: disable=broad-except  (garbage, empty: parse errors)
            state, problem = None, first_line(e)
        if problem is not None:
            if not self._state_file_warned:  # once, however often the directory is listed
                self._state_file_warned = True
                _log.warning("checkpoint state file %s cannot be read (%s); looking for "
                             "checkpoints by their files", state_file, problem)
            return None
        if state is None:
            return []
        paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
        return [p if os.path.isabs(p) else os.path.join(self.directory, p)
                for p in reversed(paths) if p]

    def candidates(self) -> list[str]:
        """The checkpoints to resume from, newest (highest step) first.

        Normally those the state file names (a checkpoint it does not name was not finished).
        When the state file is unreadable, or its newest entry has no ``.index`` file, every
        ``ckpt-N`` found on disk is added, so a damaged state file does not hide intact ones.
        """
        named = self._state_file_paths()
        if named and os.path.exists(named[0] + ".index"):
            return sorted(named, key=_step_of, reverse=True)
        paths = set(named or [])
        for f in glob.glob(os.path.join(glob.escape(self.directory), "ckpt-*")):
            prefix = re.sub(r"\.(index|data-\d+-of-\d+)$", "", f)
            if _CKPT_NAME.search(prefix):
                paths.add(prefix)
        return sorted(paths, key=_step_of, reverse=True)

    def save(self, state: dict[str, Any], *, step: int) -> str:
        """Writes checkpoint ``ckpt-<step>`` with the JSON-serializable loop ``state``.

        The data files are written and waited for first (DTensor runs ops asynchronously); only
        then does the ``checkpoint`` file, replaced atomically, name the new checkpoint. Older
        checkpoints beyond ``max_to_keep`` are deleted after that.
        """
        self.wait()  # one save in flight at a time; the loop state below belongs to this one
        self._state.value = {**state, "run_id": self.run_id}
        target = os.path.join(self.directory, f"ckpt-{step}")
        if cluster.is_lead_client():
            self._check_no_other_writer()
        try:
            os.makedirs(self.directory, exist_ok=True)
            if self.asynchronous or self.host_write:
                self._start_async_write(target)
                if self.asynchronous:
                    return target
                return self.wait()
            path = self._checkpoint.write(target)
            context.async_wait()
        except (OSError, tf.errors.OpError) as e:
            self._failed(target, e)
        return self._record(path)

    def _failed(self, target: str, error: Exception) -> NoReturn:
        """Removes a failed save's partial files and raises, naming the cause."""
        _clear_async_error()
        for partial in glob.glob(glob.escape(target) + "*"):
            if os.path.isdir(partial):
                shutil.rmtree(partial, ignore_errors=True)
            else:
                os.remove(partial)
        raise CheckpointError(
            f"saving checkpoint {target} failed: {first_line(error)}; its partial files were "
            f"removed and {self._paths[-1] if self._paths else 'no earlier checkpoint'} stays "
            "the latest. Free space or fix the directory, then re-run to resume") from error

    def _start_async_write(self, target: str) -> None:
        """Copies this client's shards of the state to host memory, then writes them from a
        thread while training goes on.

        The thread runs no TensorFlow collective (those of a DTensor save would interleave with
        the training step's and abort them): it writes the shards with ``SaveV2`` in the
        checkpoint format DTensor itself writes (every shard a slice of the global tensor, each
        written once), and client 0 merges every client's part into ``target``
        (``MergeV2Checkpoints``) once each has said, through the coordination service, that its
        part is written.
        """
        names, slices, values = _host_snapshot(self._checkpoint)
        clients, me = cluster.num_clients(), cluster.client_id()
        parts = [f"{target}_temp/part-{i:05d}-of-{clients:05d}" for i in range(clients)]
        errors: list = []

        def write() -> None:
            try:
                with tf.device("/cpu:0"):
                    gen_io_ops.save_v2(parts[me], names, slices, values)
                    if clients > 1:
                        _posted(f"{target}/{me}")
                    if me == 0:
                        for other in range(1, clients):
                            _wait_posted(f"{target}/{other}")
                        gen_io_ops.merge_v2_checkpoints(parts, target, delete_old_dirs=True)
                        # Recorded as the latest now, not at the next save or the end of the
                        # run: a kill after this point resumes from it.
                        self._bookkeep(target)
            except Exception as e:  # pylint: disable=broad-except  (raised by wait())
                errors.append(e)

        thread = threading.Thread(target=write, name=f"dtk-save-{os.path.basename(target)}",
                                  daemon=True)
        thread.start()
        self._pending = (target, thread, errors)

    @property
    def saving(self) -> bool:
        """True while an asynchronous save is being written."""
        return self._pending is not None and self._pending[1].is_alive()

    def wait(self) -> str | None:
        """Finishes the asynchronous save in flight, if any: waits for its files, then records
        it as the latest checkpoint. Returns its path (None when no save was in flight).

        Raises:
          CheckpointError: the write failed (its partial files are removed, the previous
            checkpoint stays the latest).
        """
        if self._pending is None:
            return None
        target, thread, errors = self._pending
        self._pending = None
        thread.join()
        if errors:
            self._failed(target, errors[0])
        return self._record(target)

    def _record(self, path: str) -> str:
        """Records the written checkpoint ``path`` as the latest (client 0, once every client's
        shards are written) and deletes the checkpoints beyond ``max_to_keep``."""
        if self._mesh is not None and cluster.num_clients() > 1:
            # Every client's shards are written before client 0 records the checkpoint.
            dtensor.barrier(self._mesh, "dtk-checkpoint", timeout_in_ms=600_000)
        self._bookkeep(path)
        return path

    def _bookkeep(self, path: str) -> None:
        """Names ``path`` the latest checkpoint in the state file (the lead client) and deletes
        those beyond ``max_to_keep``; once per path (an asynchronous save's thread does it as
        soon as the files are written, and ``wait`` finds it done)."""
        with self._bookkeeping:
            if self._paths and self._paths[-1] == path:
                return
            paths = [p for p in self._paths if p != path] + [path]
            stale, paths = paths[:-self.max_to_keep], paths[-self.max_to_keep:]
            if cluster.is_lead_client():
                if not tf.io.gfile.exists(path + ".index"):
                    raise RuntimeError(f"checkpoint {path} was not written completely (no "
                                       f"{path}.index)")
                checkpoint_management.update_checkpoint_state_internal(
                    save_dir=self.directory, model_checkpoint_path=path,
                    all_model_checkpoint_paths=paths, save_relative_paths=True)
            self._paths = paths  # once recorded: a failure above leaves the previous latest
            if not cluster.is_lead_client():
                return
            for old in stale:  # only once the new checkpoint is recorded
                for f in tf.io.gfile.glob(old + ".*"):
                    tf.io.gfile.remove(f)

    def _check_no_other_writer(self) -> None:
        """Refuses to save when the newest checkpoint here is not one this run knows: another
        run wrote it (one that got past the lock: another host on a file system without locks)."""
        named = self._state_file_paths() or []
        if not named or named[0] in self._paths or not os.path.exists(named[0] + ".index"):
            return  # ours, or broken (restore skipped it; this save supersedes it)
        other = run_id_of(named[0])
        if other is not None and other != self.run_id:
            raise CheckpointError(
                f"checkpoint directory {self.directory} holds {os.path.basename(named[0])}, "
                f"written by another run (run {other}) while this run (run "
                f"{self.run_id}) was using the directory; nothing was overwritten. Give each run "
                "its own checkpoint directory")

    def close(self) -> None:
        """Finishes an asynchronous save in flight, then releases the directory's lock
        (otherwise held until the process exits)."""
        try:
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        if self._locked:
            self._locked = False
            unlock_directory(self.directory)

    def restore(self, path: str | None = None) -> dict[str, Any] | None:
        """Restores ``path``, or the newest readable checkpoint; returns the loop state.

        Without ``path``, broken checkpoints (unreadable files) are skipped, newest first, with a
        warning that names each and why. Returns None only when the directory holds no checkpoint
        files at all.

        Raises:
          ValueError: the checkpoint does not match the model (another architecture, missing or
            extra variables, other shapes), naming the checkpoint and what did not match.
          CheckpointError: the directory holds checkpoints but none can be read.
        """
        self.wait()
        if path is not None:
            return self._restore_one(path)
        broken = []
        for candidate in self.candidates():
            problem = _unreadable(candidate)
            if problem is None:
                state = self._restore_one(candidate)
                if broken:
                    _log.warning("resuming from %s, the newest intact checkpoint", candidate)
                return state
            _log.warning("checkpoint %s is broken and is skipped: %s", candidate, problem)
            broken.append(f"{os.path.basename(candidate)}: {problem}")
        if broken:
            raise CheckpointError(
                f"checkpoint directory {self.directory} holds {len(broken)} checkpoint(s) and none "
                f"can be read ({'; '.join(broken)}). Nothing was restored or overwritten: move "
                "them away or use a new directory, or start again on purpose "
                "(--restart_from_scratch / TrainerConfig(restart_from_scratch=True))")
        return None

    def clear(self) -> None:
        """Removes every checkpoint of this directory (for a deliberate restart from scratch)."""
        for candidate in self.candidates():
            for f in glob.glob(glob.escape(candidate) + ".*"):
                os.remove(f)
        state_file = os.path.join(self.directory, "checkpoint")
        if os.path.exists(state_file):
            os.remove(state_file)
        self._paths = []

    def _restore_one(self, path: str) -> dict[str, Any]:
        self._check_shapes(path)
        try:
            if self.host_write:
                self._host_restore(path)
            elif self._same_metrics(path):
                status = self._checkpoint.restore(path)
                status.assert_existing_objects_matched()
                status.assert_consumed()
            else:
                # Written with other metrics (a pipelined run keeps none; a Trainer keeps its
                # compiled ones): the model, optimizer and loop state restore, every one of
                # them matched; the metrics' running sums start from zero.
                status = tf.train.Checkpoint(model=self._checkpoint.model,
                                             optimizer=self._checkpoint.optimizer,
                                             loop=self._state).restore(path)
                status.assert_existing_objects_matched()
                status.expect_partial()
                _log.info("checkpoint %s holds other metrics than this run's: its metrics start "
                          "from zero (the model, optimizer and loop state are restored)", path)
        except (AssertionError, ValueError, tf.errors.OpError) as e:
            _clear_async_error()  # a failed async DTensor op would poison later ops
            raise ValueError(
                f"checkpoint {path} does not match this model and optimizer: {first_line(e)}. "
                "It was written by another model (or another optimizer); use a new checkpoint "
                "directory or the model that wrote it") from e
        self.restored = path
        self.run_id = self._state.value.get("run_id") or self.run_id
        return dict(self._state.value)

    def _host_restore(self, path: str) -> None:
        """Restores through host copies, each value read from the files and this client's
        shards sent to its devices (``dtk.parallel.materialize.assign_global``): one DTensor
        restore cannot span several meshes (a pipeline's stages). As strict as the object-graph
        restore: every variable of this run is in the checkpoint and every model or optimizer
        value of the checkpoint has its variable (metrics, where they differ, start from zero).

        Raises:
          ValueError: a variable missing on either side, naming the first few.
        """
        from dtk.parallel import materialize  # pylint: disable=g-import-not-at-top
        reader = tf.train.load_checkpoint(path)
        saved = set(reader.get_variable_to_shape_map())
        same_metrics = self._same_metrics(path)
        serialized = self._checkpoint._saver._gather_serialized_tensors(None)[0]  # pylint: disable=protected-access
        targets = {}
        for trackable, tensors in serialized.items():
            for key in tensors:
                if key.startswith("metrics/") and not same_metrics:
                    continue
                targets[key] = getattr(trackable, "_obj", trackable)  # under TF's converter
        missing = sorted(k for k in targets if k not in saved and not k.startswith("save_counter/"))
        extra = sorted(k for k in saved if k.split("/")[0] in ("model", "optimizer")
                       and k not in targets)
        if missing or extra:
            raise ValueError(f"variables of this run not in the checkpoint: {missing[:3]}; "
                             f"values of the checkpoint this run has no variable for: {extra[:3]}")
        for key, trackable in targets.items():
            if key not in saved:
                continue
            if isinstance(trackable, tf.Variable):
                try:
                    dtensor.fetch_layout(getattr(trackable, "_variable", trackable))
                except Exception:  # pylint: disable=broad-except  (a plain variable)
                    trackable.assign(reader.get_tensor(key))
                    continue
                materialize.assign_global(trackable, lambda key=key: reader.get_tensor(key))
            elif hasattr(trackable, "deserialize"):  # the loop state
                trackable.deserialize(reader.get_tensor(key))
        context.async_wait()

    def _same_metrics(self, path: str) -> bool:
        """Whether ``path`` holds as many metric variables as this checkpointer's metrics."""
        saved = [name for name, _ in tf.train.list_variables(path) if name.startswith("metrics/")]
        return len(saved) == sum(len(m.variables) for m in self._checkpoint.metrics)

    def _check_shapes(self, path: str) -> None:
        """Compares the saved model weights' shapes with the model's, before touching any variable.

        A restore that fails half-way inside DTensor leaves the runtime in an error state, so the
        common mismatch (another architecture) is caught here first.
        """
        model = self._checkpoint.model
        # Optimizers the model holds as attributes (keras.io's GAN: d_optimizer, g_optimizer) are
        # saved under the model too; their state is restored with it, and is not a weight.
        held = {attr for attr, value in vars(model).items()
                if isinstance(value, (tf_keras.optimizers.Optimizer,
                                      tf_keras.optimizers.legacy.Optimizer))}
        try:
            saved = sorted(tuple(shape) for name, shape in tf.train.list_variables(path)
                           if name.startswith("model/") and name.split("/")[1] not in held)
        except (tf.errors.OpError, ValueError) as e:
            raise ValueError(f"checkpoint {path} cannot be read: {first_line(e)}") from e
        have = sorted(tuple(w.shape) for w in model.weights)
        if saved != have:
            raise ValueError(
                f"checkpoint {path} does not match this model: it holds {len(saved)} model weights "
                f"of shapes {saved}, the model has {len(have)} of shapes {have}. It was written by "
                "another model; use a new checkpoint directory or the model that wrote it")


def _host_snapshot(checkpoint: tf.train.Checkpoint) -> tuple[list[str], list[str], list]:
    """This client's part of ``checkpoint`` as host arrays: checkpoint keys, ``SaveV2`` slice
    specs and values. A DTensor contributes each local shard that no other device holds too
    (replicas are written once, by the device at index 0 of the axes it is not sharded over);
    a plain tensor and the object graph are written by client 0."""
    serialized = checkpoint._saver._gather_serialized_tensors(None)[0]  # pylint: disable=protected-access
    names, slices, values = [], [], []
    lead = cluster.is_lead_client()
    for tensors in serialized.values():
        for key, spec in tensors.items():
            tensor = getattr(spec, "tensor", spec)
            tensor = tensor() if callable(tensor) else tensor
            layout = getattr(spec, "layout", None)
            if isinstance(layout, str):
                layout = dtensor.Layout.from_string(layout)
            if layout is None and isinstance(tensor, tf.Tensor) and dtensor.is_dtensor(tensor):
                layout = dtensor.fetch_layout(tensor)
            if layout is None or layout.is_fully_replicated():
                # written once: by client 0, or, on a mesh, by the client of its first device
                # (a pipeline stage's mesh may hold none of client 0's)
                writes = lead if layout is None else _holds_first_device(layout.mesh)
                if layout is not None and writes:
                    tensor = dtensor.unpack(tensor)[0]
                if writes:
                    names.append(key)
                    slices.append("")
                    values.append(tensor.numpy())
                continue
            shape = [int(d) for d in tensor.shape]
            sharded = {s for s in layout.sharding_specs if s != dtensor.UNSHARDED}
            for location, shard in zip(layout.mesh.local_device_locations(),
                                       dtensor.unpack(tensor)):
                if any(location[axis] for axis in layout.mesh.dim_names if axis not in sharded):
                    continue  # a replica: the device at index 0 of that axis writes it
                spans = []
                for dim, axis in enumerate(layout.sharding_specs):
                    if axis == dtensor.UNSHARDED:
                        spans.append("-")
                    else:
                        length = shape[dim] // layout.mesh.dim_size(axis)
                        spans.append(f"{location[axis] * length},{length}")
                names.append(key)
                slices.append(" ".join(map(str, shape)) + " " + ":".join(spans))
                values.append(shard.numpy())
    return names, slices, values


def _holds_first_device(mesh: dtensor.Mesh) -> bool:
    first = int(np.ravel(mesh.global_device_ids())[0])
    return first in {int(i) for i in mesh.local_device_ids()}


def _posted(key: str) -> None:
    """Tells client 0, through the coordination service, that this client's part is written."""
    context.context().set_config_key_value(f"dtk/save/{key}", "done")


def _wait_posted(key: str, timeout_s: float = 600.0) -> None:
    """Waits for another client's ``_posted(key)``, then removes the key (client 0 alone reads
    it), so the coordination service does not keep one key per save."""
    ctx = context.context()
    ctx.get_config_key_value(f"dtk/save/{key}", timeout_in_ms=int(timeout_s * 1000))
    ctx.delete_config_key_value(f"dtk/save/{key}")


def state_of(path: str) -> dict[str, Any] | None:
    """The loop state checkpoint ``path`` recorded (its settings, epoch, history), read without
    restoring anything; None where unreadable."""
    try:
        raw = tf.train.load_checkpoint(path).get_tensor("loop/.ATTRIBUTES/py_state")
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except Exception:  # pylint: disable=broad-except  (any unreadable checkpoint)
        return None


def run_id_of(path: str) -> str | None:
    """The id of the run that wrote checkpoint ``path`` (None: unreadable, or written before
    dtk recorded it)."""
    return (state_of(path) or {}).get("run_id")


def _clear_async_error() -> None:
    """Waits for pending DTensor ops and clears their error state, so later ops run again."""
    try:
        context.async_wait()
    except Exception:  # pylint: disable=broad-except  (the error being cleared)
        pass
    context.async_clear_error()


def _unreadable(path: str) -> str | None:
    """Why checkpoint ``path`` cannot be read, or None when every tensor in it reads back intact.

    Reading every tensor on the host checks the index, the data files' lengths and their
    checksums, before any DTensor variable is touched (a restore that fails half-way inside
    DTensor would leave its runtime in an error state).
    """
    if not os.path.exists(path + ".index"):
        return "its .index file is missing"
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except  (DataLoss, OutOfRange, NotFound, ...)
        return first_line(e)
    return None


def global_value(tensor: Any) -> np.ndarray:
    """The full (global) value of a DTensor or DVariable as numpy, on any layout and any client.

    Sharded tensors are relayouted to replicated first (``get_weights()`` fails on sharded
    variables), then this client's first component holds the whole value.
    """
    layout = dtensor.fetch_layout(tensor)
    if layout is None:
        return np.asarray(tensor)
    value = tensor.read_value() if hasattr(tensor, "read_value") else tensor
    # One sharded dim at a time: DTensor's lowering of an all-gather over several mesh axes at
    # once fails for some layouts (e.g. [batch, unsharded, model] logits of a model-parallel LM).
    specs = list(layout.sharding_specs)
    for dim, spec in enumerate(specs):
        if spec != dtensor.UNSHARDED:
            specs[dim] = dtensor.UNSHARDED
            value = dtensor.relayout(value, dtensor.Layout(specs, layout.mesh))
    return dtensor.unpack(value)[0].numpy()


def read_sharded_variables_whole() -> None:
    """Makes ``DVariable.numpy()`` return a sharded variable's whole value (``global_value``),
    as for a replicated one: Keras's ``get_weights()`` (of the model and of each layer) and
    ``save_weights`` to ``.h5`` read weights through it, and failed on every layout dtk makes
    beyond data parallel ("Trying to copy a non-single-device and non-replicated DTensor").
    Replicated variables read as before. Once per process (``dtk.distribute`` calls it)."""
    if getattr(dtensor.DVariable.numpy, "_dtk", False):
        return
    keras_numpy = dtensor.DVariable.numpy

    def numpy(self):
        layout = getattr(self, "layout", None)
        if layout is None or layout.is_fully_replicated():
            return keras_numpy(self)
        return global_value(self)

    numpy._dtk = True  # pylint: disable=protected-access
    dtensor.DVariable.numpy = numpy


def gather_weights(model: tf_keras.Model) -> list[np.ndarray]:
    """``model.get_weights()`` for a laid-out model: every weight's global value, in order."""
    return [global_value(w) for w in model.weights]


# Not weights of the model: tracking lists, and the random generators' state (dtk builds random
# layers with TensorFlow's stateful generator; a plain twin has none).
_NOT_WEIGHTS = (*layouts_lib.TRACKING_ATTRIBUTES, "_random_generator", "_generator")


def _weights_by_identity(model: tf_keras.Model) -> dict[str, tf.Variable]:
    """Every weight of a built model, keyed by where it lives, not by its position in ``weights``.

    Sequential/Functional: ``<layer index>:<layer class>/<attribute path>`` (indexes, not layer
    names: a second factory call names unnamed layers ``dense_7`` where the first said
    ``dense_2``); subclassed: the attribute path from the model. A laid-out build may list its
    weights in another order than a plain one (non-trainable ones notably), so position means
    nothing.
    """
    out: dict[str, tf.Variable] = {}
    seen = set()
    for path, _, _, variable in layouts_lib.variable_paths(
            model, lambda i, layer: f"{i}:{type(layer).__name__}", skip=_NOT_WEIGHTS):
        if id(variable) not in seen:
            seen.add(id(variable))
            out[path] = variable
    return out


def _metric_objects(model: tf_keras.Model) -> list:
    """The metric objects a model holds: its ``metrics`` and any kept as attributes (Keras tracks
    those in ``_metrics``, outside its layers)."""
    found = [*getattr(model, "_metrics", []), *model.metrics]
    return [m for m in found if isinstance(m, tf_keras.metrics.Metric)]


def plain_copy(model: tf_keras.Model, model_factory: Callable[[], tf_keras.Model], *,
               input_shape=None) -> tf_keras.Model:
    """A plain (non-DTensor) twin of ``model`` built by ``model_factory``, with its weights.

    Weights are matched by identity (``_weights_by_identity``), and every shape and dtype is
    checked, so two weights of one shape can never be swapped.

    Raises:
      ValueError: a weight of one model has no counterpart in the other, or another shape or
        dtype; the message names the weight.
    """
    return plain_copy_of(_weights_by_identity(model), model_factory, input_shape=input_shape)


def plain_copy_of(trained: dict[str, tf.Variable], model_factory: Callable[[], tf_keras.Model],
                  *, input_shape=None) -> tf_keras.Model:
    """``plain_copy`` from the trained weights by key (``_weights_by_identity``'s keys): a
    model held in parts (a pipeline's stages) gives its weights this way."""
    twin = model_factory()
    if not twin.built:
        if input_shape is None:
            raise ValueError("model_factory returned an unbuilt (subclassed) model; pass "
                             "input_shape= (one example's shape) to build the export twin")
        twin(tf.zeros([1, *(int(d) for d in input_shape)]))
    fresh = _weights_by_identity(twin)
    only_trained = sorted(set(trained) - set(fresh))
    only_fresh = sorted(set(fresh) - set(trained))
    if only_trained or only_fresh:
        raise ValueError(
            f"model_factory() builds a model whose weights differ from the trained model's: "
            f"trained only {only_trained[:4]}, new build only {only_fresh[:4]}. The factory must "
            "build the same architecture every time (same layers in the same order)")
    covered = {id(v) for v in fresh.values()}
    # A model's own metric objects (keras.io "Customizing fit": self.loss_tracker = Mean())
    # hold state, not weights: the twin keeps them fresh, as after Keras's own load.
    covered |= {id(v) for m in _metric_objects(twin) for v in m.variables}
    missing = [w.name for w in twin.weights if id(w) not in covered]
    if missing:
        raise ValueError(f"export cannot locate weights {missing[:4]} of the model by attribute "
                         "path; keep weights as layer attributes (add_weight in build)")
    for key, variable in fresh.items():
        value = global_value(trained[key])
        if tuple(variable.shape) != value.shape or variable.dtype.base_dtype != trained[
                key].dtype.base_dtype:
            raise ValueError(
                f"weight {key}: the trained model has {value.shape} {trained[key].dtype.name}, a "
                f"new model_factory() build has {tuple(variable.shape)} {variable.dtype.name}; "
                "the factory must build the same model every time")
        variable.assign(value)
    return twin


EXPORT_FORMATS = ("keras", "saved_model")


def export(model: tf_keras.Model | dict[str, tf.Variable],
           model_factory: Callable[[], tf_keras.Model], export_dir: str, *, input_shape=None,
           formats: Sequence[str] = EXPORT_FORMATS) -> dict[str, str]:
    """Writes ``model.keras`` (plain tf_keras) and ``saved_model/`` (for serving) under export_dir.

    ``model``: the laid-out model, or its weights by key (``plain_copy_of``).

    In a multi-client run only client 0 writes (every client holds the same global weights), but
    every client must call this, because gathering the weights is a collective.

    Args:
      formats: which of ``"keras"`` and ``"saved_model"`` to write. A SavedModel traces every
        layer's call for serving: most of an export's time for a large model (DenseNet121: 37 of
        43 s), so a run that only reloads the model in Keras can skip it.

    Returns:
      ``{format: path}`` for each format written.
    """
    if isinstance(formats, str) or not formats or set(formats) - set(EXPORT_FORMATS):
        raise ValueError(f"formats={formats!r}: give a non-empty list of {list(EXPORT_FORMATS)}")
    problem = _env.path_problem(export_dir, kind="dir")
    if problem:  # an existing file raised a raw FileExistsError from os.makedirs
        raise ValueError(f"export_dir {problem}")
    trained = model if isinstance(model, dict) else _weights_by_identity(model)
    twin = plain_copy_of(trained, model_factory, input_shape=input_shape)
    paths = {name: path for name, path in (("keras", os.path.join(export_dir, "model.keras")),
                                           ("saved_model", os.path.join(export_dir, "saved_model")))
             if name in formats}
    if cluster.is_lead_client():
        os.makedirs(export_dir, exist_ok=True)
        if "keras" in paths:
            twin.save(paths["keras"])
        if "saved_model" in paths:
            tf.saved_model.save(twin, paths["saved_model"])
    return paths
