"""keras.io's examples (tests/keras_io_zoo.py) through dtk against plain ``model.fit``: ms per step.

    python scripts/keras_io_zoo.py                          # every example (a few minutes)
    python scripts/keras_io_zoo.py --examples unet,vae --steps 16 --json zoo.json

For each example: the factory's model compiled as its page writes it, trained with plain
``model.fit`` on one device and with ``dtk.Trainer`` on ``batch=8`` (8 virtual CPUs; the
factory's optimizer, loss and metrics), ``--epochs`` epochs of ``--steps`` steps of the zoo's
global batch; ms per step is the median over the epochs after the first (tracing). Parity
(``batch=8`` and ``batch=4,model=2`` against ``batch=1``), resume and export are checked by
``tests/test_keras_io.py``, which CI runs.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from dtk import usage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAGS = flags.FLAGS
flags.DEFINE_string("examples", None, "Comma-separated example names (default: all).")
flags.DEFINE_integer("steps", 8, "Steps per epoch.")
flags.DEFINE_integer("epochs", 3, "Epochs (the first is left out of the timing).")
flags.DEFINE_string("json", None, "Write the rows as JSON here.")


def _repeat(x, times):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.nest.map_structure(lambda a: np.concatenate([a] * times), x)


def _plain_ms(example, x, y, batch) -> float:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top

    class Clock(tf_keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(time.perf_counter() - self.start)

    tf_keras.utils.set_random_seed(7)
    model = example.factory()
    clock = Clock()
    model.fit(x, y, batch_size=batch, epochs=FLAGS.epochs, shuffle=False, verbose=0,
              callbacks=[clock])
    return 1000 * float(np.median(clock.epochs[1:])) / FLAGS.steps


def _dtk_ms(dtk, example, x, y, batch) -> float:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    mesh = dtk.build_mesh("batch=8")
    trainer = dtk.Trainer(mesh=mesh, model=example.factory, layout="data_parallel",
                          allow_replicated=True, input_shape=example.input_shape,
                          config=dtk.TrainerConfig(seed=7, verbose=0))
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                  dtk.InputConfig(global_batch_size=batch))
    trainer.fit(data, epochs=FLAGS.epochs)
    return trainer.timing.ms_per_step_median(skip_epoch=0)


def main(argv):
    del argv
    from dtk import cli  # pylint: disable=g-import-not-at-top
    cli.setup_output(verbose=FLAGS["verbosity"].present)
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    from tests import keras_io_zoo as zoo  # pylint: disable=g-import-not-at-top
    names = FLAGS.examples.split(",") if FLAGS.examples else list(zoo.EXAMPLES)
    unknown = sorted(set(names) - set(zoo.EXAMPLES))
    if unknown:
        print(f"error: unknown --examples {unknown}; choose from {sorted(zoo.EXAMPLES)}",
              file=sys.stderr)
        return 2
    print(f"{'example':<36} {'plain fit':>10} {'dtk batch=8':>12} {'ratio':>6}", flush=True)
    rows = []
    for name in names:
        example = zoo.EXAMPLES[name]
        x, y = example.data()
        x, y = _repeat(x, FLAGS.steps // zoo.N or 1), _repeat(y, FLAGS.steps // zoo.N or 1)
        row = {"example": name, "page": example.page}
        try:
            row["ms_plain_fit"] = _plain_ms(example, x, y, zoo.B)
            row["ms_dtk_batch8"] = _dtk_ms(dtk, example, x, y, zoo.B)
            row["ratio"] = row["ms_dtk_batch8"] / row["ms_plain_fit"]
            print(f"{name:<36} {row['ms_plain_fit']:>10.1f} {row['ms_dtk_batch8']:>12.1f} "
                  f"{row['ratio']:>5.1f}x", flush=True)
        except Exception as e:  # pylint: disable=broad-except
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{name:<36} error: {row['error']}", flush=True)
        rows.append(row)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    usage.run_app(lambda argv: sys.exit(main(argv)))
