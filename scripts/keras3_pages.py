"""keras.io's Keras 3 pages (``tests/keras3_pages.py``): plain Keras 3 on one device against
``dtk.enable_keras_distribution`` on a ``(8, 1)`` data x model mesh, in one process.

    python scripts/keras3_pages.py                 # every page: a markdown table row each
    python scripts/keras3_pages.py --pages gan_custom_train_step,seq2seq

For each page: its fit run plainly, then under ``ModelParallel`` on 8 devices (the test's
distribution), each fit twice (the first traces); ms/step is the median time between Keras's
batch-end callbacks of the second fit, and "largest difference" the largest relative
difference of its logged numbers and weights to the plain run's (pages with random draws:
dtk's draws are not TensorFlow's, so that column says so). Run from a checkout.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dtk.usage import ArgumentParser  # noqa: E402  (the one-line error convention)


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="", help="comma-separated page names (default: all)")
    args = parser.parse_args()
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.enable_keras_distribution(virtual_devices=8)
    import keras  # pylint: disable=g-import-not-at-top
    from tests import keras3_pages  # pylint: disable=g-import-not-at-top
    from tests import test_keras3_pages as harness  # pylint: disable=g-import-not-at-top
    names = [n for n in args.pages.split(",") if n] or sorted(keras3_pages.PAGES)
    unknown = [n for n in names if n not in keras3_pages.PAGES]
    if unknown:
        parser.error(f"unknown page(s) {unknown}; known: {', '.join(sorted(keras3_pages.PAGES))}")

    def timed(name, shape):
        stamps = []
        stamp = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs: stamps.append(time.perf_counter()))
        harness._run(name, shape)  # pylint: disable=protected-access  (traces)
        _, history, _, weights = harness._run(name, shape, callbacks=[stamp], prebuild=False)  # pylint: disable=protected-access
        steps = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
        return history, weights, statistics.median(steps)

    print("| page | scaled down | plain ms/step | (8, 1) ms/step | largest difference |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        page = keras3_pages.PAGES[name]
        plain_history, plain_weights, plain_ms = timed(name, None)
        history, weights, ms = timed(name, (8, 1))
        if page.random:
            diff = "random draws (dtk's, equal on every mesh)"
        else:
            values = [(np.asarray(plain_history[k], np.float64), np.asarray(history[k], np.float64))
                      for k in plain_history] + [(np.asarray(a, np.float64), np.asarray(b, np.float64))
                                                 for a, b in zip(plain_weights, weights)]
            worst = max(float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-3)))
                        for a, b in values)
            diff = f"{worst:.1e}"
        print(f"| {page.title} | {page.changed} | {plain_ms:.1f} | {ms:.1f} | {diff} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
