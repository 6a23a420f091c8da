"""Train an MNIST model with dtk on a mesh: the command every dtk user runs first.

    python scripts/train_mnist.py --mesh batch=8                       # TFDS MNIST, else the bundled sample
    python scripts/train_mnist.py --mesh batch=8 --dataset idx --data_dir ../shared/data/mnist
    python scripts/train_mnist.py --mesh batch=4,model=2 --layout mlp_model_parallel ...

Prints the mesh, the layout summary, a progress bar per epoch, per-epoch train loss and accuracy,
then loss and accuracy on the whole test set (every example counted). ``--summary_json`` writes the
results as one JSON object. Re-running with the same ``--checkpoint_dir`` resumes.

Every user error (a bad flag, a layout table that does not fit the model, an unwritable output path,
a checkpoint of another model) is one ``error:`` line on stderr and exit status 2, found before
training where it can be. TensorFlow's start-up log lines are hidden unless ``--verbosity`` is given.
"""

from __future__ import annotations

import os
import platform
import time

from absl import flags

from dtk import cli
from dtk.cli import UsageError

_START = time.perf_counter()

FLAGS = flags.FLAGS
cli.define_flags((*cli.TRAINING_FLAGS, "global_batch_size", "epochs", "dataset", "data_dir"))
flags.DEFINE_enum("model", "mlp", ["mlp", "cnn"], "Model: the tutorial MLP or a small CNN.")
flags.DEFINE_string("optimizer", None, "Optimizer name: sgd, adam, adamw, rmsprop, adagrad, ... "
                    "(default: sgd for mlp, adam for cnn).")
flags.DEFINE_string("steps_per_execution", "auto", "Training steps per compiled call: auto (chosen "
                    "from measured call overhead and step time) or a positive integer.")
flags.DEFINE_integer("max_steps", None, "Stop after this many training steps in all.")
flags.DEFINE_bool("augment", False, "Randomly shift training images by up to 2 pixels, in the "
                  "tf.data pipeline (new shifts every epoch).")





def _check_flags(dtk) -> tuple:
    """Validates what can be checked before TensorFlow starts; returns (mesh spec, layout table)."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.train import optimizers  # pylint: disable=g-import-not-at-top
    try:
        spec = None if FLAGS.mesh == cli.AUTO_MESH else dtk.parse_mesh_spec(FLAGS.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None
    cli.refuse_stage_axis(spec, "train_mnist.py")
    for name in ("epochs", "global_batch_size"):
        if getattr(FLAGS, name) < 1:
            raise UsageError(f"--{name} must be a positive integer; got {getattr(FLAGS, name)}")
    spe = FLAGS.steps_per_execution
    if spe != "auto" and not (spe.isdigit() and int(spe) >= 1):
        raise UsageError(f"--steps_per_execution must be auto or a positive integer; got {spe}")
    if FLAGS.max_steps is not None and FLAGS.max_steps < 1:
        raise UsageError(f"--max_steps must be a positive integer; got {FLAGS.max_steps}")
    if spec is not None and dtk.BATCH_AXIS not in spec.axis_names:
        raise UsageError(f"--mesh {spec} has no '{dtk.BATCH_AXIS}' axis, the data-parallel axis that "
                    f"inputs are sharded on; add one, e.g. --mesh {dtk.BATCH_AXIS}=1,{spec}")
    cli.check_shared_flags(lambda name: getattr(FLAGS, name, None))
    batch_size = dict(spec.axes).get(dtk.BATCH_AXIS, 1) if spec is not None else 1
    if FLAGS.global_batch_size % batch_size:
        raise UsageError(f"--global_batch_size {FLAGS.global_batch_size} is not divisible by mesh axis "
                    f"'{dtk.BATCH_AXIS}' (size {batch_size}); use a multiple of {batch_size}")
    if FLAGS.optimizer and FLAGS.optimizer.lower() not in optimizers.OPTIMIZERS:
        raise UsageError(f"--optimizer {FLAGS.optimizer!r} is unknown; choose one of "
                    f"{', '.join(sorted(optimizers.OPTIMIZERS))}")
    if FLAGS.dataset == "sample" and FLAGS.data_dir:
        raise UsageError("--dataset sample reads the sample bundled with dtk; drop --data_dir (or use "
                    "--dataset idx --data_dir DIR)")
    if FLAGS.data_dir and FLAGS.dataset == "tfds" and not os.path.isdir(FLAGS.data_dir):
        raise UsageError(f"--data_dir {FLAGS.data_dir!r} is not a directory")
    if FLAGS.dataset == "idx":
        if not FLAGS.data_dir:
            raise UsageError("--dataset idx needs --data_dir DIR (a directory of MNIST IDX files, e.g. "
                        "../shared/data/mnist)")
        if not os.path.isdir(FLAGS.data_dir):
            raise UsageError(f"--data_dir {FLAGS.data_dir!r} is not a directory")
    try:
        table = layouts.load_table(FLAGS.layout or models.MODEL_SPECS[FLAGS.model].layout)
    except ValueError as e:
        raise UsageError(f"--layout: {e}") from None
    if spec is not None:
        _check_cores(spec)
    return spec, table


def _plan(dtk, table):
    """``--mesh auto`` / ``--explain_plan``: the planner's choice, applied to the flags."""
    from dtk import models  # pylint: disable=g-import-not-at-top
    model_spec = models.MODEL_SPECS[FLAGS.model]
    cli.check_explain_plan(FLAGS)
    plan = cli.plan_from_flags(
        lambda name: getattr(FLAGS, name, None), model_spec.factory,
        input_shape=model_spec.input_shape, input_dtype="float32",
        num_classes=model_spec.num_classes, table=table, remat_patterns=model_spec.remat,
        optimizer=(FLAGS.optimizer or model_spec.optimizer).lower(),
        global_batch_size=FLAGS.global_batch_size)
    if FLAGS.mesh == cli.AUTO_MESH:
        cli.apply_plan(FLAGS, plan)
    return plan, dtk.parse_mesh_spec(FLAGS.mesh)


def _check_cores(spec) -> None:
    """Warns when virtual CPUs far outnumber the cores: every step then runs at a crawl."""
    cores = os.cpu_count() or 1
    devices = FLAGS.virtual_devices or spec.num_devices
    if FLAGS.device in ("auto", "cpu") and FLAGS.virtual_devices is None and devices > 8 * cores:
        raise UsageError(f"--mesh {spec} needs {devices} virtual CPUs on a machine with {cores} "
                    f"core(s): each step would be about {devices // cores}x slower than on one "
                    f"device. Use a smaller mesh, or confirm with --virtual_devices {devices}")


def _versions() -> dict:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    return {"dtk": dtk.__version__, "tensorflow": tf.__version__, "tf_keras": tf_keras.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def run() -> dict:
    """Trains and evaluates as the flags say; returns the summary."""
    import dtk  # pylint: disable=g-import-not-at-top  (sets DTensor's env before TF traces)
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    spec, table = _check_flags(dtk)
    cli.check_device(lambda name: getattr(FLAGS, name, None))

    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.train.input_checks import check_accumulation  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk.data import mnist  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.train import optimizers  # pylint: disable=g-import-not-at-top

    auto_plan = None
    if spec is None or FLAGS.explain_plan:
        auto_plan, spec = _plan(dtk, table)
        if FLAGS.explain_plan:
            if dtk.cluster.env.is_lead_client():
                print(auto_plan.explain(), flush=True)
            return {}
    try:
        mesh = dtk.build_mesh(spec, device_type=FLAGS.device,
                              virtual_devices=FLAGS.virtual_devices)
    except ValueError as e:
        raise UsageError(f"--mesh {FLAGS.mesh}: {e}") from None
    lead = dtk.cluster.env.is_lead_client()
    if lead:
        if auto_plan is not None:
            print(auto_plan.explain().splitlines()[-1], flush=True)
        print(dtk.describe_mesh(mesh), flush=True)
    if FLAGS.mixed_precision:
        tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model_spec = models.MODEL_SPECS[FLAGS.model]
    factory = model_spec.factory

    optimizer_name = (FLAGS.optimizer or model_spec.optimizer).lower()
    check_accumulation(FLAGS.global_batch_size, mesh, FLAGS.grad_accum)
    if FLAGS.explain_layouts or FLAGS.device_memory_gb:
        plan = layouts.plan_layouts(table, mesh, factory, allow_replicated=FLAGS.allow_replicated,
                                    fsdp=FLAGS.fsdp)
        memory = None
        if FLAGS.device_memory_gb:
            memory = layouts.check_memory_budget(
                plan, FLAGS.device_memory_gb * 2 ** 30,
                optimizer_slots=optimizers.SLOTS.get(optimizer_name, 2),
                shard_optimizer_state=(FLAGS.shard_optimizer_state is not False
                                       and mesh.dim_size(dtk.BATCH_AXIS) > 1))
        if FLAGS.explain_layouts:
            print(layouts.explain(plan))
            if memory is not None:
                print(layouts.budget_note(memory, FLAGS.device_memory_gb * 2 ** 30))
            return {}

    spe = "auto" if FLAGS.steps_per_execution == "auto" else int(FLAGS.steps_per_execution)
    train_raw = mnist.load_mnist("train", source=FLAGS.dataset, data_dir=FLAGS.data_dir)
    if FLAGS.augment:
        train_raw = train_raw.map(mnist.random_shift, num_parallel_calls=2)
    test_raw = mnist.load_mnist("test", source=FLAGS.dataset, data_dir=FLAGS.data_dir)
    train = input_lib.DistributedDataset(train_raw, mesh, input_lib.InputConfig(
        global_batch_size=FLAGS.global_batch_size, remainder="drop", shuffle=True,
        seed=FLAGS.seed, steps_per_call=1 if spe == "auto" else spe,
        num_classes=model_spec.num_classes))
    test = input_lib.DistributedDataset(test_raw, mesh, input_lib.InputConfig(
        global_batch_size=FLAGS.global_batch_size, remainder="pad",
        num_classes=model_spec.num_classes))

    learning_rate = FLAGS.learning_rate or model_spec.learning_rate(optimizer_name)
    optimizer = dtk.make_optimizer(optimizer_name, mesh, learning_rate=learning_rate)
    trainer = dtk.Trainer(
        mesh=mesh, model=factory, layout=table, optimizer=optimizer,
        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        allow_replicated=FLAGS.allow_replicated,
        config=dtk.TrainerConfig(
            seed=FLAGS.seed, steps_per_execution=spe,
            shard_optimizer_state=("auto" if FLAGS.shard_optimizer_state is None
                                   else FLAGS.shard_optimizer_state),
            checkpoint_dir=FLAGS.checkpoint_dir, tensorboard_dir=FLAGS.tensorboard_dir,
            max_steps=FLAGS.max_steps, verbose=1 if lead else 0,
            restart_from_scratch=FLAGS.restart_from_scratch,
            allow_change=tuple(FLAGS.allow_change), fsdp=FLAGS.fsdp,
            gradient_accumulation_steps=FLAGS.grad_accum,
            async_checkpoints=FLAGS.async_checkpoints,
            remat=model_spec.remat_patterns(FLAGS.remat),
            settings={"data_source": FLAGS.dataset, "augment": FLAGS.augment}))
    if lead:
        print(layouts.explain(trainer.layout_plan).splitlines()[-1], flush=True)

    history = trainer.fit(train, epochs=FLAGS.epochs)
    results = trainer.evaluate(test)
    if lead:
        print(f"test loss {results['loss']:.4f} - test accuracy {results['accuracy']:.4f} "
              f"({results['examples']} examples)", flush=True)
    exported = trainer.export(FLAGS.export_dir) if FLAGS.export_dir else None

    timing = trainer.timing
    cli.keep_until_exit(train, test)  # no time spent tearing them down
    return {
        "auto_plan": cli.plan_summary(auto_plan),
        "mesh": str(spec), "device_type": mesh.device_type(),
        "num_clients": dtk.cluster.env.num_clients(), "model": FLAGS.model, "layout": table.name,
        "optimizer": optimizer_name, "learning_rate": learning_rate, "epochs": FLAGS.epochs,
        "global_batch_size": FLAGS.global_batch_size,
        "steps_per_execution": trainer.steps_per_execution,
        "fsdp": FLAGS.fsdp, "remat_layers": trainer.remat_layers,
        "grad_accum": FLAGS.grad_accum,
        "shard_optimizer_state": trainer.shard_optimizer_state,
        "steps": trainer.global_step,
        # Settings changed on purpose at a resume (--allow_change): {key: {old, new}}; the values
        # above are the ones used.
        "resume_changes": trainer.resume_changes, "run_id": trainer.run_id,
        "train_examples_per_epoch": train.num_examples,
        "train_dropped_per_epoch": train.num_dropped,
        "train_loss": history.history.get("loss", []),
        "train_accuracy": history.history.get("accuracy", []),
        "test_loss": results["loss"], "test_accuracy": results["accuracy"],
        "test_examples": results["examples"],
        "ms_per_step_median": timing.ms_per_step_median(
            skip_epoch=0 if len(history.epochs) > 1 else None),
        "first_step_s": timing.first_step_s,
        "wall_s": time.perf_counter() - _START,
        "export": exported, "versions": _versions(),
    }


def main(argv):
    from dtk import cli  # pylint: disable=g-import-not-at-top
    return cli.main(argv, run, verbose=FLAGS["verbosity"].present,
                    summary_json=FLAGS.summary_json)



# ``dtk-train-mnist`` (a console script) and ``python scripts/train_mnist.py``
entry = cli.entry_point(main, __name__)


if __name__ == "__main__":
    entry()
