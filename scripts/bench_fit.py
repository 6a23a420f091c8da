"""Keras's own ``fit`` on a ``dtk.distribute`` model against ``dtk.Trainer``: ms/step on the MLP.

    python scripts/bench_fit.py                       # batch=8, global batch 128, 2 repeats
    python scripts/bench_fit.py --mesh batch=4,model=2 --layout mlp_model_parallel
    python scripts/bench_fit.py --steps_per_execution 10

Both train the MNIST MLP (``dtk.models.mnist_mlp``) with Adam on the same synthetic MNIST-shaped
data, the same steps per call for both (``--steps_per_execution``, 1 by default), for ``--steps`` steps a run, in one
process, alternating (Trainer, fit, Trainer, fit, ...) so that a busy machine slows both alike.
A run's ms/step is its wall time after its first epoch (tracing) over the steps of the later
epochs; the first step's seconds are reported too. Prints one JSON line per run and the ratio of
the medians (fit / Trainer).
"""

from __future__ import annotations

import json
import statistics
import time

from dtk import usage


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="batch=8", help="mesh spec, e.g. batch=4,model=2")
    parser.add_argument("--layout", default="data_parallel", help="layout table")
    parser.add_argument("--global_batch_size", type=int, default=128, help="examples per step")
    parser.add_argument("--steps", type=int, default=100, help="timed steps a run (one epoch)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--steps_per_execution", type=int, default=1,
                        help="steps per compiled call, for both")
    args = parser.parse_args()
    if min(args.global_batch_size, args.steps, args.repeats, args.steps_per_execution) < 1:
        parser.error("--global_batch_size, --steps, --repeats and --steps_per_execution must be "
                     "positive")

    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    mesh = dtk.build_mesh(args.mesh)
    n = args.global_batch_size * args.steps
    rng = np.random.default_rng(0)
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)

    def trainer_run():
        trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp, layout=args.layout,
                              optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3),
                              config=dtk.TrainerConfig(seed=0, verbose=0,
                                                       steps_per_execution=args.steps_per_execution))
        data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                      dtk.InputConfig(global_batch_size=args.global_batch_size,
                                                      steps_per_call=args.steps_per_execution))
        marks = []
        start = time.perf_counter()
        trainer.fit(data, epochs=2, on_epoch_end=[lambda *_: marks.append(time.perf_counter())])
        return trainer.timing.first_step_s, (marks[1] - marks[0]) / args.steps, start

    def fit_run():
        model = dtk.distribute(dtk.models.mnist_mlp, mesh, layout=args.layout, seed=0)
        import tf_keras  # pylint: disable=g-import-not-at-top
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=args.steps_per_execution)
        marks = []
        first = []

        class Marks(tf_keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if not first:
                    first.append(time.perf_counter())

            def on_train_batch_end(self, batch, logs=None):
                if len(first) == 1:
                    first.append(time.perf_counter())

            def on_epoch_end(self, epoch, logs=None):
                marks.append(time.perf_counter())

        start = time.perf_counter()
        model.fit(x, y, batch_size=args.global_batch_size, epochs=2, shuffle=False, verbose=0,
                  callbacks=[Marks()])
        return first[1] - first[0], (marks[1] - marks[0]) / args.steps, start

    results = {"trainer": [], "fit": []}
    for repeat in range(args.repeats):
        for name, run in (("trainer", trainer_run), ("fit", fit_run)):
            first_s, step_s, _ = run()
            results[name].append(step_s * 1e3)
            print(json.dumps({"run": name, "repeat": repeat, "mesh": args.mesh,
                              "steps_per_execution": args.steps_per_execution,
                              "ms_per_step": round(step_s * 1e3, 2),
                              "first_step_s": round(first_s, 2)}), flush=True)
    ratio = statistics.median(results["fit"]) / statistics.median(results["trainer"])
    print(json.dumps({"fit_over_trainer": round(ratio, 3),
                      "trainer_ms_median": round(statistics.median(results["trainer"]), 2),
                      "fit_ms_median": round(statistics.median(results["fit"]), 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
