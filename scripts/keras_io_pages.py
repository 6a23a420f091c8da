"""keras.io's acceptance pages (tests/keras_io_fit_pages.py) through Keras's own ``fit``: plain
tf_keras against ``dtk.distribute`` on ``batch=8``, ms per step and the largest difference.

    python scripts/keras_io_pages.py                        # every page (a few minutes)
    python scripts/keras_io_pages.py --pages vit,dcgan --json pages.json

Each page's model is built and compiled as its page writes it and trained by ``model.fit`` with
the page's own arguments (callbacks, class weights, validation), once plain on one device and
once with the one line ``dtk.distribute`` on ``batch=8`` (8 virtual CPUs). ms per step is the
training part of each epoch after the first (tracing) over its steps, the median over those
epochs. The difference is the largest over every logged number: from plain tf_keras, or, for a
page that draws random numbers in training, from ``dtk.distribute`` on ``batch=1`` (plain
tf_keras draws other numbers). ``tests/test_keras_io.py::test_keras_io_fit_page`` asserts the
agreement on ``batch=1``, ``batch=8`` and ``batch=4,model=2`` in CI.
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
flags.DEFINE_string("pages", None, "Comma-separated page names (default: all).")
flags.DEFINE_string("json", None, "Write the rows as JSON here.")


def _clock():
    import tf_keras  # pylint: disable=g-import-not-at-top

    class Clock(tf_keras.callbacks.Callback):
        """The training part of each epoch (validation left out) and its steps."""

        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.steps, self.end = time.perf_counter(), 0, None

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            self.end = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if self.steps:
                self.epochs.append((self.end - self.start) / self.steps)

    return Clock()


def _fit(page, spec):
    from tests import keras_io_fit_pages as pages  # pylint: disable=g-import-not-at-top
    model = pages.model_for(page, spec)
    kwargs = page.fit()
    clock = _clock()
    kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), clock]
    history = model.fit(**kwargs).history
    timed = clock.epochs[1:] or clock.epochs
    return history, 1000 * sorted(timed)[len(timed) // 2]


def _largest_difference(got, want) -> float:
    import numpy as np  # pylint: disable=g-import-not-at-top
    return max(float(np.max(np.abs(np.asarray(got[k], float) - np.asarray(want[k], float))))
               for k in want)


def main(argv):
    del argv
    from dtk import cli  # pylint: disable=g-import-not-at-top
    cli.setup_output(verbose=FLAGS["verbosity"].present)
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    from tests import keras_io_fit_pages as pages  # pylint: disable=g-import-not-at-top
    names = FLAGS.pages.split(",") if FLAGS.pages else list(pages.PAGES)
    unknown = sorted(set(names) - set(pages.PAGES))
    if unknown:
        print(f"error: unknown --pages {unknown}; choose from {sorted(pages.PAGES)}",
              file=sys.stderr)
        return 2
    print(f"{'page':<26} {'plain ms/step':>13} {'batch=8 ms/step':>15} {'largest diff':>13} "
          f"{'against':>8}", flush=True)
    rows = []
    for name in names:
        page = pages.PAGES[name]
        row = {"page": name, "title": page.page, "changed": page.changed}
        try:
            plain, row["ms_plain"] = _fit(page, "plain")
            ours, row["ms_batch8"] = _fit(page, "batch=8")
            if page.draws:
                row["against"] = "batch=1"
                row["largest_difference"] = _largest_difference(ours, _fit(page, "batch=1")[0])
            else:
                row["against"] = "plain"
                row["largest_difference"] = _largest_difference(ours, plain)
            print(f"{name:<26} {row['ms_plain']:>13.1f} {row['ms_batch8']:>15.1f} "
                  f"{row['largest_difference']:>13.1e} {row['against']:>8}", flush=True)
        except Exception as e:  # pylint: disable=broad-except
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{name:<26} error: {row['error']}", flush=True)
        rows.append(row)
    if FLAGS.json:
        with open(FLAGS.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    usage.run_app(lambda argv: sys.exit(main(argv)))
