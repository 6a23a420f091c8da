"""Train a DLRM-style recommender on a generated click log, its largest tables sharded on their rows.

    python scripts/train_recsys.py              # batch=8: AUC within 0.01 of the best, 87 s on 2 cores
    python scripts/train_recsys.py --mesh batch=4,model=2 --table_sizes 1048576,4096,256,16

The data is ``dtk.data.clicks``: a click log generated from ``--data_seed`` one chunk at a time (ids
with Zipf popularity, labels from a hidden model), so its best achievable AUC (the hidden model's own
AUC on the held-out split) is known. The model (``dtk.models.dlrm``) reads 8 dense features through a
bottom MLP and one id per table through ``table{t}``, takes the pairwise dot products and reads them
with a top MLP. Without ``--layout``, the mesh picks the table: ``layouts/recsys_batch_rows.toml``
shards the two largest tables' rows over ``batch`` (every device), and on a mesh with a ``model``
axis ``recsys`` shards them over ``model``. Prints the mesh, the layout summary, the held-out log loss
and AUC every epoch, and at the end the AUC against the best achievable. ``--summary_json`` writes
them. Re-running with the same ``--checkpoint_dir`` resumes. Errors are one ``error:`` line, exit
status 2.
"""

from __future__ import annotations

import time

from absl import flags

from dtk import cli
from dtk.cli import UsageError

_START = time.perf_counter()
FLAGS = flags.FLAGS
cli.define_flags((*cli.TRAINING_FLAGS, "global_batch_size"), mesh="batch=8",
                 layout="recsys_batch_rows", learning_rate=3e-3, global_batch_size=1024)
flags.DEFINE_list("table_sizes", ["65536", "4096", "256", "16"],
                  "Rows of each categorical feature's table (one id per example per table).")
flags.DEFINE_integer("dim", 16, "Embedding dim (and the bottom MLP's output width).")
flags.DEFINE_integer("train_examples", 1_500_000, "Generated training examples (streamed).")
flags.DEFINE_integer("heldout_examples", 50_000, "Generated held-out examples.")
flags.DEFINE_integer("epochs", 1, "Passes over the training examples (one, as click models are "
                     "trained: a second pass memorizes the tail ids and loses AUC).")
flags.DEFINE_integer("max_steps", None, "Stop after this many training steps in all (a quick "
                     "look; the held-out AUC is measured where it stops).")
flags.DEFINE_integer("data_seed", 0, "The click log's seed (its ids, hidden model and labels).")
flags.DEFINE_enum("optimizer", "adam", ["adam", "adagrad", "sgd"], "Optimizer.")
flags.DEFINE_bool("sparse_tables", False, "Update only the touched rows of the sharded tables "
                  "(Adam becomes lazy Adam; a step time flat in the table size: BUILD.md, "
                  "recommender).")


_SLOTS = {"adam": 2, "adagrad": 1, "sgd": 0}  # optimizer state per weight, for the plans
# Shared flags this script defines and does not use: refused where given (cli.refuse_unused).
UNUSED_FLAGS = {
    "mixed_precision": "the recommender trains in float32 (its tables, MLPs and AUC)",
    "remat": "the recommender has no block worth recomputing (small MLPs; each table is looked "
             "up once)",
    "shard_optimizer_state": "the sharded update is off here: the large tables are sharded on "
                             "their rows already, and the MLPs are too small to split",
    "plot": "the tables' planner prints its candidates (--explain_plan) and draws no chart",
}


def _table_sizes() -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in FLAGS.table_sizes)
    except ValueError:
        raise UsageError(f"--table_sizes must be integers, e.g. 65536,4096,256,16; got "
                         f"{','.join(FLAGS.table_sizes)}") from None
    if not sizes or min(sizes) < 2:
        raise UsageError(f"--table_sizes needs one or more tables of at least 2 rows; got "
                         f"{','.join(FLAGS.table_sizes) or '(none)'}")
    return sizes


def _check_flags():
    for name in ("dim", "train_examples", "heldout_examples", "epochs", "global_batch_size"):
        if getattr(FLAGS, name) < 1:
            raise UsageError(f"--{name} must be a positive integer; got {getattr(FLAGS, name)}")
    if FLAGS.max_steps is not None and FLAGS.max_steps < 1:
        raise UsageError(f"--max_steps must be a positive integer; got {FLAGS.max_steps}")
    _table_sizes()
    cli.refuse_unused(FLAGS, UNUSED_FLAGS, "train_recsys.py")
    cli.check_shared_flags(lambda name: getattr(FLAGS, name, None))


def _setup():
    """Every check before training; returns (spec, mesh, table, factory, log, plan, the plan's
    bytes per device)."""
    import functools  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    _check_flags()
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.data import clicks  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes = _table_sizes()
    scales = (0.3, 0.6, 0.8, 0.8)[:len(sizes)] + (0.8,) * max(len(sizes) - 4, 0)
    try:
        log = clicks.ClickLog(clicks.ClickLogConfig(
            table_sizes=sizes, effect_scales=scales, seed=FLAGS.data_seed,
            interaction_scale=0.5 if len(sizes) >= 3 else 0.0,
            interaction_tables=(1, 2) if len(sizes) >= 3 else (0, 1)))
    except ValueError as e:
        flag = "--data_seed" if str(e).startswith("seed ") else "--table_sizes"
        raise UsageError(f"{flag}: {e}") from None
    if FLAGS.heldout_examples < 10_000:  # a small held-out set may hold one class only
        labels, _ = log.labels_and_logits("heldout", FLAGS.heldout_examples)
        clicked = int((labels > 0.5).sum())
        if clicked in (0, labels.size):  # its AUC is undefined: refused before training
            raise UsageError(
                f"--heldout_examples {FLAGS.heldout_examples}: the held-out set has {clicked} "
                f"click(s) and {labels.size - clicked} non-click(s), and its AUC needs both; "
                "hold out more examples (the default is 50,000)")
    factory = functools.partial(models.dlrm, table_sizes=sizes, dim=FLAGS.dim)
    planned = None
    if FLAGS.mesh == cli.AUTO_MESH or FLAGS.explain_plan:
        planned, report = _plan_tables(sizes)
        lead = dtk.cluster.env.is_lead_client()  # every client plans the same from the flags
        if FLAGS.explain_plan:
            if lead:
                print(report)
            return None
        FLAGS.mesh = ",".join(f"{k}={v}" for k, v in planned.sizes.items())
        if lead:
            print(f"--mesh auto: {FLAGS.mesh}; " + "; ".join(
                f"{o.table.path.split('.')[0]} {o.label()}" for o in planned.chosen), flush=True)
    if FLAGS.mesh != cli.AUTO_MESH:
        try:
            spec = dtk.parse_mesh_spec(FLAGS.mesh)
        except ValueError:
            spec = None  # a malformed --mesh: mesh_and_table names it
        cli.refuse_stage_axis(spec, "train_recsys.py")
    spec, mesh, table = cli.mesh_and_table(lambda name: getattr(FLAGS, name, None))
    if planned is not None:
        table = planned.layout_table(others=[  # the MLPs' rules, as the shipped table's
            r for r in layouts.load_table("recsys_batch_rows").rules
            if not r.pattern.startswith("table")])
    elif not FLAGS["layout"].present:
        if "model" in spec.axis_names:
            table = layouts.load_table("recsys")  # the tables' rows over `model`, not `batch`
        table = _largest_sharded(layouts.load_table(table) if isinstance(table, str) else table,
                                 sizes)
    plan = layouts.plan_layouts(table, mesh, factory, allow_replicated=FLAGS.allow_replicated,
                                fsdp=FLAGS.fsdp)
    from dtk.train.input_checks import check_accumulation  # pylint: disable=g-import-not-at-top
    check_accumulation(FLAGS.global_batch_size, mesh, FLAGS.grad_accum)
    slots = _SLOTS[FLAGS.optimizer]
    memory = layouts.memory_per_device(plan, optimizer_slots=slots, shard_optimizer_state=False)
    if FLAGS.device_memory_gb:
        layouts.check_memory_budget(plan, FLAGS.device_memory_gb * 2 ** 30, optimizer_slots=slots,
                                    shard_optimizer_state=False)
    return spec, mesh, table, factory, log, plan, memory


# The default tables' rules: the two largest embedding tables sharded on their rows, the rest
# replicated. Written for tables 0 and 1; the script names the largest by --table_sizes.
_LARGEST_RULE, _SMALLER_RULE = r"table[01]\.embeddings", r"table([2-9]|\d\d+)\.embeddings"


def _largest_sharded(table, sizes):
    """The default table (``recsys``, ``recsys_batch_rows``) with its row-sharding rule on the
    two largest tables of ``sizes``, whatever their order (``--table_sizes 16,256,4096,65536``
    shards tables 3 and 2), and its replicated rule on the others."""
    import dataclasses  # pylint: disable=g-import-not-at-top
    order = sorted(range(len(sizes)), key=lambda t: (-sizes[t], t))
    largest, rest = sorted(order[:2]), sorted(order[2:])

    def names(ids):
        return r"table(" + "|".join(map(str, ids)) + r")\.embeddings"

    patterns = {rule.pattern for rule in table.rules}
    if not {_LARGEST_RULE, _SMALLER_RULE} <= patterns:  # the table's rules were edited
        raise RuntimeError(f"layout table {table.name!r} no longer has the rules "
                           f"{_LARGEST_RULE!r} and {_SMALLER_RULE!r} that train_recsys.py points "
                           "at the largest tables; update _LARGEST_RULE/_SMALLER_RULE with it")
    rules = []
    for rule in table.rules:
        if rule.pattern == _LARGEST_RULE:
            rule = dataclasses.replace(rule, pattern=names(largest),
                                       note=rule.note + " (the largest, from --table_sizes)")
        elif rule.pattern == _SMALLER_RULE:
            if not rest:
                continue
            rule = dataclasses.replace(rule, pattern=names(rest))
        rules.append(rule)
    return dataclasses.replace(table, rules=tuple(rules))


def _plan_tables(sizes):
    """``--mesh auto`` / ``--explain_plan``: each table's placement and the mesh
    (``dtk.planning.tables``), from the flags alone (the tables are never built to plan them).

    Returns:
      (the chosen ``TablePlan``, the report ``--explain_plan`` prints).
    """
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from dtk.planning import tables  # pylint: disable=g-import-not-at-top
    cli.check_explain_plan(FLAGS)
    cli.check_device(lambda name: getattr(FLAGS, name, None))
    given = [f"--{n}" for n in ("layout", "fsdp", "remat") if FLAGS[n].present] + \
        (["--grad_accum"] if FLAGS.grad_accum != 1 else [])
    if given:
        raise UsageError(f"--mesh auto and --explain_plan place the tables themselves; drop "
                         f"{', '.join(given)}, or give a mesh")
    kind = mesh_lib.resolve_device_type(FLAGS.device or "auto")
    # the devices that exist, on every client alike (it planned for 8 a process under a
    # 2 x 4 launch, then failed: issue 59)
    devices = cli.devices_to_plan_for(lambda name: getattr(FLAGS, name, None), kind)
    # The rest of the model from a build with 2-row tables: its weights and layer widths.
    small = models.dlrm(table_sizes=(2,) * len(sizes), dim=FLAGS.dim)
    dense_bytes = sum(int(w.shape.num_elements()) * 4 for w in small.weights
                      if not w.name.split("/")[-1].startswith("embeddings"))
    example_bytes = 4 * sum(getattr(layer, "units", 0) for layer in small.layers) + \
        4 * FLAGS.dim * len(sizes)
    del small
    found = [tables.Table(path=f"table{t}.embeddings", rows=rows, dim=FLAGS.dim)
             for t, rows in enumerate(sizes)]
    slots = _SLOTS[FLAGS.optimizer]
    budget = FLAGS.device_memory_gb * 2 ** 30 if FLAGS.device_memory_gb else None
    kwargs = dict(global_batch_size=FLAGS.global_batch_size, dense_bytes=dense_bytes,
                  example_bytes=example_bytes)
    try:
        best, candidates = tables.plan_mesh(found, devices, budget=budget,
                                            optimizer_slots=slots, sparse=FLAGS.sparse_tables,
                                            **kwargs)
    except ValueError as e:
        raise UsageError(f"--mesh auto: {e}") from None
    return best, tables.explain(best, candidates, **kwargs)


def run() -> dict:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    from dtk.data import clicks  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    setup = _setup()
    if setup is None:  # --explain_plan printed its report
        return {}
    spec, mesh, table, factory, log, plan, memory = setup
    lead = dtk.cluster.env.is_lead_client()
    say = print if lead else (lambda *a, **k: None)
    say(dtk.describe_mesh(mesh), flush=True)
    if FLAGS.explain_layouts:
        print(layouts.explain(plan))
        if FLAGS.device_memory_gb:
            print(layouts.budget_note(memory, FLAGS.device_memory_gb * 2 ** 30))
        return {}
    heldout_labels, heldout_logits = log.labels_and_logits("heldout", FLAGS.heldout_examples)
    best = log.best_auc(FLAGS.heldout_examples)
    say(f"click log: seed {FLAGS.data_seed}, tables {list(log.config.table_sizes)}, "
        f"{FLAGS.train_examples:,} training and {FLAGS.heldout_examples:,} held-out examples; "
        f"click rate {heldout_labels.mean():.3f}; best achievable AUC {best:.4f} (log loss "
        f"{clicks.log_loss(heldout_labels, heldout_logits):.4f})", flush=True)
    steps_per_epoch = FLAGS.train_examples // FLAGS.global_batch_size
    if not steps_per_epoch:
        raise UsageError(f"--train_examples {FLAGS.train_examples} is less than one global batch "
                         f"(--global_batch_size {FLAGS.global_batch_size})")
    train = input_lib.DistributedDataset(
        log.dataset("train", FLAGS.train_examples), mesh,
        input_lib.InputConfig(global_batch_size=FLAGS.global_batch_size, remainder="drop"))
    heldout = input_lib.DistributedDataset(
        log.dataset("heldout", FLAGS.heldout_examples), mesh,
        input_lib.InputConfig(global_batch_size=FLAGS.global_batch_size, remainder="pad"))
    optimizer = dtk.make_optimizer(FLAGS.optimizer, mesh, learning_rate=FLAGS.learning_rate)
    trainer = dtk.Trainer(
        mesh=mesh, model=factory, layout=table, optimizer=optimizer,
        allow_replicated=FLAGS.allow_replicated, loss="binary_crossentropy",
        config=dtk.TrainerConfig(seed=FLAGS.seed, checkpoint_dir=FLAGS.checkpoint_dir,
                                 max_steps=FLAGS.max_steps,
                                 tensorboard_dir=FLAGS.tensorboard_dir,
                                 restart_from_scratch=FLAGS.restart_from_scratch,
                                 allow_change=tuple(FLAGS.allow_change),
                                 settings={"data_seed": FLAGS.data_seed,
                                           "table_sizes": list(log.config.table_sizes),
                                           "train_examples": FLAGS.train_examples},
                                 shard_optimizer_state=False, verbose=1 if lead else 0,
                                 sparse_tables=FLAGS.sparse_tables,
                                 fsdp=FLAGS.fsdp, gradient_accumulation_steps=FLAGS.grad_accum,
                                 async_checkpoints=FLAGS.async_checkpoints))
    say(layouts.explain(trainer.layout_plan).splitlines()[-1], flush=True)

    curve = []

    def report(epoch, logs):
        logits = np.asarray(trainer.predict(heldout)).reshape(-1)
        auc = clicks.auc(heldout_labels, logits)
        curve.append({"epoch": epoch + 1, "step": trainer.global_step, "auc": auc,
                      "log_loss": clicks.log_loss(heldout_labels, logits)})
        say(f"epoch {epoch + 1}: train loss {logs['loss']:.4f}, held-out log loss "
            f"{curve[-1]['log_loss']:.4f}, AUC {auc:.4f} (best achievable {best:.4f})", flush=True)

    history = trainer.fit(train, epochs=FLAGS.epochs, on_epoch_end=[report])
    if not curve or curve[-1]["step"] != trainer.global_step:  # resumed after the last epoch
        report(FLAGS.epochs - 1, {"loss": (history.history.get("loss") or [float("nan")])[-1]})
    auc, loss = curve[-1]["auc"], curve[-1]["log_loss"]
    say(f"held-out: AUC {auc:.4f}, {best - auc:.4f} below the best achievable {best:.4f}; log "
        f"loss {loss:.4f} ({FLAGS.heldout_examples:,} examples)", flush=True)
    exported = trainer.export(FLAGS.export_dir) if FLAGS.export_dir else None
    cli.keep_until_exit(train, heldout)
    return {
        "export": exported, "mesh": str(spec), "num_clients": dtk.cluster.env.num_clients(),
        "layout": table.name, "resume_changes": trainer.resume_changes, "run_id": trainer.run_id,
        "table_sizes": list(log.config.table_sizes), "optimizer": FLAGS.optimizer,
        "steps": trainer.global_step, "train_loss": history.history.get("loss", []),
        "heldout_curve": curve, "heldout_auc": auc, "heldout_log_loss": loss,
        "best_auc": best, "auc_gap": best - auc,
        "ms_per_step_median": trainer.timing.ms_per_step_median(skip_epoch=0),
        "planned_bytes_per_device": memory,
        "wall_s": time.perf_counter() - _START,
    }


def main(argv):
    return cli.main(argv, run, verbose=FLAGS["verbosity"].present, summary_json=FLAGS.summary_json)



# ``dtk-train-recsys`` (a console script) and ``python scripts/train_recsys.py``
entry = cli.entry_point(main, __name__)


if __name__ == "__main__":
    entry()
