"""Step time around checkpoint saves, synchronous against asynchronous, on the language model.

    python scripts/bench_checkpoint.py                      # dim 512, 4 blocks, batch=8
    python scripts/bench_checkpoint.py --dim 1024 --mesh batch=4,model=2

Trains the LM for a few epochs with a save at every epoch end, once with synchronous saves and
once with ``--async_checkpoints`` (``TrainerConfig(async_checkpoints=True)``), in one process.
Every step is timed to its loss (the host waits for it), so the figures are wall-clock step
times: ``steady`` is the median of steps far from a save; ``save stall`` is how much longer
than that the interval holding a save took (the time training did not progress), summed over
the saves; ``during write`` is the mean step time while an asynchronous write was in flight.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time

from absl import flags

from dtk import usage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

flags.DEFINE_string("mesh", "batch=8", "Mesh.")
flags.DEFINE_integer("dim", 512, "Model width.")
flags.DEFINE_integer("layers", 4, "Transformer blocks.")
flags.DEFINE_integer("seq_len", 64, "Tokens per window.")
flags.DEFINE_integer("global_batch_size", 16, "Windows per step.")
flags.DEFINE_integer("steps_per_epoch", 12, "Steps between saves.")
flags.DEFINE_integer("epochs", 4, "Epochs (one save at the end of each).")
FLAGS = flags.FLAGS


def _run(asynchronous: bool) -> dict[str, float]:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top

    mesh = dtk.build_mesh(FLAGS.mesh)
    n = FLAGS.steps_per_epoch * FLAGS.global_batch_size
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, FLAGS.seq_len)).astype(np.int32)
    data = input_lib.DistributedDataset(
        tf.data.Dataset.from_tensor_slices((x, np.roll(x, -1, axis=1).astype(np.int64))), mesh,
        input_lib.InputConfig(global_batch_size=FLAGS.global_batch_size, shuffle=True, seed=1))
    factory = functools.partial(models.transformer_lm, vocab=256, seq_len=FLAGS.seq_len,
                                dim=FLAGS.dim, heads=8, layers=FLAGS.layers)
    directory = tempfile.mkdtemp(prefix="dtk-bench-ckpt-")
    trainer = dtk.Trainer(
        mesh=mesh, model=factory, layout="transformer_lm",
        optimizer=dtk.make_optimizer("adamw", mesh, learning_rate=1e-3),
        loss="sparse_categorical_crossentropy",
        config=dtk.TrainerConfig(seed=0, verbose=0, steps_per_execution=1,
                                 checkpoint_dir=directory, async_checkpoints=asynchronous))
    times, writing = [], []

    def on_step(step):
        int(trainer.optimizer.iterations.numpy())  # wait for the step
        times.append(time.perf_counter())
        writing.append(trainer.checkpoint_callback.saving)
    trainer.fit(data, epochs=FLAGS.epochs, on_step_end=[on_step])
    intervals = np.diff(times)
    spe = FLAGS.steps_per_epoch
    # interval i runs from step i+1 to step i+2; a save happens after steps spe, 2*spe, ...
    after_save = {e * spe - 1 for e in range(1, FLAGS.epochs)}
    near = after_save | {i + 1 for i in after_save}
    steady = statistics.median(float(d) for i, d in enumerate(intervals) if i not in near and i)
    stall = sum(max(0.0, float(intervals[i]) - steady) for i in sorted(after_save))
    during = [float(d) for i, d in enumerate(intervals) if writing[i + 1] and i not in after_save]
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if ".data-" in f) / max(1, len([f for f in os.listdir(directory) if f.endswith(".index")]))
    return {"steady_ms": steady * 1e3, "save_stall_ms": stall * 1e3 / max(1, len(after_save)),
            "during_write_ms": (statistics.mean(during) * 1e3) if during else float("nan"),
            "steps_during_write": len(during), "checkpoint_mib": size / 2**20}


def main(argv):
    del argv
    os.environ.setdefault("DTK_VIRTUAL_DEVICES", "8")
    rows = {name: _run(asynchronous) for name, asynchronous in (("sync", False), ("async", True))}
    print(f"LM dim {FLAGS.dim} x {FLAGS.layers} blocks on {FLAGS.mesh}, a save every "
          f"{FLAGS.steps_per_epoch} steps ({rows['sync']['checkpoint_mib']:.1f} MiB each)")
    print(f"{'saves':<6} {'steady ms/step':>15} {'stall per save ms':>18} "
          f"{'ms/step during write':>21} {'steps during write':>19}")
    for name, r in rows.items():
        print(f"{name:<6} {r['steady_ms']:>15.1f} {r['save_stall_ms']:>18.1f} "
              f"{r['during_write_ms']:>21.1f} {r['steps_during_write']:>19d}")
    return 0


if __name__ == "__main__":
    usage.run_app(main)
