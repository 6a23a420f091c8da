"""Micro-benchmark: packing a global batch vs the MNIST MLP's train step, on a mesh.

    python scripts/bench_input.py --mesh batch=8 --global_batch_size 128

Prints the median time to build one global batch (numpy gather + pack into DTensors), per batch
and per stacked group of ``--steps_per_call`` batches, next to the median time of one dtk train
step on pre-packed data, and the time per step of a ``fit``-style loop that takes its batches from
``DistributedDataset`` (packing in the background thread) vs from pre-packed ones. Packing is off
the critical path when the last two agree.
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags

_MESH = flags.DEFINE_string("mesh", "batch=8", "Mesh spec.")
_BATCH = flags.DEFINE_integer("global_batch_size", 128, "Global batch size.")
_SPC = flags.DEFINE_integer("steps_per_call", 10, "Batches per stacked group.")
_STEPS = flags.DEFINE_integer("steps", 60, "Timed steps per measurement.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "MNIST IDX directory (default: random data).")


def _median_ms(fn, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv):
    del argv
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk import layouts, models  # pylint: disable=g-import-not-at-top

    mesh = dtk.build_mesh(_MESH.value)
    print(dtk.describe_mesh(mesh))
    if _DATA_DIR.value:
        raw = input_lib.load_mnist("train", source="idx", data_dir=_DATA_DIR.value)
    else:
        rng = np.random.default_rng(0)
        raw = tf.data.Dataset.from_tensor_slices(
            (rng.random((8192, 28, 28, 1), dtype=np.float32),
             rng.integers(0, 10, 8192).astype(np.int64)))
    config = input_lib.InputConfig(global_batch_size=_BATCH.value, shuffle=True, prefetch=0)
    data = input_lib.DistributedDataset(raw, mesh, config)
    order = data._order(0)  # pylint: disable=protected-access

    def pack_one():
        batch = data._global_batch(order, 0)  # pylint: disable=protected-access
        packed = input_lib.pack(mesh, batch)
        float(tf.reduce_sum(packed[2]))  # wait until the copies are done

    stacked = input_lib.DistributedDataset(raw, mesh, input_lib.InputConfig(
        global_batch_size=_BATCH.value, steps_per_call=_SPC.value, prefetch=0))

    def pack_group():
        float(tf.reduce_sum(next(stacked.epoch(0)).weights))

    pack_ms = _median_ms(pack_one, 30)
    group_ms = _median_ms(pack_group, 10)

    model, _ = layouts.build_model(models.mnist_mlp, mesh, layouts.load_table("data_parallel"),
                                   seed=0)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adam",
                      metrics=["accuracy"], mesh=mesh)
    fixed = next(data.epoch(0))
    float(steps.train(fixed))
    step_ms = _median_ms(lambda: float(steps.train(fixed)), _STEPS.value)

    def loop(source, n):
        start = time.perf_counter()
        count = 0
        for batch in source:
            loss = steps.train(batch)
            count += 1
            if count == n:
                break
        float(loss)
        return 1000 * (time.perf_counter() - start) / count

    n = min(_STEPS.value, data.num_batches)
    prepacked = list(data.epoch(1))[:n]
    loop(prepacked, n)
    prepacked_ms = loop(prepacked, n)
    background = input_lib.DistributedDataset(raw, mesh, input_lib.InputConfig(
        global_batch_size=_BATCH.value, shuffle=True, prefetch=2))
    loop(background.epoch(0), n)
    streamed_ms = loop(background.epoch(1), n)
    inline = input_lib.DistributedDataset(raw, mesh, config)
    inline_ms = loop(inline.epoch(1), n)

    print(f"pack one global batch ({_BATCH.value}):         {pack_ms:7.3f} ms")
    print(f"pack a stack of {_SPC.value} batches:             {group_ms:7.3f} ms "
          f"({group_ms / _SPC.value:.3f} ms per batch)")
    print(f"train step, synchronized, pre-packed:      {step_ms:7.3f} ms")
    print(f"loop, pre-packed batches:                  {prepacked_ms:7.3f} ms/step")
    print(f"loop, packed in the background (prefetch): {streamed_ms:7.3f} ms/step")
    print(f"loop, packed inline (prefetch=0):          {inline_ms:7.3f} ms/step")


if __name__ == "__main__":
    app.run(main)
