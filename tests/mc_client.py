"""A small DTensor training client for the multi-client tests (run by python -m dtk.cluster.launch).

Environment knobs (test-only): MC_KILL_AT=N makes client 1 SIGKILL itself after global step N
(once, if MC_MARKER names a file that does not exist yet; it is created); MC_NEVER_START=1 makes
client 1 sleep instead of joining; MC_OUT=path writes client 0's per-epoch losses as JSON;
MC_SCALE=1 reads the data in scale mode (each client its half); MC_INFO_DIR=dir makes each client write client-<id>.json after its first step (pid, network
interfaces, TCP ports listening in its network namespace, DTENSOR_JOBS); MC_SLOW=s sleeps s seconds
after every step; MC_MEMORY=1 trains with FSDP, remat and gradient accumulation; MC_SHARD=1/0 turns the sharded update on/off; MC_MESH=spec (default batch=8); MC_ASYNC=1/0 saves asynchronously or not; MC_KILL_IN_SAVE=N kills client 1 inside the save of step N (with MC_MARKER); MC_SKEW_AUTO=1 makes the steps_per_execution="auto" calibration see stacked
calls 10x faster on client 0 and 100x slower on client 1, so the clients would choose differently
(stack / do not stack) if they did not agree; MC_EPOCHS=n trains n epochs (default 3); MC_MODEL=lm
trains the transformer LM with dropout instead of the MLP; MC_PLAIN_EXIT=1 ends without
dtk.cluster.env.exit_process, as a user's script does; MC_KERAS=1 trains with Keras's own fit on
a dtk.distribute model fed the same DistributedDataset (dtk.train.keras_data), MC_KERAS_SPE
steps per call (default 4; "auto": dtk's calibration, dtk.train.auto_steps).
"""

import functools
import json
import os
import signal
import sys
import time

import numpy as np

import dtk
from dtk.data import input as input_lib

client = int(os.environ.get("DTENSOR_CLIENT_ID", "0"))
if client == 1 and os.environ.get("MC_NEVER_START"):
    time.sleep(600)
    sys.exit(3)

import tensorflow as tf  # noqa: E402

if os.environ.get("MC_SKEW_AUTO"):
    from dtk.train import auto_steps as _auto_steps
    _observe = _auto_steps.AutoSteps.observe

    def _skewed(self, seconds, steps, steps_per_epoch):
        skew = (0.1 if client == 0 else 100.0) if steps > 1 else 1.0
        return _observe(self, seconds * skew, steps, steps_per_epoch)

    _auto_steps.AutoSteps.observe = _skewed
    _auto_steps.AUTO_MIN_STEPS = 1  # calibrate even in this short run

mesh = dtk.build_mesh(os.environ.get("MC_MESH", "batch=8"), device_type="cpu")
rng = np.random.default_rng(0)
data = tf.data.Dataset.from_tensor_slices((rng.random((512, 28, 28, 1), dtype=np.float32),
                                           rng.integers(0, 10, 512).astype(np.int64)))
config = input_lib.InputConfig(global_batch_size=64, shuffle=True, seed=1)
if os.environ.get("MC_SCALE"):  # scale mode: each client reads its half of the examples
    train = input_lib.DistributedDataset.from_function(
        lambda shard: data.shard(shard.num_clients, shard.client_id), mesh, config)
else:
    train = input_lib.DistributedDataset(data, mesh, config)
# MC_MEMORY=1: FSDP (weights sharded across the clients), remat and gradient accumulation; the
# numbers stay those of one process without them.
MEMORY = ({"fsdp": True, "remat": (r"d\d",), "gradient_accumulation_steps": 2}
          if os.environ.get("MC_MEMORY") else {})
if os.environ.get("MC_KILL_IN_SAVE") and client == 1 and not os.path.exists(os.environ["MC_MARKER"]):
    # MC_KILL_IN_SAVE=N: client 1 dies inside the save of step N, once its shards are issued and
    # before the save's barrier (client 0 cannot record that checkpoint).
    from dtk.train import checkpoint as _checkpoint_lib
    _write = tf.train.Checkpoint.write

    def _write_then_die(self, prefix, *args, **kwargs):
        path = _write(self, prefix, *args, **kwargs)
        if prefix.endswith(f"ckpt-{os.environ['MC_KILL_IN_SAVE']}"):
            open(os.environ["MC_MARKER"], "w").close()
            print(f"client 1 kills itself while saving {os.path.basename(prefix)}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    tf.train.Checkpoint.write = _write_then_die

    def _post_or_die(key):  # an asynchronous save: die once the part is written, unannounced
        if f"ckpt-{os.environ['MC_KILL_IN_SAVE']}/" in key:
            open(os.environ["MC_MARKER"], "w").close()
            print(f"client 1 kills itself while saving ckpt-{os.environ['MC_KILL_IN_SAVE']}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        _posted(key)
    _posted = _checkpoint_lib._posted  # pylint: disable=protected-access
    _checkpoint_lib._posted = _post_or_die  # pylint: disable=protected-access
if os.environ.get("MC_ASYNC"):  # MC_ASYNC=1/0: checkpoints written in the background or not
    MEMORY["async_checkpoints"] = os.environ["MC_ASYNC"] == "1"
if os.environ.get("MC_SHARD"):  # MC_SHARD=1/0: the sharded (ZeRO) update on/off, not "auto"
    MEMORY["shard_optimizer_state"] = os.environ["MC_SHARD"] == "1"
# With dropout: 2 clients x 4 match one process, and a killed group resumes to the same numbers,
# only if the masks do not depend on the client count (dtk.parallel.randomness).
# MC_MODEL=lm: the byte-level transformer LM with dropout 0.1 (transformer_lm table) on MC_MESH.
if os.environ.get("MC_MODEL") == "lm":
    tokens = rng.integers(0, 64, (128, 17))
    data = tf.data.Dataset.from_tensor_slices((tokens[:, :-1].astype(np.int32),
                                               tokens[:, 1:].astype(np.int64)))
    train = input_lib.DistributedDataset(
        data, mesh, input_lib.InputConfig(global_batch_size=16, shuffle=True, seed=1))
    MODEL = functools.partial(dtk.models.transformer_lm, vocab=64, seq_len=16, dim=32, heads=8,
                              layers=1, dropout=0.1)
    LAYOUT = "transformer_lm"
else:
    MODEL = functools.partial(dtk.models.mnist_mlp, dropout=0.2)
    LAYOUT = "data_parallel"
if os.environ.get("MC_KERAS"):  # Keras's own fit on a dtk.distribute model, fed `train`
    import tf_keras  # noqa: E402
    keras_model = dtk.distribute(MODEL, mesh, layout=LAYOUT,
                                 seed=int(os.environ.get("MC_SEED", "0")))
    keras_model.compile(
        optimizer=tf_keras.optimizers.Adam(1e-3), metrics=["accuracy"],
        steps_per_execution=(lambda v: v if v == "auto" else int(v))(
            os.environ.get("MC_KERAS_SPE", "4")),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fitted = keras_model.fit(train, epochs=int(os.environ.get("MC_EPOCHS", "3")), verbose=0)
    if client == 0 and os.environ.get("MC_OUT"):
        with open(os.environ["MC_OUT"], "w") as f:
            json.dump(fitted.history, f)
    print("DONE", fitted.history["loss"], "steps per call:",
          int(keras_model._steps_per_execution.numpy()), flush=True)  # pylint: disable=protected-access
    from dtk.cluster import env as cluster  # noqa: E402
    cluster.exit_process(0)
trainer = dtk.Trainer(mesh=mesh, model=MODEL, layout=LAYOUT,
                      optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3),
                      config=dtk.TrainerConfig(seed=int(os.environ.get("MC_SEED", "0")),
                                               checkpoint_dir=os.environ.get("MC_CKPT") or None,
                                               verbose=0, **MEMORY))


def _listening_ports():
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(name):
            for line in open(name).read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def report_info(step):
    info_dir = os.environ.get("MC_INFO_DIR")
    path = info_dir and os.path.join(info_dir, f"client-{client}.json")
    if path and not os.path.exists(path):
        interfaces = [line.split(":")[0].strip() for line in
                      open("/proc/net/dev").read().splitlines()[2:]]
        info = {"pid": os.getpid(), "interfaces": interfaces, "listening": _listening_ports(),
                "jobs": os.environ["DTENSOR_JOBS"], "step": step}
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)
    if os.environ.get("MC_SLOW"):
        time.sleep(float(os.environ["MC_SLOW"]))


def maybe_die(step):
    kill_at, marker = os.environ.get("MC_KILL_AT"), os.environ.get("MC_MARKER")
    if client == 1 and kill_at and step >= int(kill_at) and not (marker and os.path.exists(marker)):
        if marker:
            open(marker, "w").close()
        print(f"client 1 kills itself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if kill_at:
        time.sleep(0.05)  # slow down so the kill lands mid-training


history = trainer.fit(train, epochs=int(os.environ.get("MC_EPOCHS", "3")),
                      on_step_end=[maybe_die, report_info])
if client == 0 and os.environ.get("MC_OUT"):
    with open(os.environ["MC_OUT"], "w") as f:
        json.dump(history.history, f)
resumed = trainer.restored_checkpoint
print("DONE", history.history["loss"], "sharded update:", trainer.shard_optimizer_state,
      "resumed from:", resumed and os.path.basename(resumed), flush=True)
# MC_PLAIN_EXIT=1: end as a user's script does, through the interpreter's normal exit (dtk leaves
# the group at exit: dtk.cluster.env.leave_group_at_exit); otherwise as dtk's scripts do.
if not os.environ.get("MC_PLAIN_EXIT"):
    from dtk.cluster import env as cluster  # noqa: E402
    cluster.exit_process(0)
