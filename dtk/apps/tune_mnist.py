"""Search MNIST hyper-parameters with Ray Tune over dtk runs (``pip install 'ray[train,tune]'``: dtk's ray extra).

    python scripts/tune_mnist.py --trials 4 --epochs 3                 # single-process trials, batch=4
    python scripts/tune_mnist.py --trials 4 --workers 2 --mesh batch=8  # each trial: 2 Ray Train workers
    python scripts/tune_mnist.py --address auto ...                     # on a running Ray cluster

Searches the learning rate (log-uniform) and the global batch size with ASHA (early stopping on
validation accuracy, the last 5,000 training images held out); every trial reports per-epoch
metrics to Tune through ``dtk.cluster.ray.ReportCallback``. With ``--workers 1`` a trial is one process
(``tune.with_resources``); with ``--workers N`` it drives a ``dtk.cluster.ray.DTensorTrainer`` of N DTensor
clients whose reports reach Tune via Ray's ``TuneReportCallback``. Prints the results table and
the best trial's test accuracy (the whole test set, every example counted).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from absl import flags

from dtk import cli
from dtk.cli import UsageError

FLAGS = flags.FLAGS
flags.DEFINE_integer("trials", 4, "Number of trials (hyper-parameter samples).")
flags.DEFINE_integer("workers", 1, "Ray workers (DTensor clients) per trial; 1: a plain Tune trial.")
# --mesh: each trial's mesh, over all its workers' devices.
cli.define_flags(("mesh", "seed", "summary_json", "epochs", "dataset", "data_dir"), mesh="batch=4",
                 dataset="sample")
flags.DEFINE_integer("validation_examples", None, "Training images held out for validation "
                     "(default: a quarter of them, at most 5,000; at most half).")
flags.DEFINE_integer("concurrent", 1, "Trials run at once (each takes --workers CPUs).")
flags.DEFINE_string("address", None, "Ray cluster address (e.g. auto); default: a local Ray on "
                    "127.0.0.1 with --num_cpus.")
flags.DEFINE_integer("num_cpus", None, "CPUs of the local Ray (default: this machine's).")
flags.DEFINE_string("storage_path", None, "Where Tune and Train keep results and checkpoints "
                    "(shared storage on a cluster; default: a temp dir).")


BATCH_SIZES = (64, 128, 256)  # the searched global batch sizes


def train_trial(config: dict) -> None:
    """One dtk run with ``config``'s hyper-parameters; reports to Ray every epoch.

    Runs in a Tune trial (one client) or on every Ray Train worker (one client each).
    """
    import dtk  # pylint: disable=g-import-not-at-top
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    import dtk.cluster.ray  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.data import mnist  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top

    spec = dtk.parse_mesh_spec(config["mesh"])
    mesh = dtk.build_mesh(spec, device_type="cpu")
    model_spec = models.MODEL_SPECS["mlp"]
    full = mnist.load_mnist("train", source=config["dataset"], data_dir=config["data_dir"])
    count = int(full.cardinality())
    held = config["validation_examples"] or min(5000, count // 4)
    if held > count // 2:  # checked here: the data set's size is known once it is loaded
        raise ValueError(f"--validation_examples {held} is more than half of the {count} "
                         f"training images; use at most {count // 2}")
    batch = config["global_batch_size"]
    train = input_lib.DistributedDataset(full.take(count - held), mesh, input_lib.InputConfig(
        global_batch_size=batch, remainder="drop", shuffle=True, seed=config["seed"],
        num_classes=model_spec.num_classes))

    def evaluation(split):
        return input_lib.DistributedDataset(split, mesh, input_lib.InputConfig(
            global_batch_size=batch, remainder="pad", num_classes=model_spec.num_classes))

    validation = evaluation(full.skip(count - held))
    test = evaluation(mnist.load_mnist("test", source=config["dataset"], data_dir=config["data_dir"]))
    # Keras's own fit on the mesh (dtk.distribute), fed the DistributedDatasets
    # (dtk.train.keras_data): the Trainer's numbers, bit for bit (tests/test_distribute.py);
    # "auto" steps per call is dtk's calibration, one choice for every worker.
    model = dtk.distribute(model_spec.factory, mesh, layout=model_spec.layout, seed=config["seed"])
    model.compile(optimizer=tf_keras.optimizers.Adam(config["learning_rate"]),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution="auto")
    if config.get("placement_group_file") and dtk.cluster.env.is_lead_client():
        _record_placement_group(config["placement_group_file"])
    report = dtk.cluster.ray.ReportCallback(config.get("checkpoint_dir"))
    epochs = config["epochs"]

    def on_epoch_end(epoch, logs):
        if epoch + 1 == epochs:  # the last epoch also measures the test set
            logs = {**logs, "test_accuracy": model.evaluate(test, verbose=0,
                                                            return_dict=True)["accuracy"]}
        report(epoch, logs)

    callbacks = [tf_keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)]
    if config.get("checkpoint_dir"):  # saved before the report, which attaches it
        callbacks.insert(0, dtk.CheckpointCallback(config["checkpoint_dir"]))
    model.fit(train, epochs=epochs, validation_data=validation, verbose=0, callbacks=callbacks)


def _multi_client_trial(config: dict) -> None:
    """A Tune trial that drives ``config['workers']`` Ray Train workers (one DTensor cluster)."""
    import ray.train  # pylint: disable=g-import-not-at-top
    import ray.tune  # pylint: disable=g-import-not-at-top
    from ray.tune.integration.ray_train import TuneReportCallback  # pylint: disable=g-import-not-at-top
    import dtk.cluster.ray  # pylint: disable=g-import-not-at-top

    workers = config["workers"]
    spec_devices = dtk.parse_mesh_spec(config["mesh"]).num_devices
    context = ray.tune.get_context()
    config = {**config, "placement_group_file": _placement_group_file(config, context.get_trial_id())}
    dtk.cluster.ray.DTensorTrainer(
        train_trial, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=workers,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name=context.get_trial_name(), storage_path=config["storage_path"],
            callbacks=[TuneReportCallback()],
            # Ray retries a worker group that cannot be placed forever by default: fail instead.
            failure_config=ray.train.FailureConfig(max_failures=0, controller_failure_limit=1)),
        devices_per_worker=spec_devices // workers).fit()


def _placement_group_file(config: dict, trial_id: str) -> str:
    return os.path.join(config["storage_path"], "worker_placement_groups", trial_id)


def _record_placement_group(path: str) -> None:
    """On a Ray Train worker: writes the id of the workers' placement group to ``path``."""
    import ray  # pylint: disable=g-import-not-at-top
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(ray.get_runtime_context().get_placement_group_id() or "")


def _release_callback():
    """A Tune callback that removes a finished multi-client trial's worker placement group.

    Tune stops a trial (ASHA, or its last epoch) by ending the trial's actor, which ends the Train
    controller in it; Ray 2.60 then releases the workers' placement group only through a cleaner
    that needs the dashboard's state API. Without a dashboard the group stays, holding its CPUs,
    and the next trial's workers never start. The workers record the group's id; this removes it.
    """
    import ray  # pylint: disable=g-import-not-at-top
    from ray import tune  # pylint: disable=g-import-not-at-top
    from ray.util.placement_group import PlacementGroup  # pylint: disable=g-import-not-at-top

    class ReleaseWorkerPlacementGroup(tune.Callback):
        def _release(self, trial):
            path = _placement_group_file(trial.config, trial.trial_id)
            try:
                with open(path, encoding="utf-8") as f:
                    pg_id = f.read().strip()
            except OSError:
                return
            state = ray.util.placement_group_table().get(pg_id, {}).get("state")
            if pg_id and state not in (None, "REMOVED"):
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._release(trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._release(trial)

    return ReleaseWorkerPlacementGroup()


def _check_flags(dtk) -> None:
    cli.check_shared_flags(lambda name: getattr(FLAGS, name, None))
    if FLAGS.num_cpus is not None and FLAGS.num_cpus < 1:
        raise UsageError(f"--num_cpus must be a positive integer; got {FLAGS.num_cpus} (leave it "
                         "out to use this machine's CPUs)")
    for name in ("trials", "epochs", "workers", "concurrent", "validation_examples"):
        if getattr(FLAGS, name) is not None and getattr(FLAGS, name) < 1:
            raise UsageError(f"--{name} must be a positive integer; got {getattr(FLAGS, name)}")
    # A multi-client trial holds its driver's CPU and one per worker: a local Ray with fewer
    # CPUs would wait for a placement group that can never be placed.
    need = FLAGS.workers + 1 if FLAGS.workers > 1 else 1
    if FLAGS.num_cpus is not None and not FLAGS.address and FLAGS.num_cpus < need:
        raise UsageError(f"--num_cpus {FLAGS.num_cpus} cannot hold one trial: --workers "
                         f"{FLAGS.workers} takes {need} CPUs (the trial's driver and one per "
                         f"worker); use --num_cpus {need} or more, or fewer --workers")
    if FLAGS.storage_path:
        cli.check_output_path("storage_path", FLAGS.storage_path, kind="dir")
    if FLAGS.mesh == cli.AUTO_MESH:
        raise UsageError("--mesh auto plans one training run (train_mnist.py, train_lm.py); a Tune "
                         "search compares trials on one mesh: give it, e.g. --mesh batch=4")
    try:
        spec = dtk.parse_mesh_spec(FLAGS.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None
    cli.refuse_stage_axis(spec, "tune_mnist.py")
    if spec.num_devices % FLAGS.workers:
        raise UsageError(f"--mesh {spec} has {spec.num_devices} devices, not divisible by --workers "
                         f"{FLAGS.workers}; each worker must hold the same number of devices")
    if FLAGS.dataset == "idx" and not (FLAGS.data_dir and os.path.isdir(FLAGS.data_dir)):
        raise UsageError(f"--dataset idx needs --data_dir DIR of MNIST IDX files; got {FLAGS.data_dir!r}")
    if dtk.BATCH_AXIS not in spec.axis_names:
        raise UsageError(f"--mesh {spec} has no '{dtk.BATCH_AXIS}' axis; add one, e.g. "
                         f"--mesh {dtk.BATCH_AXIS}=4")
    batch = dict(spec.axes)[dtk.BATCH_AXIS]
    bad = [b for b in BATCH_SIZES if b % batch]
    if bad:
        raise UsageError(f"--mesh {spec}: the searched global batch sizes {bad} are not divisible "
                         f"by mesh axis '{dtk.BATCH_AXIS}' (size {batch}); use a batch axis that "
                         f"divides {BATCH_SIZES} (1, 2, 4, 8, 16, 32 or 64)")
    from dtk.data import mnist  # pylint: disable=g-import-not-at-top
    count = int(mnist.load_mnist("train", source=FLAGS.dataset,
                                 data_dir=FLAGS.data_dir).cardinality())
    if count > 0 and FLAGS.validation_examples is not None and \
            FLAGS.validation_examples > count // 2:
        raise UsageError(f"--validation_examples {FLAGS.validation_examples} is more than half of "
                         f"the {count} training images; use at most {count // 2}")


def run() -> dict:
    """Runs the search; returns the summary (trials table and the best trial)."""
    import dtk  # pylint: disable=g-import-not-at-top
    _check_flags(dtk)
    try:
        import ray  # pylint: disable=g-import-not-at-top
        from ray import tune  # pylint: disable=g-import-not-at-top
        from ray.tune.schedulers import ASHAScheduler  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise UsageError(f"Ray Tune is not installed ({e}); pip install 'ray[train,tune]', dtk's ray extra") from None

    storage = os.path.abspath(FLAGS.storage_path or tempfile.mkdtemp(prefix="dtk-tune-"))
    temporary = FLAGS.storage_path is None
    if FLAGS.address:
        ray.init(address=FLAGS.address, log_to_driver=False)
    else:  # a local Ray that answers on loopback only, without a dashboard
        # A multi-client trial is one idle driver plus its workers: count the driver's CPU too.
        cpus = FLAGS.num_cpus or max(os.cpu_count() or 1,
                                     (FLAGS.workers + 1) * FLAGS.concurrent if FLAGS.workers > 1 else 1)
        # address="local": always a new cluster of its own (a cluster another run left behind
        # would be joined otherwise, and refuse num_cpus).
        ray.init(address="local", num_cpus=cpus, _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=False)
    try:
        config = {
            "learning_rate": tune.loguniform(3e-4, 3e-2),
            "global_batch_size": tune.choice(list(BATCH_SIZES)),
            "mesh": FLAGS.mesh, "workers": FLAGS.workers, "epochs": FLAGS.epochs,
            "dataset": FLAGS.dataset,
            "data_dir": os.path.abspath(FLAGS.data_dir) if FLAGS.data_dir else None,
            "validation_examples": FLAGS.validation_examples, "seed": FLAGS.seed,
            "storage_path": storage,
        }
        if FLAGS.workers == 1:
            trainable = tune.with_resources(train_trial, {"cpu": 1})
        else:  # the trial drives its workers (one CPU each)
            trainable = tune.with_resources(_multi_client_trial, {"cpu": 1})
        scheduler = ASHAScheduler(max_t=FLAGS.epochs, grace_period=1, reduction_factor=2)
        tuner = tune.Tuner(
            trainable, param_space=config,
            tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", scheduler=scheduler,
                                        num_samples=FLAGS.trials,
                                        max_concurrent_trials=FLAGS.concurrent,
                                        search_alg=tune.search.BasicVariantGenerator(
                                            random_state=FLAGS.seed,
                                            max_concurrent=FLAGS.concurrent)),
            run_config=tune.RunConfig(name="tune_mnist", storage_path=storage, verbose=0,
                                      callbacks=[_release_callback()]))
        grid = tuner.fit()
        rows = []
        for result in grid:
            m = result.metrics or {}
            rows.append({"trial": os.path.basename(result.path or "?"),
                         "learning_rate": result.config["learning_rate"],
                         "global_batch_size": result.config["global_batch_size"],
                         "epochs": m.get("epoch"),
                         "reports": 0 if result.metrics_dataframe is None else len(result.metrics_dataframe),
                         "val_accuracy": m.get("val_accuracy"),
                         "loss": m.get("loss"), "test_accuracy": m.get("test_accuracy"),
                         "error": None if result.error is None else str(result.error).splitlines()[0]})
        best = grid.get_best_result(metric="val_accuracy", mode="max", scope="last")
        left = [pg for pg in ray.util.placement_group_table().values()
                if pg.get("state") != "REMOVED"]
        for pg in left:
            print(f"placement group left: {pg.get('placement_group_id')} {pg.get('state')} "
                  f"{pg.get('name')!r} {pg.get('bundles')}")
    finally:
        ray.shutdown()
        if temporary:  # nothing left behind in the temp dir
            shutil.rmtree(storage, ignore_errors=True)
    failed = [r for r in rows if r["error"]]
    if rows and len(failed) == len(rows):
        raise ValueError(f"all {len(rows)} trials failed; the first: {failed[0]['error']}")
    print(f"{'trial':<28} {'learning_rate':>13} {'batch':>5} {'epochs':>6} {'val_acc':>8} "
          f"{'test_acc':>8}")
    for r in rows:
        val = "-" if r["val_accuracy"] is None else f"{r['val_accuracy']:.4f}"
        test = "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}"
        print(f"{r['trial'][:28]:<28} {r['learning_rate']:>13.5f} {r['global_batch_size']:>5} "
              f"{r['epochs'] or 0:>6} {val:>8} {test:>8}" + (f"  error: {r['error']}" if r["error"] else ""))
    summary = {"trials": rows, "storage_path": None if temporary else storage,
               "placement_groups_left": len(left),
               "best": {"learning_rate": best.config["learning_rate"],
                        "global_batch_size": best.config["global_batch_size"],
                        "val_accuracy": best.metrics.get("val_accuracy"),
                        "test_accuracy": best.metrics.get("test_accuracy")}}
    print(f"best: learning_rate {best.config['learning_rate']:.5f}, batch "
          f"{best.config['global_batch_size']}: val accuracy {best.metrics.get('val_accuracy') or float('nan'):.4f},"
          f" test accuracy {best.metrics.get('test_accuracy') or float('nan'):.4f}; placement groups left: {len(left)}")
    return summary


def main(argv):
    from dtk import cli  # pylint: disable=g-import-not-at-top
    return cli.main(argv, run, verbose=FLAGS["verbosity"].present, summary_json=FLAGS.summary_json)



# ``dtk-tune-mnist`` (a console script) and ``python scripts/tune_mnist.py``
entry = cli.entry_point(main, __name__)


if __name__ == "__main__":
    entry()
