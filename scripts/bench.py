"""Benchmark: dtk's train step against the single-device floor, Keras fit and MirroredStrategy.

    python scripts/bench.py                       # both workloads, all variants, table + JSON lines
    python scripts/bench.py --workloads mlp --repeats 3 --plot bench.png
    python scripts/bench.py --workloads mlp --variants dtk_batch8_zero_spe   # one variant + floor
    python scripts/bench.py --breakdown --workloads mlp   # where the time goes, in one process

Every variant runs in its own subprocess (virtual devices are per process), the variants alternate
within each repeat (so machine noise hits them alike), each process warms up before timing, and
every timed step is synchronized (DTensor runs asynchronously: a step is only done once its loss is
read). Reported: the median ms/step over the timed steps and then over repeats, the ratio to the
floor (a plain single-device ``tf.function`` loop) measured in the same run, and time to first step
(tracing and compilation included).

On a CPU-only machine, 8 virtual devices share the same cores as the single device, so they cannot
be faster: the ratio shows the SPMD overhead (dispatch on every device, collectives, replicated
optimizer updates), which is also paid on GPUs and TPUs.

Workloads: ``mlp`` is the MNIST MLP (784-128-10) at global batch 128; ``heavy`` is 784-1024-1024-10
at global batch 1024; ``lm`` is the byte-level transformer LM of ``scripts/train_lm.py`` (2 blocks,
dim 128, 8 heads, 128 tokens, global batch 32; Megatron table ``transformer_lm``), reported also in
tokens/s (``python scripts/bench.py --workloads lm --variants
dtk_batch8,dtk_batch4_model2,dtk_batch2_model4,dtk_batch1_model8``); ``lm_dropout`` is the LM
with dropout 0.1 (dtk.parallel.randomness's mesh-independent draws) and ``lm_dropout_keras`` the same with
Keras's own generator, whose draws depend on the mesh (the cost before dtk.parallel.randomness). All variants train with Adam on random MNIST-shaped data, pre-packed (input
packing is measured by ``scripts/bench_input.py``).

``--breakdown`` times pieces of one step in a single process on 8 virtual CPUs, alternating them
call by call (ratios within one process are far steadier than across processes): the floor and its
forward and forward+backward+SGD parts on one device, the same parts under DTensor on ``batch=8``,
the whole dtk step (replicated and ZeRO-style), and the gradient all-reduces alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dtk import usage

WORKLOADS = {
    "mlp": {"hidden": (128,), "batch": 128, "steps": 60},
    "heavy": {"hidden": (1024, 1024), "batch": 1024, "steps": 8},
    "lm": {"batch": 32, "seq_len": 128, "dim": 128, "heads": 8, "layers": 2, "steps": 12},
    # The LM with dropout 0.1: dtk.parallel.randomness's mesh-independent draws, and (the "before") the
    # draws of Keras's own generator, which depend on the mesh.
    "lm_dropout": {"batch": 32, "seq_len": 128, "dim": 128, "heads": 8, "layers": 2, "steps": 12,
                   "dropout": 0.1},
    "lm_dropout_keras": {"batch": 32, "seq_len": 128, "dim": 128, "heads": 8, "layers": 2,
                         "steps": 12, "dropout": 0.1, "keras_rng": True},
    # Issue 44's long sequences: the LM at T = 512 and T = 4096 (global batch 8 rows), tokens/s of
    # sequence-sharded meshes against batch=8 and batch=2,model=4 (with and without Megatron's
    # sequence parallelism).
    "lm_t512": {"batch": 8, "seq_len": 512, "dim": 128, "heads": 8, "layers": 2, "steps": 5},
    "lm_t4096": {"batch": 8, "seq_len": 4096, "dim": 64, "heads": 4, "layers": 1, "steps": 3},
    # ... and with blockwise attention (dtk.parallel.attention, 128 keys a block)
    "lm_t512_blockwise": {"batch": 8, "seq_len": 512, "dim": 128, "heads": 8, "layers": 2,
                          "steps": 5, "attention": "blockwise"},
    "lm_t4096_blockwise": {"batch": 8, "seq_len": 4096, "dim": 64, "heads": 4, "layers": 1,
                           "steps": 3, "attention": "blockwise"},
    # Issue 60's mixture of experts: the LM with 8 experts in each block, top-1 (the same active
    # parameters per token as "lm"), routed in groups of 32 positions, capacity factor 1.25;
    # experts over batch (transformer_lm_moe_batch) or over an expert axis (transformer_lm_moe).
    "lm_moe8": {"batch": 32, "seq_len": 128, "dim": 128, "heads": 8, "layers": 2, "steps": 12,
                "moe_experts": 8},
    # Issue 43's recommender (dtk.models.dlrm, dim 16, global batch 1024, Adam): table0 at 2^16,
    # 2^20 and 2^23 rows (the other tables 4096, 256, 16), row-sharded (layouts/recsys*.toml).
    "recsys16": {"rows": 1 << 16, "batch": 1024, "steps": 20},
    "recsys20": {"rows": 1 << 20, "batch": 1024, "steps": 10},
    "recsys23": {"rows": 1 << 23, "batch": 1024, "steps": 6},
}
MESHES = {"dtk_batch4_model2": "batch=4,model=2", "dtk_batch2_model4": "batch=2,model=4",
          "dtk_batch1_model8": "batch=1,model=8", "dtk_batch4_model2_fsdp": "batch=4,model=2",
          "dtk_batch2_model4_nosp": "batch=2,model=4", "dtk_batch2_seq4": "batch=2,seq=4",
          "dtk_batch2_seq2_model2": "batch=2,seq=2,model=2", "dtk_batch1_seq8": "batch=1,seq=8",
          "dtk_batch2_seq4_gather": "batch=2,seq=4", "dtk_batch2_seq4_a2a": "batch=2,seq=4",
          "dtk_batch1_seq8_gather": "batch=1,seq=8", "dtk_batch1_seq8_a2a": "batch=1,seq=8",
          "dtk_batch2_expert4": "batch=2,expert=4", "dtk_batch4_expert2": "batch=4,expert=2"}
VARIANTS = {
    "floor": "plain tf.function loop, 1 device",
    "keras_fit": "plain tf_keras Model.fit, 1 device",
    "mirrored_fit": "MirroredStrategy over 8 virtual CPUs, tf_keras fit",
    "dtk_fit": "tf_keras's own fit on a dtk.distribute model, mesh batch=8 (dtk's defaults: "
               "the sharded update; steps_per_execution=32): the headline dtk variant",
    "dtk_fit_dataset": "tf_keras's own fit on a dtk.distribute model fed a dtk.DistributedDataset "
                       "(packed in its prefetch thread; dtk.train.keras_data), batch=8, "
                       "steps_per_execution=32",
    "dtk_default": "dtk.Trainer's defaults, mesh batch=8: Keras's fit on a dtk.distribute model fed a "
                   "DistributedDataset, shard_optimizer_state=auto, steps_per_execution=auto",
    "dtk_batch8": "dtk Steps, mesh batch=8 (replicated update, one step per call)",
    "dtk_batch8_spe": "dtk Steps, mesh batch=8, steps_per_execution=10",
    "dtk_batch8_zero": "dtk Steps, mesh batch=8, shard_optimizer_state (ZeRO-style update)",
    "dtk_batch8_zero_spe": "dtk Steps, mesh batch=8, shard_optimizer_state, steps_per_execution=10",
    "dtk_batch4_model2": "dtk Steps, mesh batch=4,model=2 (mlp_model_parallel / transformer_lm)",
    "dtk_batch2_model4": "dtk Steps, mesh batch=2,model=4 (model-parallel table)",
    "dtk_batch1_model8": "dtk Steps, mesh batch=1,model=8 (model-parallel table)",
    "dtk_batch8_fsdp": "dtk Steps, mesh batch=8, FSDP (weights stored sharded, gathered per step)",
    "dtk_batch4_model2_fsdp": "dtk Steps, mesh batch=4,model=2, FSDP x model parallel",
    "dtk_batch8_fsdp_remat": "dtk Steps, mesh batch=8, FSDP + remat of the model's blocks",
    "dtk_batch8_remat": "dtk Steps, mesh batch=8, remat of the model's blocks (replicated update)",
    "dtk_batch2_model4_nosp": "LM: batch=2,model=4 without Megatron's sequence parallelism",
    "dtk_batch2_seq4": "LM: batch=2,seq=4 (context parallelism: the sequence sharded over seq)",
    "dtk_batch2_seq2_model2": "LM: batch=2,seq=2,model=2 (context x tensor parallelism)",
    "dtk_batch1_seq8": "LM: batch=1,seq=8 (the sequence sharded over every device)",
    "dtk_batch2_seq4_gather": "LM: batch=2,seq=4, attention gathers keys and values (all-gather)",
    "dtk_batch2_seq4_a2a": "LM: batch=2,seq=4, attention all-to-all to heads (Ulysses)",
    "dtk_batch1_seq8_gather": "LM: batch=1,seq=8, all-gather attention",
    "dtk_batch1_seq8_a2a": "LM: batch=1,seq=8, all-to-all attention (Ulysses)",
    "dtk_batch2_expert4": "MoE LM: batch=2,expert=4 (experts over expert, tokens over both)",
    "dtk_batch4_expert2": "MoE LM: batch=4,expert=2",
    "keras3_fit": "plain Keras 3 (TensorFlow backend) Model.fit, 1 device",
    "keras3_mirrored_fit": "Keras 3 fit under tf.distribute.MirroredStrategy over 8 virtual CPUs",
    "keras3_dtk": "Keras 3 fit, dtk.enable_keras_distribution + DataParallel over 8 devices, "
                  "steps_per_execution=32",
    "keras3_dtk_spe1": "Keras 3 fit, dtk's DataParallel over 8 devices, one step per call",
    "dtk_batch8_sparse": "recsys: dtk Steps, batch=8, tables row-sharded over batch, lazy Adam (sparse)",
    "dtk_batch4_model2_sparse": "recsys: dtk Steps, batch=4,model=2, tables row-sharded over model, lazy Adam",
}
# Run by default; the rest with --variants (the whole default run stays under 10 minutes here).
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in ("dtk_batch8_zero_spe", "dtk_batch2_model4",
                                                     "dtk_batch1_model8") and "fsdp" not in v
                    and "remat" not in v and "expert" not in v]
WORKER_TIMEOUT_S = 300
# --device gpu|tpu (scripts/accelerator_check.py): the variants run on the machine's accelerators;
# the meshes named for 8 devices are scaled to their number N (batch=8 -> batch=N, batch=4,model=2
# -> batch=N/2,model=2). The workers read the choice from this variable.
DEVICE_ENV = "DTK_BENCH_DEVICE"


def _device() -> str:
    return os.environ.get(DEVICE_ENV, "cpu")


def _devices(dtk) -> None:
    """8 virtual CPUs on a CPU machine; the real accelerators otherwise."""
    if _device() == "cpu":
        dtk.configure_virtual_cpus(8)


def _mesh(dtk, spec: str):
    """``spec`` as written for 8 devices, scaled to the accelerators under --device gpu|tpu."""
    if _device() == "cpu":
        return dtk.build_mesh(spec)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    n = len(tf.config.list_physical_devices(_device().upper()))
    sizes = dict(part.split("=") for part in spec.split(","))
    model = int(sizes.get("model", 1))
    if n % model:
        raise SystemExit(f"mesh {spec} needs a multiple of {model} devices; this machine has {n}")
    scaled = f"batch={n // model}" + (f",model={model}" if "model" in sizes else "")
    return dtk.build_mesh(scaled, device_type=_device())


# -- worker (one variant, one process) ------------------------------------------------------------
def _model(tf_keras, hidden, **layer_kwargs):
    layers = [tf_keras.layers.Flatten(input_shape=(28, 28, 1), name="flatten")]
    for i, units in enumerate(hidden):
        layers.append(tf_keras.layers.Dense(units, activation="relu", name=f"d{i + 1}"))
    layers.append(tf_keras.layers.Dense(10, name=f"d{len(hidden) + 1}"))
    return tf_keras.Sequential(layers)


def _floor_step(tf, tf_keras, model, loss_obj, *, accuracy=True):
    """The floor: a plain single-device tf.function step of ``model`` (Adam, + accuracy)."""
    opt = tf_keras.optimizers.Adam()
    acc = tf_keras.metrics.SparseCategoricalAccuracy() if accuracy else None

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = loss_obj(yb, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if acc is not None:
            acc.update_state(yb, logits)
        return loss
    return step, model


def _timed(fn, steps, per_call=1):
    """(first call s, per-step ms of each later call), each call synchronized by reading a value."""
    start = time.perf_counter()
    float(fn())
    first = time.perf_counter() - start
    for _ in range(3 if per_call == 1 else 1):  # warm-up: at least 3 steps
        float(fn())
    times = []
    for _ in range(max(1, steps // per_call)):
        start = time.perf_counter()
        float(fn())
        times.append(1000 * (time.perf_counter() - start) / per_call)
    return first, times


def _trainer_default(dtk, tf, tf_keras, hidden, x, y, batch, steps, workload) -> dict:
    """``dtk.Trainer`` with its defaults (Keras's ``fit`` on a ``dtk.distribute`` model fed a
    ``DistributedDataset``; the sharded update and steps per call chosen automatically): two
    epochs of 190 batches (an MNIST epoch), every call read back; ms/step over the second
    epoch's calls, after the automatic choice."""
    mesh = _mesh(dtk, "batch=8")
    start = time.perf_counter()
    trainer = dtk.Trainer(mesh=mesh, model=lambda: _model(tf_keras, hidden), optimizer="adam",
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                          config=dtk.TrainerConfig(seed=0, verbose=0))
    epoch = 190
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)).repeat(), mesh,
                                  dtk.InputConfig(global_batch_size=batch,
                                                  steps_per_epoch=epoch))
    stamps = []

    def mark(step):  # after every compiled call: read back, as the other variants' calls are
        int(trainer.optimizer.iterations.numpy())
        stamps.append((step, time.perf_counter()))
    trainer.fit(data, epochs=2 + max(0, steps - epoch) // epoch, on_step_end=[mark])
    first = stamps[0][1] - start
    late = [s for s in stamps if s[0] > epoch]
    times = [1000 * (b - a) / (m - n) for (n, a), (m, b) in zip(late, late[1:])]
    return {"variant": "dtk_default", "workload": workload,
            "ms_per_step": statistics.median(times), "first_step_s": first,
            "timed_steps": late[-1][0] - late[0][0],
            "steps_per_execution": trainer.steps_per_execution,
            "shard_optimizer_state": trainer.shard_optimizer_state}


def _worker(variant: str, workload: str, steps: int) -> dict:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top  (before TensorFlow traces anything)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top

    spec = WORKLOADS[workload]
    if workload.startswith("lm"):
        return _lm_worker(variant, workload, spec, steps)
    if workload.startswith("recsys"):
        return _recsys_worker(variant, workload, spec, steps)
    batch, hidden = spec["batch"], spec["hidden"]
    if variant.startswith("keras3"):
        return _keras3_worker(variant, workload, spec, steps)
    spe = 10 if "_spe" in variant else 1
    rng = np.random.default_rng(0)
    x = rng.random((spe, batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, (spe, batch)).astype(np.int64)
    w = np.ones((spe, batch), np.float32)
    if variant != "floor" and variant != "keras_fit":
        _devices(dtk)
    tf_keras.utils.set_random_seed(0)
    loss_obj = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if variant == "dtk_default":
        return _trainer_default(dtk, tf, tf_keras, hidden, x[0], y[0], batch, steps, workload)
    if variant == "floor":
        step, _ = _floor_step(tf, tf_keras, _model(tf_keras, hidden), loss_obj)
        xb, yb = tf.constant(x[0]), tf.constant(y[0])
        first, times = _timed(lambda: step(xb, yb), steps)
    elif variant in ("keras_fit", "mirrored_fit", "dtk_fit", "dtk_fit_dataset"):
        per_call = 32 if variant.startswith("dtk_fit") else 1
        if variant.startswith("dtk_fit"):  # Keras's own loop and step, dtk's seams
            model = dtk.distribute(lambda: _model(tf_keras, hidden), _mesh(dtk, "batch=8"), seed=0)
            model.compile(optimizer=tf_keras.optimizers.Adam(), loss=loss_obj,
                          metrics=["accuracy"], steps_per_execution=per_call)
        else:
            strategy = tf.distribute.get_strategy()
            if variant == "mirrored_fit":
                strategy = (tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(8)])
                            if _device() == "cpu" else tf.distribute.MirroredStrategy())
            with strategy.scope():
                model = _model(tf_keras, hidden)
                model.compile(optimizer=tf_keras.optimizers.Adam(), loss=loss_obj,
                              metrics=["accuracy"])
        data = tf.data.Dataset.from_tensors((x[0], y[0])).repeat()
        if variant == "dtk_fit_dataset":
            def data_of(batches):
                return dtk.DistributedDataset(
                    tf.data.Dataset.from_tensor_slices((x[0], y[0])).repeat(),
                    model._dtk_mesh_state.mesh,  # pylint: disable=protected-access
                    dtk.InputConfig(global_batch_size=batch, steps_per_epoch=batches))
        stamps = []
        callback = tf_keras.callbacks.LambdaCallback(  # one call per per_call steps
            on_train_batch_end=lambda b, logs: (float(logs["loss"]),
                                                stamps.append(time.perf_counter())))
        start = time.perf_counter()
        if variant == "dtk_fit_dataset":
            model.fit(data_of(per_call), epochs=1, verbose=0, callbacks=[callback])
        else:
            model.fit(data, epochs=1, steps_per_epoch=per_call, verbose=0, callbacks=[callback])
        first = time.perf_counter() - start
        stamps.clear()
        calls = max(4, -(-steps // per_call)) + 4
        if variant == "dtk_fit_dataset":
            model.fit(data_of(calls * per_call), epochs=1, verbose=0, callbacks=[callback])
        else:
            model.fit(data, epochs=1, steps_per_epoch=calls * per_call, verbose=0,
                      callbacks=[callback])
        times = [1000 * (b - a) / per_call for a, b in zip(stamps[3:], stamps[4:])]
        return {"variant": variant, "workload": workload, "ms_per_step": statistics.median(times),
                "first_step_s": first, "timed_steps": len(times) * per_call,
                "steps_per_execution": per_call}
    else:
        from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
        from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
        mesh_spec, table = (("batch=4,model=2", "mlp_model_parallel")
                            if variant.startswith("dtk_batch4_model2") else ("batch=8", "data_parallel"))
        mesh = _mesh(dtk, mesh_spec)
        start = time.perf_counter()
        model, _ = layouts.build_model(lambda: _model(tf_keras, hidden), mesh,
                                       layouts.load_table(table), seed=0, fsdp="_fsdp" in variant)
        steps_obj = dtk.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adam",
                              metrics=["accuracy"], mesh=mesh,
                              config=dtk.StepConfig(
                                  steps_per_execution=spe, shard_optimizer_state="_zero" in variant,
                                  remat=(r"d\d+",) if "_remat" in variant else ()))
        packed = (input_lib.pack(mesh, (x, y, w), stacked=True) if spe > 1
                  else input_lib.pack(mesh, (x[0], y[0], w[0])))
        build_s = time.perf_counter() - start
        first, times = _timed(lambda: steps_obj.train(packed), steps, per_call=spe)
        first += build_s
    return {"variant": variant, "workload": workload, "ms_per_step": statistics.median(times),
            "first_step_s": first, "timed_steps": len(times) * spe}


def _keras3_worker(variant: str, workload: str, spec: dict, steps: int) -> dict:
    """Keras 3's own ``fit`` (the ``keras`` package, TensorFlow backend) on one device, under
    MirroredStrategy, or on dtk's DataParallel (``dtk.enable_keras_distribution``): the MLP
    workloads with Adam and accuracy, the same data as the other variants; ms/step from the
    batch-end times of Keras's callbacks (one per compiled call)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if variant != "keras3_fit":
        _devices(dtk)
    import keras  # pylint: disable=g-import-not-at-top
    batch, hidden = spec["batch"], spec["hidden"]
    spe = 32 if variant == "keras3_dtk" else 1
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, (batch,)).astype(np.int64)

    def build():
        layers = [keras.Input((28, 28, 1)), keras.layers.Flatten()]
        layers += [keras.layers.Dense(u, activation="relu") for u in hidden]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
        model.compile(optimizer="adam", metrics=["accuracy"], steps_per_execution=spe,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if variant == "keras3_mirrored_fit":
        strategy = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(8)] if _device() == "cpu" else None)
        with strategy.scope():
            model = build()
    else:
        if variant.startswith("keras3_dtk"):
            dtk.enable_keras_distribution()
            keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = build()
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    stamps = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: (float(logs["loss"]),
                                            stamps.append(time.perf_counter())))
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=spe, verbose=0, callbacks=[callback])
    first = time.perf_counter() - start
    stamps.clear()
    calls = max(4, -(-steps // spe)) + 3
    model.fit(data, epochs=1, steps_per_epoch=calls * spe, verbose=0, callbacks=[callback])
    times = [1000 * (b - a) / spe for a, b in zip(stamps[2:], stamps[3:])]
    return {"variant": variant, "workload": workload, "ms_per_step": statistics.median(times),
            "first_step_s": first, "timed_steps": len(times) * spe, "steps_per_execution": spe}


def _lm_worker(variant: str, workload: str, spec: dict, steps: int) -> dict:
    """The LM workload: the plain single-device step (floor) or dtk Steps on a mesh."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    if variant not in ("floor", "dtk_batch8", "dtk_batch8_zero", "dtk_batch8_fsdp",
                       "dtk_batch8_fsdp_remat", "dtk_batch8_remat") and variant not in MESHES:
        raise SystemExit(f"variant {variant} does not apply to the lm workload")
    batch, seq = spec["batch"], spec["seq_len"]

    def factory():
        return models.transformer_lm(vocab=256, seq_len=seq, dim=spec["dim"],
                                     heads=spec["heads"], layers=spec["layers"],
                                     dropout=spec.get("dropout", 0.0),
                                     attention=spec.get("attention", "mha"),
                                     moe_experts=spec.get("moe_experts", 0),
                                     moe_group_size=32 if spec.get("moe_experts") else None)

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (batch, seq)).astype(np.int32)
    y = rng.integers(0, 256, (batch, seq)).astype(np.int64)
    if variant != "floor":
        _devices(dtk)
    tf_keras.utils.set_random_seed(0)
    start = time.perf_counter()
    if variant == "floor":
        step, _ = _floor_step(  # the dtk LM variants track no metric either
            tf, tf_keras, factory(),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), accuracy=False)
        xb, yb = tf.constant(x), tf.constant(y)
        first, times = _timed(lambda: step(xb, yb), steps)
    else:
        mesh = _mesh(dtk, MESHES.get(variant, "batch=8"))
        moe = spec.get("moe_experts")
        table = layouts.load_table(("transformer_lm_moe" if "expert" in mesh.dim_names
                                    else "transformer_lm_moe_batch") if moe else "transformer_lm")
        if variant.endswith("_nosp"):  # the same table without Megatron's sequence parallelism
            import dataclasses  # pylint: disable=g-import-not-at-top
            table = dataclasses.replace(table, sequence_parallel_axis=None)
        for suffix, mode in (("_gather", "all_gather"), ("_a2a", "all_to_all")):
            if variant.endswith(suffix):  # attention over the sharded sequence, fixed
                import dataclasses  # pylint: disable=g-import-not-at-top
                table = dataclasses.replace(table, sequence_attention=mode)
        model, _ = layouts.build_model(factory, mesh, table, seed=0, fsdp="_fsdp" in variant)
        if spec.get("keras_rng"):  # undo dtk.parallel.randomness: Keras's generator, per-device draws
            from tf_keras.src import backend  # pylint: disable=g-import-not-at-top
            for layer in model._flatten_layers():  # pylint: disable=protected-access
                if isinstance(getattr(layer, "_random_generator", None), backend.RandomGenerator):
                    layer._random_generator.__class__ = backend.RandomGenerator  # pylint: disable=protected-access
        steps_obj = dtk.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adam",
                              mesh=mesh, config=dtk.StepConfig(
                                  shard_optimizer_state="_zero" in variant,
                                  remat=models.MODEL_SPECS["lm"].remat if "_remat" in variant
                                  else ()))
        # The MoE LM's tokens arrive split along the sequence over expert (as train_lm.py packs).
        seq_axis = table.sequence_axis if moe and table.sequence_axis in mesh.dim_names else None
        packed = input_lib.pack(mesh, (x, y, np.ones(batch, np.float32)), sequence_axis=seq_axis)
        build_s = time.perf_counter() - start
        first, times = _timed(lambda: steps_obj.train(packed), steps)
        first += build_s
    ms = statistics.median(times)
    return {"variant": variant, "workload": workload, "ms_per_step": ms, "first_step_s": first,
            "timed_steps": len(times), "tokens_per_s": round(batch * seq / ms * 1000)}


def _recsys_worker(variant: str, workload: str, spec: dict, steps: int) -> dict:
    """The recommender: the plain single-device step (floor: tf_keras Adam, one device) or dtk
    Steps with its largest tables row-sharded (``dtk_batch4_model2``: over model; ``dtk_batch8``:
    over batch, ``recsys_batch_rows``). Adam's update is dense (every row of the tables and of
    their slots, every step); ``_sparse`` variants update the touched rows only (lazy Adam,
    ``dtk.train.sparse``)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.data import clicks  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    tables = {"dtk_batch4_model2": ("batch=4,model=2", "recsys"),
              "dtk_batch8": ("batch=8", "recsys_batch_rows")}
    sparse = variant.endswith("_sparse")
    variant_mesh = variant.removesuffix("_sparse")
    if variant != "floor" and variant_mesh not in tables:
        raise SystemExit(f"variant {variant} does not apply to the {workload} workload")
    sizes = (spec["rows"], 4096, 256, 16)
    log = clicks.ClickLog(clicks.ClickLogConfig(table_sizes=sizes))
    features, labels, _ = log.chunk("train", 0, spec["batch"])
    factory = lambda: models.dlrm(table_sizes=sizes, dim=16)  # noqa: E731
    if variant != "floor":
        _devices(dtk)
    tf_keras.utils.set_random_seed(0)
    start = time.perf_counter()
    if variant == "floor":
        model, opt = factory(), tf_keras.optimizers.Adam()
        loss_obj = tf_keras.losses.BinaryCrossentropy(from_logits=True)
        fb, yb = tf.nest.map_structure(tf.constant, features), tf.constant(labels)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_obj(yb, model(fb, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss

        first, times = _timed(step, steps)
    else:
        mesh_spec, table = tables[variant_mesh]
        mesh = _mesh(dtk, mesh_spec)
        model, _ = layouts.build_model(factory, mesh, table, seed=0)
        steps_obj = dtk.Steps(model, loss="binary_crossentropy", optimizer="adam", mesh=mesh,
                              config=dtk.StepConfig(shard_optimizer_state=False,
                                                    sparse_tables=sparse))
        packed = input_lib.pack(mesh, (features, labels, np.ones(spec["batch"], np.float32)))
        build_s = time.perf_counter() - start
        first, times = _timed(lambda: steps_obj.train(packed), steps)
        first += build_s
    return {"variant": variant, "workload": workload, "ms_per_step": statistics.median(times),
            "first_step_s": first, "timed_steps": len(times), "table_rows": spec["rows"]}


# -- breakdown (one process) ---------------------------------------------------------------------
def _breakdown(workload: str, iters: int) -> list[tuple[str, float]]:
    """Median ms per call of each piece of a step, all timed in this process, alternating."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top
    from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top

    spec = WORKLOADS[workload]
    batch, hidden = spec["batch"], spec["hidden"]
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    loss_obj = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def parts(model, loss_of, batch_args):
        """Forward+loss, and forward+backward+SGD (no optimizer state), as tf.functions."""
        @tf.function
        def forward(*b):
            return loss_of(model, *b)

        @tf.function
        def sgd(*b):
            with tf.GradientTape() as tape:
                loss = loss_of(model, *b)
            for v, g in zip(model.trainable_variables,
                            tape.gradient(loss, model.trainable_variables)):
                v.assign_sub(1e-3 * g)
            return loss
        return (lambda: forward(*batch_args)), (lambda: sgd(*batch_args))

    tf_keras.utils.set_random_seed(0)
    with tf.device("/cpu:0"):
        floor, plain = _floor_step(tf, tf_keras, _model(tf_keras, hidden), loss_obj)
        xb, yb = tf.constant(x), tf.constant(y)
    plain_fwd, plain_sgd = parts(plain, lambda m, a, b: loss_obj(b, m(a, training=True)), (xb, yb))

    mesh = dtk.build_mesh("batch=8")
    packed = input_lib.pack(mesh, (x, y, np.ones(batch, np.float32)))

    def dtk_steps(shard):
        model, _ = layouts.build_model(lambda: _model(tf_keras, hidden), mesh,
                                       layouts.load_table("data_parallel"), seed=0)
        return dtk.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adam",
                         metrics=["accuracy"], mesh=mesh,
                         config=dtk.StepConfig(shard_optimizer_state=shard))
    replicated, zero = dtk_steps(False), dtk_steps(True)
    dt_fwd, dt_sgd = parts(replicated.model,
                           lambda m, a, b, w: replicated._weighted_loss(  # pylint: disable=protected-access
                               b, m(a, training=True), w)[0], packed)
    # The gradient all-reduces alone: summing [8, *shape] batch-sharded partials of every weight.
    partials = [dtensor.call_with_layout(tf.ones, dtensor.Layout.batch_sharded(
        mesh, "batch", v.shape.rank + 1), shape=[8, *v.shape]) for v in plain.trainable_variables]

    @tf.function
    def all_reduce(ps):
        return tf.add_n([tf.reshape(tf.reduce_sum(p, axis=0), [-1])[0] for p in ps])

    pieces = {
        "floor: plain step, 1 device (Adam + accuracy)": lambda: floor(xb, yb),
        "plain forward + loss": plain_fwd,
        "plain forward + backward + SGD": plain_sgd,
        "dtk step, batch=8 (Adam + accuracy)": lambda: replicated.train(packed),
        "dtk step, batch=8, shard_optimizer_state": lambda: zero.train(packed),
        "DTensor forward + loss, batch=8": dt_fwd,
        "DTensor forward + backward + SGD, batch=8": dt_sgd,
        "DTensor gradient all-reduces alone, batch=8": lambda: all_reduce(partials),
    }
    for fn in pieces.values():  # trace and warm up
        for _ in range(3):
            float(fn())
    times = {name: [] for name in pieces}
    for _ in range(iters):
        for name, fn in pieces.items():
            start = time.perf_counter()
            float(fn())
            times[name].append(1000 * (time.perf_counter() - start))
    return [(name, statistics.median(t)) for name, t in times.items()]


def _print_breakdown(workload: str, iters: int) -> None:
    rows = _breakdown(workload, iters)
    floor = rows[0][1]
    print(f"{workload}: {iters} alternating calls of each piece, one process, 8 virtual CPUs")
    print(f"{'ms/call':>9} {'x floor':>8}  piece")
    for name, ms in rows:
        print(f"{ms:9.2f} {ms / floor:8.2f}  {name}")
    for name, ms in rows:
        print(json.dumps({"workload": workload, "piece": name, "ms": round(ms, 3),
                          "ratio_to_floor": round(ms / floor, 3)}))


# -- driver ---------------------------------------------------------------------------------------
def _run_worker(variant: str, workload: str, steps: int) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--workloads", workload,
           "--steps", str(steps)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "workload": workload, "error": f"timeout {WORKER_TIMEOUT_S}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"variant": variant, "workload": workload, "error": f"exit {proc.returncode}: {tail}"}


def _summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        floors = [r["ms_per_step"] for r in mine if r["variant"] == "floor" and "error" not in r]
        floor = statistics.median(floors) if floors else None
        for variant in dict.fromkeys(r["variant"] for r in mine):
            ok = [r for r in mine if r["variant"] == variant and "error" not in r]
            errors = [r["error"] for r in mine if r["variant"] == variant and "error" in r]
            row = {"workload": workload, "variant": variant, "runs": len(ok)}
            if ok:
                ms = statistics.median(r["ms_per_step"] for r in ok)
                row.update(ms_per_step=round(ms, 3),
                           first_step_s=round(statistics.median(r["first_step_s"] for r in ok), 3),
                           ratio_to_floor=round(ms / floor, 2) if floor else None)
                if all("tokens_per_s" in r for r in ok):
                    row["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in ok))
            if errors:
                row["errors"] = errors
            rows.append(row)
    return rows


def _default_vs_mirrored(rows: list[dict]) -> list[str]:
    """One line per workload: how much faster dtk is than MirroredStrategy's fit: the headline
    is Keras's own fit on a dtk.distribute model, then dtk's Trainer step with its defaults."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ms = {r["variant"]: r.get("ms_per_step") for r in rows if r["workload"] == workload}
        if ms.get("dtk_fit") and ms.get("mirrored_fit"):
            lines.append(f"{workload}: Keras fit on dtk.distribute {ms['dtk_fit']:.2f} ms/step vs "
                         f"MirroredStrategy fit {ms['mirrored_fit']:.2f} ms/step: "
                         f"{ms['mirrored_fit'] / ms['dtk_fit']:.2f}x faster")
        if ms.get("dtk_default") and ms.get("mirrored_fit"):
            lines.append(f"{workload}: dtk default {ms['dtk_default']:.2f} ms/step vs "
                         f"MirroredStrategy fit {ms['mirrored_fit']:.2f} ms/step: "
                         f"{ms['mirrored_fit'] / ms['dtk_default']:.2f}x faster")
    return lines


def _table(rows: list[dict]) -> str:
    lines = [f"{'workload':8} {'variant':18} {'ms/step':>9} {'x floor':>8} {'first step s':>12}  what"]
    for r in rows:
        if "ms_per_step" in r:
            ratio = f"{r['ratio_to_floor']:.2f}" if r["ratio_to_floor"] else "-"
            tokens = f" ({r['tokens_per_s']:,} tokens/s)" if "tokens_per_s" in r else ""
            lines.append(f"{r['workload']:8} {r['variant']:18} {r['ms_per_step']:9.2f} {ratio:>8} "
                         f"{r['first_step_s']:12.2f}  {VARIANTS[r['variant']]}{tokens}")
        else:
            lines.append(f"{r['workload']:8} {r['variant']:18} failed: {r['errors'][0]}")
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        print("--plot needs matplotlib: pip install -e '.[bench]'", file=sys.stderr)
        return
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload and r.get("ratio_to_floor")]
        ax.bar([r["variant"] for r in mine], [r["ratio_to_floor"] for r in mine])
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"{workload}: ms/step relative to the single-device floor")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path)
    print(f"chart: {path}")


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,heavy", help="comma-separated: " + ", ".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every variant, alternating")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--json_out", default=None, help="also write the JSON lines to this file")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here (matplotlib)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the pieces of one step in one process instead")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "tpu"),
                        help="cpu: 8 virtual CPUs; gpu/tpu: the machine's accelerators (meshes "
                        "scaled to their number; scripts/accelerator_check.py)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name, known in (("workload", WORKLOADS), ("variant", VARIANTS)):
        bad = [v for v in (workloads if name == "workload" else variants) if v not in known]
        if bad:
            parser.error(f"unknown {name}(s) {bad}; choose from {', '.join(known)}")
    if args.breakdown:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads
        for workload in workloads:
            _print_breakdown(workload, args.steps or int(2.5 * WORKLOADS[workload]["steps"]))
        return 0
    os.environ[DEVICE_ENV] = args.device  # the workers inherit it
    if args.worker:
        print(json.dumps(_worker(args.worker, workloads[0],
                                 args.steps or WORKLOADS[workloads[0]]["steps"])))
        return 0
    if "floor" not in variants:
        variants.insert(0, "floor")
    runs = []
    for repeat in range(args.repeats):
        for workload in workloads:
            for variant in variants:
                result = _run_worker(variant, workload, args.steps or WORKLOADS[workload]["steps"])
                result["repeat"] = repeat
                runs.append(result)
                print(f"  {workload:6} {variant:18} "
                      f"{result.get('ms_per_step', float('nan')):9.2f} ms/step "
                      f"{result.get('error', '')}", file=sys.stderr, flush=True)
    rows = _summarize(runs)
    print(_table(rows))
    for line in _default_vs_mirrored(rows):
        print(line)
    for row in rows:
        print(json.dumps(row))
    if args.json_out:
        with open(args.json_out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
