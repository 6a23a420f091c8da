"""The model zoo: real Keras models through dtk, one row each, as a user would bring them.

    python scripts/zoo.py                        # every model (about 20 minutes on 2 cores)
    python scripts/zoo.py --models lstm,gru      # some
    python scripts/zoo.py --steps 6 --json zoo.json

For each model: ``--steps`` Adam steps with dtk on ``batch=1``, ``batch=8`` and ``batch=4,model=2``
(the data-parallel table; every weight replicated over ``model``), the relative loss difference
against ``batch=1`` at the first step and the largest over all steps (deep networks with
BatchNormalization amplify the summation-order differences of the batch statistics step after
step, as they amplify fused vs unfused kernels on one device), dtk's ms/step on ``batch=8`` against plain ``model.fit`` on one
device, and on ``batch=4,model=2``: a run stopped halfway and resumed from its checkpoint against an
uninterrupted one (weights bit-identical), and an export whose predictions match the trained model.

Applications: ``tf_keras.applications`` with ``weights=None`` at 32x32x3 (their smallest input),
MobileNetV2 at alpha 0.35; EfficientNetB0 without its dropout: dtk's dropout draws the same masks on
every mesh (``dtk.parallel.randomness``), but not plain ``model.fit``'s masks, which the zoo
compares against.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from absl import flags

from dtk import usage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAGS = flags.FLAGS
flags.DEFINE_string("models", None, "Comma-separated model names (default: all).")
flags.DEFINE_integer("steps", 4, "Training steps per run.")
flags.DEFINE_integer("global_batch_size", 16, "Global batch size.")
flags.DEFINE_string("json", None, "Write the rows as JSON here.")

MESHES = ("batch=1", "batch=8", "batch=4,model=2")


def _models():
    import tf_keras  # pylint: disable=g-import-not-at-top
    from tf_keras.src.applications import efficientnet  # pylint: disable=g-import-not-at-top
    from tests import test_user_models as stacks  # pylint: disable=g-import-not-at-top
    L = tf_keras.layers  # pylint: disable=invalid-name

    def transformer():
        inputs = tf_keras.Input((8, 16))
        x = L.LayerNormalization()(inputs + L.MultiHeadAttention(2, 8)(inputs, inputs))
        x = L.LayerNormalization()(x + L.Dense(16)(L.Dense(32, activation="gelu")(x)))
        return tf_keras.Model(inputs, L.Dense(4)(L.GlobalAveragePooling1D()(x)))

    def conv1d():
        inputs = tf_keras.Input((16, 4))
        x = L.Conv1D(8, 3, activation="relu")(inputs)
        return tf_keras.Model(inputs, L.Dense(4)(L.GlobalMaxPooling1D()(L.Conv1D(8, 3)(x))))

    image = (32, 32, 3)
    return {
        "MobileNetV2": (lambda: tf_keras.applications.MobileNetV2(
            input_shape=image, alpha=0.35, weights=None, classes=4,
            classifier_activation=None), image, 1e-4),
        "DenseNet121": (lambda: tf_keras.applications.DenseNet121(
            input_shape=image, weights=None, classes=4, classifier_activation=None), image, 1e-4),
        "EfficientNetB0": (lambda: efficientnet.EfficientNet(
            1.0, 1.0, 224, dropout_rate=0.0, drop_connect_rate=0.0, model_name="efficientnetb0",
            weights=None, input_shape=image, classes=4, classifier_activation=None), image, 1e-4),
        "ResNet50": (lambda: tf_keras.applications.ResNet50(
            input_shape=image, weights=None, classes=4, classifier_activation=None), image,
                     1e-4),
        "mobilenet_blocks": (stacks.mobilenet_blocks, (12, 12, 3), 1e-5),
        "densenet_blocks": (stacks.densenet_blocks, (12, 12, 3), 1e-5),
        "lstm": (stacks.lstm_stack, (6, 4), 1e-5),
        "gru": (stacks.gru_stack, (6, 4), 1e-5),
        "normalization_adapted": (stacks.normalization_adapted, (12, 12, 3), 1e-5),
        "normalization_given": (stacks.normalization_given, (12, 12, 3), 1e-5),
        "transformer_encoder": (transformer, (8, 16), 1e-5),
        "conv1d": (conv1d, (16, 4), 1e-5),
    }


def _data(shape, steps, batch):
    import numpy as np  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(0)
    x = (rng.random((steps * batch, *shape)) * 4).astype(np.float32)
    return x, rng.integers(0, 4, steps * batch).astype(np.int64)


def _plain_fit_ms(factory, x, y, batch) -> float:
    """ms per step of plain ``model.fit`` on one device (after a warm-up epoch)."""
    import tf_keras  # pylint: disable=g-import-not-at-top
    tf_keras.utils.set_random_seed(2)
    model = factory()
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return 1000 * (time.perf_counter() - start) / (len(x) // batch)


def _trainer(dtk, factory, mesh, checkpoint_dir=None, max_steps=None):
    import tf_keras  # pylint: disable=g-import-not-at-top
    return dtk.Trainer(
        mesh=mesh, model=factory, layout="data_parallel", allow_replicated=True,
        optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3), metrics=[],
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        config=dtk.TrainerConfig(seed=2, verbose=0, steps_per_execution=1, max_steps=max_steps,
                                 checkpoint_dir=checkpoint_dir))


def _row(dtk, name, factory, shape, tolerance):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    steps, batch = FLAGS.steps, FLAGS.global_batch_size
    x, y = _data(shape, steps, batch)
    row = {"model": name}
    try:
        losses, ms = {}, {}
        for spec in MESHES:
            mesh = dtk.build_mesh(spec)
            model, _ = dtk.build_model(factory, mesh, "data_parallel", seed=2,
                                       allow_replicated=True)
            step = dtk.Steps(model, loss=tf_keras.losses.SparseCategoricalCrossentropy(
                from_logits=True), optimizer=tf_keras.optimizers.Adam(1e-3, mesh=mesh),
                             mesh=mesh)
            w = np.ones(batch, np.float32)
            out, times = [], []
            for i in range(steps):
                start = time.perf_counter()
                out.append(float(step.train(input_lib.pack(
                    mesh, (x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch], w)))))
                times.append(time.perf_counter() - start)
            losses[spec], ms[spec] = out, 1000 * float(np.median(times[1:]))
        base = np.array(losses["batch=1"])
        row["losses"] = losses
        row["trains"] = bool(np.all(np.isfinite(base)))
        row["step1_rel_diff"] = {s: float(abs(losses[s][0] - base[0]) / abs(base[0]))
                                 for s in MESHES[1:]}
        row["max_rel_diff"] = {s: float(np.max(np.abs(np.array(losses[s]) - base) / np.abs(base)))
                               for s in MESHES[1:]}
        row["parity"] = all(v <= tolerance for v in row["max_rel_diff"].values())
        row["ms_per_step_batch8"] = ms["batch=8"]
        row["ms_per_step_plain_fit"] = _plain_fit_ms(factory, x, y, batch)
        row["ratio_vs_plain_fit"] = row["ms_per_step_batch8"] / row["ms_per_step_plain_fit"]

        mesh = dtk.build_mesh("batch=4,model=2")
        data = input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                            input_lib.InputConfig(global_batch_size=batch))
        whole = _trainer(dtk, factory, mesh, max_steps=steps)
        whole.fit(data, epochs=1)
        with tempfile.TemporaryDirectory() as tmp:
            _trainer(dtk, factory, mesh, tmp, max_steps=steps // 2).fit(data, epochs=1)
            resumed = _trainer(dtk, factory, mesh, tmp, max_steps=steps)
            resumed.fit(data, epochs=1)
            row["resume_exact"] = all(np.array_equal(a, b) for a, b in zip(
                dtk.gather_weights(resumed.model), dtk.gather_weights(whole.model)))
            paths = resumed.export(os.path.join(tmp, "export"))
            loaded = tf_keras.models.load_model(paths["keras"])
            want = resumed.predict(input_lib.DistributedDataset(
                tf.data.Dataset.from_tensor_slices((x[:batch], y[:batch])), mesh,
                input_lib.InputConfig(global_batch_size=batch)))
            got = loaded.predict(x[:batch], verbose=0)
            row["export_max_abs_diff"] = float(np.max(np.abs(got - want)))
            row["export_exact"] = bool(np.allclose(got, want, rtol=1e-5, atol=1e-5))
    except Exception as e:  # pylint: disable=broad-except
        row["trains"] = row.get("trains", False)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def main(argv):
    del argv
    from dtk import cli  # pylint: disable=g-import-not-at-top
    cli.setup_output(verbose=FLAGS["verbosity"].present)
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    models = _models()
    names = FLAGS.models.split(",") if FLAGS.models else list(models)
    unknown = sorted(set(names) - set(models))
    if unknown:
        print(f"error: unknown --models {unknown}; choose from {sorted(models)}", file=sys.stderr)
        return 2
    print(f"{'model':<22} {'trains':>6} {'parity':>6} {'step 1 (8 / 4x2)':>18} "
          f"{'max rel diff (8 / 4x2)':>24} "
          f"{'ms/step':>8} {'plain fit':>9} {'ratio':>6} {'resume':>6} {'export':>6}", flush=True)
    rows = []
    for name in names:
        factory, shape, tolerance = models[name]
        row = _row(dtk, name, factory, shape, tolerance)
        rows.append(row)
        if "error" in row and "max_rel_diff" not in row:
            print(f"{name:<22} {'no':>6}  {row['error']}", flush=True)
            continue
        diffs = " / ".join(f"{v:.1e}" for v in row["max_rel_diff"].values())
        first = " / ".join(f"{v:.1e}" for v in row["step1_rel_diff"].values())
        print(f"{name:<22} {'yes' if row['trains'] else 'no':>6} "
              f"{'yes' if row['parity'] else 'no':>6} {first:>18} {diffs:>24} "
              f"{row['ms_per_step_batch8']:>8.1f} {row['ms_per_step_plain_fit']:>9.1f} "
              f"{row['ratio_vs_plain_fit']:>6.2f} "
              f"{'yes' if row.get('resume_exact') else 'no':>6} "
              f"{'yes' if row.get('export_exact') else 'no':>6}"
              + (f"  {row['error']}" if "error" in row else ""), flush=True)
    if FLAGS.json:
        cli.write_json(FLAGS.json, rows)
    return 0 if all(r.get("parity") and r.get("resume_exact") and r.get("export_exact")
                    for r in rows) else 1


if __name__ == "__main__":
    usage.run_app(main)
