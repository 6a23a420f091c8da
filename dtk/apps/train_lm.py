"""Train a byte-level transformer language model with data x model parallelism, on any machine.

    python scripts/train_lm.py --mesh batch=2,model=4            # Python's stdlib source, no download
    python scripts/train_lm.py --mesh batch=8 --text_file book.txt --steps 2000

The corpus is the Python standard library's own ``.py`` files (split into training and held-out
text by file) or ``--text_file``. Prints the mesh, the layout summary with weights and optimizer
state per device, a progress bar, the held-out loss in bits per byte every ``--eval_every`` steps
next to the corpus's byte-unigram entropy, and at the end a sample generated from ``--prompt``
on the laid-out model. ``--summary_json`` writes ``train_loss`` (one entry per evaluation
interval), ``heldout_bits_per_byte``, ``unigram_bits_per_byte`` and the rest. Re-running with the
same ``--checkpoint_dir`` resumes. Errors are one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import flags

from dtk import cli
from dtk.cli import UsageError

_START = time.perf_counter()
FLAGS = flags.FLAGS
cli.define_flags((*cli.TRAINING_FLAGS, "global_batch_size"), mesh="batch=2,model=4",
                 layout="transformer_lm", learning_rate=3e-3, global_batch_size=32)
flags.DEFINE_integer("seq_len", 128, "Bytes per training window.")
flags.DEFINE_integer("dim", 128, "Model width.")
flags.DEFINE_integer("heads", 8, "Attention heads (a multiple of the model axis).")
flags.DEFINE_integer("layers", 2, "Transformer blocks.")
flags.DEFINE_integer("steps", 600, "Training steps in all.")
flags.DEFINE_integer("eval_every", 100, "Evaluate the held-out loss every this many steps.")
flags.DEFINE_integer("eval_batches", 20, "Held-out batches per evaluation.")
flags.DEFINE_float("dropout", 0.0, "Dropout rate (the same masks on every mesh: dtk.parallel.randomness).")
flags.DEFINE_enum("attention", "mha", ["mha", "blockwise"], "Attention: tf_keras "
                  "MultiHeadAttention (scores [rows, heads, T, T]) or blockwise (memory linear in T; "
                  "no attention dropout).")
flags.DEFINE_enum("sequence_attention", None, ["auto", "all_gather", "all_to_all"],
                  "On a mesh with a seq axis: attention gathers keys and values (all_gather), "
                  "re-shards to heads (all_to_all, Ulysses), or auto (the faster on the mesh, "
                  "timed); default: the layout table's (transformer_lm: auto).")
flags.DEFINE_integer("block_size", None, "Keys per block of blockwise attention (divides "
                     "--seq_len); default 256, or the largest divisor of --seq_len below it.")
flags.DEFINE_integer("moe_experts", 0, "Mixture of experts: E experts replace the MLP of every "
                     "--moe_every-th block (0: dense); lay them out with --layout "
                     "transformer_lm_moe (an expert mesh axis) or transformer_lm_moe_batch.")
flags.DEFINE_integer("moe_top_k", 1, "Experts per token: 1 (Switch) or 2 (GShard).")
flags.DEFINE_float("moe_capacity_factor", 1.25, "Slots per expert as a multiple of an even share "
                   "of a routing group's choices; a token past them is dropped (counted) and "
                   "carried by the residual.")
flags.DEFINE_integer("moe_every", 1, "An MoE block every this many blocks (2: blocks 1, 3, ...).")
flags.DEFINE_integer("moe_group_size", 32, "Consecutive positions of one sequence routed together "
                     "(the capacity is per group, the same on every mesh); must divide --seq_len "
                     "(the default 32: where it does not, the whole sequence is one group).")
flags.DEFINE_enum("pipeline_schedule", "1f1b", ["1f1b", "gpipe"], "On a mesh with a stage axis "
                  "(pipeline parallelism): the order of the microbatches' forward and backward "
                  "passes; 1f1b keeps at most S - s microbatches in flight on stage s, gpipe all.")
flags.DEFINE_list("pipeline_boundaries", None, "On a mesh with a stage axis: the first layer of "
                  "each stage after the first (e.g. block2_ln1); default: stages of balanced "
                  "cost between the model's blocks.")
flags.DEFINE_string("text_file", None, "Train on this text file instead of the stdlib source.")
flags.DEFINE_string("prompt", "def main(", "Prompt for the sample generated at the end (with "
                    "--text_file and no --prompt: the first bytes of the held-out text's first "
                    "line).")
flags.DEFINE_integer("sample_bytes", 160, "Bytes to generate (0: no sample).")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature: > 0 samples, 0 is greedy (which "
                   "repeats itself on a small model).")




def _check_text_file():
    """Before TensorFlow loads (``cli.main``'s precheck) and in ``_check_flags``."""
    if FLAGS.text_file and not os.path.isfile(FLAGS.text_file):
        raise UsageError(f"--text_file {FLAGS.text_file!r} is not a file")


def _check_flags():
    for name in ("seq_len", "dim", "heads", "layers", "global_batch_size", "steps", "eval_every",
                 "eval_batches"):
        if getattr(FLAGS, name) < 1:
            raise UsageError(f"--{name} must be a positive integer; got {getattr(FLAGS, name)}")
    if FLAGS.attention != "blockwise" and FLAGS.block_size is not None:
        raise UsageError(f"--block_size {FLAGS.block_size} sets blockwise attention's key blocks, "
                         f"but --attention is {FLAGS.attention!r}; add --attention blockwise, or "
                         "drop --block_size")
    if FLAGS.attention == "blockwise" and FLAGS.block_size is not None and (
            FLAGS.block_size < 1 or FLAGS.seq_len % min(FLAGS.block_size, FLAGS.seq_len)):
        raise UsageError(f"--block_size {FLAGS.block_size} does not divide --seq_len "
                         f"{FLAGS.seq_len}; use a divisor of it (e.g. 256 for 4096), or leave "
                         "it unset for the default")
    if FLAGS.dim % FLAGS.heads:
        raise UsageError(f"--dim {FLAGS.dim} is not divisible by --heads {FLAGS.heads}")
    if FLAGS.sample_bytes < 0:
        raise UsageError(f"--sample_bytes must be >= 0 (0: no sample); got {FLAGS.sample_bytes}")
    if not 0 <= FLAGS.temperature < float("inf"):
        raise UsageError(f"--temperature must be >= 0 (0: greedy); got {FLAGS.temperature}")
    if not 0 <= FLAGS.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1); got {FLAGS.dropout}")
    _check_text_file()
    cli.check_shared_flags(lambda name: getattr(FLAGS, name, None))
    _check_moe_flags()
    _check_pipeline_flags()
    if FLAGS.sample_bytes and not FLAGS.prompt:
        raise UsageError("--prompt is empty; give a few bytes to continue, e.g. 'def '")
    if FLAGS.sample_bytes and len(FLAGS.prompt.encode()) >= FLAGS.seq_len:
        raise UsageError(f"--prompt is {len(FLAGS.prompt.encode())} bytes; keep it shorter than "
                    f"--seq_len {FLAGS.seq_len}")


MOE_FLAGS = ("moe_top_k", "moe_capacity_factor", "moe_every", "moe_group_size")


def _check_moe_flags():
    if FLAGS.moe_experts < 0:
        raise UsageError(f"--moe_experts must be >= 0 (0: a dense LM); got {FLAGS.moe_experts}")
    if not FLAGS.moe_experts:
        given = [f"--{name}" for name in MOE_FLAGS if FLAGS[name].present]
        if given:
            raise UsageError(f"{', '.join(given)} set(s) the mixture of experts, but "
                             "--moe_experts is 0 (a dense LM); add --moe_experts E, or drop "
                             f"{', '.join(given)}")
        return
    from dtk.parallel import experts  # pylint: disable=g-import-not-at-top
    try:
        experts.check_settings(num_experts=FLAGS.moe_experts, top_k=FLAGS.moe_top_k,
                               capacity_factor=FLAGS.moe_capacity_factor, flag="--moe_")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if FLAGS.moe_every < 1:
        raise UsageError(f"--moe_every must be a positive integer; got {FLAGS.moe_every}")
    if FLAGS.moe_every > FLAGS.layers:
        raise UsageError(f"--moe_every {FLAGS.moe_every} is more than --layers {FLAGS.layers}: "
                         "no block would hold experts; use --moe_every 1 to "
                         f"{FLAGS.layers}")
    if FLAGS.moe_group_size < 1:
        raise UsageError(f"--moe_group_size must be a positive integer; got "
                         f"{FLAGS.moe_group_size}")
    if FLAGS["moe_group_size"].present and FLAGS.seq_len % FLAGS.moe_group_size:
        raise UsageError(f"--moe_group_size {FLAGS.moe_group_size} does not divide --seq_len "
                         f"{FLAGS.seq_len}: a routing group is consecutive positions of one "
                         "sequence; use a divisor of --seq_len")


def _moe_group_size() -> int | None:
    """``--moe_group_size`` where it divides ``--seq_len``, else None (the whole sequence)."""
    group = FLAGS.moe_group_size
    return group if FLAGS.seq_len % group == 0 and group < FLAGS.seq_len else None


def _check_moe_mesh(mesh, table) -> None:
    """An expert axis needs experts; experts need a table with their rules, and a count the axis
    divides."""
    has_rules = any("_moe" in rule.pattern for rule in table.rules)
    sizes = {name: mesh.dim_size(name) for name in mesh.dim_names}
    if not FLAGS.moe_experts:
        if sizes.get("expert", 1) > 1:
            raise UsageError(
                f"--mesh {FLAGS.mesh}: mesh axis 'expert' (size {sizes['expert']}) shards the "
                "experts of a mixture-of-experts LM, but --moe_experts is 0; add --moe_experts E "
                "(a multiple of it), or drop 'expert' from --mesh")
        return
    if not has_rules:
        raise UsageError(
            f"--moe_experts {FLAGS.moe_experts} with --layout {FLAGS.layout}: the table has no "
            "rules for the experts (block{i}_moe.*); use --layout transformer_lm_moe (experts "
            "over an expert axis) or transformer_lm_moe_batch (experts over batch)")
    axes = {axis for rule in table.rules if "_moe" in rule.pattern for axis in rule.dims
            if axis in ("expert", "batch") and rule.dims and rule.dims[0] == axis}
    for axis in sorted(axes):
        size = sizes.get(axis, 1)
        if FLAGS.moe_experts % size:
            raise UsageError(
                f"--moe_experts {FLAGS.moe_experts} is not divisible by mesh axis {axis!r} "
                f"(size {size}), over which --layout {FLAGS.layout} shards the experts; use a "
                f"multiple of {size} (e.g. {size * max(1, FLAGS.moe_experts // size)})")


# What a pipelined run (a stage axis) does not do yet, each refused with the flag's name.
PIPELINE_REFUSED = {
    "fsdp": "FSDP inside a stage", "remat": "remat inside a stage (each stage's backward already "
    "recomputes its forward)",
    "mixed_precision": "mixed precision in a pipeline", "moe_experts": "experts in a pipeline",
}


# The model settings a flag sets, named by the flag in a resume's check (dtk.train.resume).
SETTING_NAMES = (("model.*:Dropout.rate", "dropout"),
                 ("model.*:MultiHeadAttention.dropout", "dropout"),
                 ("model.*:BlockwiseAttention.dropout", "dropout"),
                 ("model.*:MixtureOfExperts.num_experts", "moe_experts"),
                 ("model.*:MixtureOfExperts.top_k", "moe_top_k"),
                 ("model.*:MixtureOfExperts.capacity_factor", "moe_capacity_factor"),
                 ("model.*:MixtureOfExperts.group_size", "moe_group_size"))


def _is_pipeline() -> bool:
    import dtk  # pylint: disable=g-import-not-at-top
    from dtk.parallel import pipeline  # pylint: disable=g-import-not-at-top
    if FLAGS.mesh == cli.AUTO_MESH:
        return False
    try:
        return pipeline.STAGE_AXIS in dtk.parse_mesh_spec(FLAGS.mesh).axis_names
    except ValueError:
        return False  # said by the mesh check


def _check_pipeline_flags() -> None:
    """A stage axis: --microbatches are the pipeline's; what it does not do is refused. Without
    one, the pipeline's flags are refused, and --microbatches is said to mean accumulation."""
    import logging  # pylint: disable=g-import-not-at-top
    if not _is_pipeline():
        given = [f"--{n}" for n in ("pipeline_schedule", "pipeline_boundaries") if FLAGS[n].present]
        if given:
            raise UsageError(f"{', '.join(given)} set(s) a pipeline, but --mesh {FLAGS.mesh} has "
                             "no stage axis; add one (e.g. --mesh stage=2,batch=4), or drop "
                             f"{', '.join(given)}")
        if FLAGS["microbatches"].present and FLAGS.grad_accum > 1:
            logging.getLogger("dtk").warning(
                "--microbatches %d without a stage axis: gradient accumulation over %d "
                "microbatches a step (as --grad_accum %d); a pipeline needs a stage axis in "
                "--mesh", FLAGS.grad_accum, FLAGS.grad_accum, FLAGS.grad_accum)
        return
    for name, what in PIPELINE_REFUSED.items():
        value = getattr(FLAGS, name)
        if value and (FLAGS[name].present or name == "moe_experts"):
            raise UsageError(f"--{name} with a stage axis in --mesh {FLAGS.mesh}: {what} is not "
                             f"supported yet; drop --{name}, or train without a stage axis")
    if FLAGS.shard_optimizer_state:
        raise UsageError(f"--shard_optimizer_state with a stage axis in --mesh {FLAGS.mesh}: each "
                         "stage updates its own weights in place; drop it")
    if FLAGS.global_batch_size % FLAGS.grad_accum:
        raise UsageError(f"--microbatches {FLAGS.grad_accum} does not divide --global_batch_size "
                         f"{FLAGS.global_batch_size}; use a divisor of it")


def generate(trainer, mesh, prompt: bytes, *, seq_len: int, n: int, temperature: float,
             seed: int) -> bytes:
    """Continues ``prompt`` by ``n`` bytes with the laid-out model (one compiled forward per byte).

    The window holds the last ``seq_len`` bytes, padded on the right; thanks to the causal mask
    the padding does not change the logits at the last real position, which are read.
    """
    import numpy as np  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(seed)
    rows = mesh.dim_size("batch")
    out = bytearray(prompt)
    for _ in range(n):
        context = out[-seq_len:]
        window = np.zeros((rows, seq_len), np.int32)
        window[:, :len(context)] = np.frombuffer(bytes(context), np.uint8)
        logits = (trainer.predict_value(window) if hasattr(trainer, "pipe") else
                  np.asarray(trainer.model.predict_on_batch(window)))
        last = logits[0, len(context) - 1].astype(np.float64)
        if temperature <= 0:
            token = int(np.argmax(last))
        else:
            p = np.exp((last - last.max()) / temperature)
            token = int(rng.choice(len(p), p=p / p.sum()))
        out.append(token)
    return bytes(out)


def _setup():
    """Every check before training: flags, the mesh, the table, the plan and the memory budget.
    Returns (spec, mesh, table, factory, plan, memory, the planner's plan under --mesh auto or
    --explain_plan, else None); raises UsageError/ValueError."""
    import functools  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    _check_flags()
    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, sequence  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.data import text  # pylint: disable=g-import-not-at-top

    factory = functools.partial(models.transformer_lm, vocab=text.VOCAB, seq_len=FLAGS.seq_len,
                                dim=FLAGS.dim, heads=FLAGS.heads, layers=FLAGS.layers,
                                dropout=FLAGS.dropout, attention=FLAGS.attention,
                                block_size=FLAGS.block_size, moe_experts=FLAGS.moe_experts,
                                moe_top_k=FLAGS.moe_top_k,
                                moe_capacity_factor=FLAGS.moe_capacity_factor,
                                moe_every=FLAGS.moe_every, moe_group_size=_moe_group_size())
    auto_plan = None
    if FLAGS.mesh == cli.AUTO_MESH or FLAGS.explain_plan:
        try:
            table = layouts.load_table(FLAGS.layout)
        except ValueError as e:
            raise UsageError(f"--layout: {e}") from None
        cli.check_explain_plan(FLAGS)
        auto_plan = cli.plan_from_flags(
            lambda name: getattr(FLAGS, name, None), factory, input_shape=(FLAGS.seq_len,),
            input_dtype="int32", num_classes=text.VOCAB, table=table,
            remat_patterns=models.MODEL_SPECS["lm"].remat, optimizer="adamw",
            global_batch_size=FLAGS.global_batch_size, pipeline=True)
        if FLAGS.explain_plan:
            return None, None, table, factory, None, None, auto_plan
        cli.apply_plan(FLAGS, auto_plan)
    spec, mesh, table = cli.mesh_and_table(lambda name: getattr(FLAGS, name, None))
    full_mesh = mesh
    if _is_pipeline():  # the layouts and checks of one stage's sub-mesh
        mesh = _check_pipeline(mesh, factory)
    _check_moe_mesh(mesh, table)
    if FLAGS.sequence_attention:
        table = dataclasses.replace(table, sequence_attention=FLAGS.sequence_attention)
    try:
        sequence.check_mesh(mesh, sequence_axis=table.sequence_axis,
                            sequence_parallel_axis=table.sequence_parallel_axis,
                            seq_len=FLAGS.seq_len, heads=FLAGS.heads,
                            attention=table.sequence_attention, fsdp=FLAGS.fsdp,
                            names={"seq_len": "--seq_len", "heads": "--heads",
                                   "fsdp": "--fsdp"})
    except ValueError as e:
        raise UsageError(f"--mesh {FLAGS.mesh}: {e}") from None
    if FLAGS.mixed_precision:
        tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    plan = layouts.plan_layouts(table, mesh, factory, allow_replicated=FLAGS.allow_replicated,
                                fsdp=FLAGS.fsdp)
    if full_mesh is not mesh:
        rows = mesh.dim_size(dtk.BATCH_AXIS) * FLAGS.grad_accum
        if FLAGS.global_batch_size % rows:
            raise UsageError(
                f"--global_batch_size {FLAGS.global_batch_size} does not split into --microbatches "
                f"{FLAGS.grad_accum} x mesh axis 'batch' of size {mesh.dim_size(dtk.BATCH_AXIS)} "
                f"(a stage's batch axis); use a multiple of {rows}")
    else:
        from dtk.train.input_checks import check_accumulation  # pylint: disable=g-import-not-at-top
        check_accumulation(FLAGS.global_batch_size, mesh, FLAGS.grad_accum)
    shard = FLAGS.shard_optimizer_state
    if shard is None:  # "auto": the estimate assumes it applies wherever the batch axis is split
        shard = mesh.dim_size(dtk.BATCH_AXIS) > 1 and full_mesh is mesh
    memory = layouts.memory_per_device(plan, optimizer_slots=2, shard_optimizer_state=shard)
    if FLAGS.device_memory_gb and full_mesh is mesh:  # in stages: each stage's, once built
        layouts.check_memory_budget(plan, FLAGS.device_memory_gb * 2 ** 30, optimizer_slots=2,
                                    shard_optimizer_state=shard)
    return spec, full_mesh, table, factory, plan, memory, auto_plan


def _check_pipeline(mesh, factory):
    """The first stage's sub-mesh, once the model is known to split into the stages asked
    (a lazy build: no weights stored). Raises UsageError naming the flag."""
    from dtk.parallel import materialize, pipeline  # pylint: disable=g-import-not-at-top
    try:
        meshes = pipeline.stage_meshes(mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {FLAGS.mesh}: {e}") from None
    try:
        pipeline.split(materialize.lazy_model(factory, None, "float32"), len(meshes),
                       FLAGS.pipeline_boundaries)
    except ValueError as e:
        flag = "--pipeline_boundaries" if FLAGS.pipeline_boundaries else f"--mesh {FLAGS.mesh}"
        raise UsageError(f"{flag}: {e}") from None
    return meshes[0]


def _prompt(corpus) -> bytes:
    """The sample's prompt: ``--prompt`` as given; else, on the user's own text, the first bytes
    of its held-out part's first line (a sample of that text, not of Python's ``def main(``)."""
    if FLAGS["prompt"].present or not FLAGS.text_file:
        return FLAGS.prompt.encode()
    lines = [line.strip() for line in corpus.heldout.splitlines() if line.strip()]
    start = lines[0] if lines else corpus.heldout
    return start[:max(1, min(16, FLAGS.seq_len - 1))] or b" "


def _load_text(say):
    """The corpus, checked against --seq_len, and its byte-unigram entropy (said)."""
    from dtk.data import text  # pylint: disable=g-import-not-at-top
    corpus = text.load_corpus(FLAGS.text_file)
    shortest = min(len(corpus.train), len(corpus.heldout))
    if FLAGS.seq_len + 2 > shortest:
        raise cli.UsageError(
            f"--seq_len {FLAGS.seq_len} needs windows of {FLAGS.seq_len + 1} bytes, but the text "
            f"has {len(corpus.train):,} training and {len(corpus.heldout):,} held-out bytes; use "
            f"--seq_len {max(shortest - 2, 1)} or less, or a longer text")
    unigram = text.unigram_bits_per_byte(corpus.train)
    say(f"text: {corpus.source}, {len(corpus.train):,} training and {len(corpus.heldout):,} "
        f"held-out bytes; byte-unigram entropy {unigram:.3f} bits/byte", flush=True)
    return corpus, unigram


def _datasets(corpus, mesh, seq_axis):
    """The training stream (an epoch: --eval_every steps) and the held-out batches."""
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.data import text  # pylint: disable=g-import-not-at-top
    train = input_lib.DistributedDataset(
        text.windows(corpus.train, seq_len=FLAGS.seq_len).repeat(), mesh,
        input_lib.InputConfig(global_batch_size=FLAGS.global_batch_size, sequence_axis=seq_axis,
                              shuffle=True, seed=FLAGS.seed, steps_per_epoch=FLAGS.eval_every))
    heldout = input_lib.DistributedDataset(
        text.windows(corpus.heldout, seq_len=FLAGS.seq_len), mesh,
        input_lib.InputConfig(global_batch_size=FLAGS.global_batch_size, sequence_axis=seq_axis,
                              remainder="pad", steps_per_epoch=None))
    heldout_batches = min(FLAGS.eval_batches, heldout.num_batches)
    heldout = input_lib.DistributedDataset(
        text.windows(corpus.heldout, seq_len=FLAGS.seq_len), mesh,
        input_lib.InputConfig(global_batch_size=FLAGS.global_batch_size, sequence_axis=seq_axis,
                              remainder="drop" if heldout_batches < heldout.num_batches else "pad",
                              steps_per_epoch=heldout_batches))
    return train, heldout


def _run_pipeline(spec, mesh, table, factory, say) -> dict:
    """A mesh with a stage axis: the model in stages (dtk.parallel.pipeline), trained by
    dtk.train.pipeline.PipelineSteps with the Trainer's optimizer (AdamW, weight decay 0.01, the
    gradients clipped to a global norm of 1), the same batches, held-out evaluations and
    sample."""
    import statistics  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    from dtk.data import text  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, pipeline  # pylint: disable=g-import-not-at-top
    from dtk.train import pipeline as pipeline_steps  # pylint: disable=g-import-not-at-top
    config = pipeline.PipelineConfig(
        microbatches=FLAGS.grad_accum, schedule=FLAGS.pipeline_schedule,
        boundaries=tuple(FLAGS.pipeline_boundaries) if FLAGS.pipeline_boundaries else None)
    pipe = pipeline.build(factory, mesh, table, seed=FLAGS.seed, config=config,
                          allow_replicated=FLAGS.allow_replicated)
    stages = len(pipe.models)
    say(f"pipeline: {stages} stages, {config.microbatches} microbatches, {config.schedule}; "
        f"bubble (S - 1) / (M + S - 1) = {pipeline.bubble(stages, config.microbatches):.1%}\n"
        + pipe.explain(), flush=True)
    memory = [layouts.memory_per_device(plan, optimizer_slots=2) for plan in pipe.plans]
    if FLAGS.device_memory_gb:
        for stage, plan in enumerate(pipe.plans):
            layouts.check_memory_budget(plan, FLAGS.device_memory_gb * 2 ** 30, stage=stage,
                                        optimizer_slots=2)
    if FLAGS.explain_layouts:
        for s, plan in enumerate(pipe.plans):
            print(f"-- stage {s}\n{layouts.explain(plan)}")
            if FLAGS.device_memory_gb:
                print(layouts.budget_note(memory[s], FLAGS.device_memory_gb * 2 ** 30))
        return {}
    steps = pipeline_steps.PipelineSteps(
        pipe, loss="sparse_categorical_crossentropy", optimizer="adamw", config=config,
        optimizer_kwargs={"learning_rate": FLAGS.learning_rate, "weight_decay": 0.01,
                          "global_clipnorm": 1.0}, global_batch_size=FLAGS.global_batch_size)
    corpus, unigram = _load_text(say)
    train, heldout = _datasets(corpus, pipe.meshes[0], None)
    curve, times = [], []
    history: dict = {"epochs": [], "logs": {"loss": [], "val_loss": []}}
    tokens_per_epoch = FLAGS.eval_every * FLAGS.global_batch_size * FLAGS.seq_len
    if FLAGS.export_dir and not all(steps.local):  # refused before training, not after
        raise UsageError(f"--export_dir: export of pipeline stages on several clients (mesh "
                         f"{spec}) is not supported yet: each client reads its own stages' "
                         "weights only. Train the stages in one process to export them")
    writer = None
    if FLAGS.tensorboard_dir and dtk.cluster.env.is_lead_client():  # the Trainer's scalars
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        writer = tf.summary.create_file_writer(FLAGS.tensorboard_dir)
    saver, settings, changes = None, None, {}
    epoch, skip = 0, 0
    if FLAGS.checkpoint_dir:
        saver, settings = _pipeline_checkpointer(pipe, steps, train)
        state = saver.restore() if not FLAGS.restart_from_scratch else None
        if FLAGS.restart_from_scratch and dtk.cluster.env.is_lead_client() and saver.candidates():
            say(f"restart_from_scratch: removing the checkpoints in {FLAGS.checkpoint_dir}")
            saver.clear()
        if state is not None:
            epoch, skip, changes = _resume_pipeline(state, settings, saver, steps, train, say)
            history = state["history"]

    def heldout_loss():
        sums = [steps.evaluate(*batch[:3]) for batch in heldout.global_batches(0)]
        return sum(t for t, _ in sums) / sum(c for _, c in sums), int(sum(c for _, c in sums))

    done = steps.iterations
    # SIGTERM/SIGINT: saved at the next step boundary, then Preempted (as dtk.Trainer does)
    from dtk.train import preemption  # pylint: disable=g-import-not-at-top
    stop = preemption.StopSignals()
    if saver is not None:
        stop.install()
    for epoch in range(epoch, -(-FLAGS.steps // FLAGS.eval_every)):
        start, losses = time.perf_counter(), []
        for i, batch in enumerate(train.global_batches(epoch)):
            if done == FLAGS.steps or stop.signum is not None:
                break
            if i < skip:  # trained before the checkpoint this run resumed from
                continue
            began = time.perf_counter()
            losses.append(steps.train(*batch[:3]))
            times.append(time.perf_counter() - began)
            done += 1
        skip = 0
        if not losses:
            if stop.signum is not None:
                break
            continue
        loss = heldout_loss()[0]
        bpb = text.bits_per_byte(loss)
        position = done - epoch * train.num_batches
        if saver is not None and position < train.num_batches:
            # stopped inside the epoch (--steps): its position, as dtk.Trainer saves it (the
            # history without the partial epoch, which a resume trains again)
            saver.save({"epoch": epoch, "batch_in_epoch": position,
                        "steps_per_epoch": train.num_batches, "auto_steps_per_call": None,
                        "settings": settings, "history": history}, step=done)
        history["epochs"].append(epoch)
        history["logs"].setdefault("loss", []).append(float(np.mean(losses)))
        history["logs"].setdefault("val_loss", []).append(loss)
        curve.append({"step": done, "heldout_bits_per_byte": bpb})
        if writer is not None:  # as dtk.Trainer writes an epoch's logs
            with writer.as_default():
                for key in ("loss", "val_loss"):
                    tf.summary.scalar(key, history["logs"][key][-1], step=epoch + 1)
            writer.flush()
        say(f"step {done}: train loss {history['logs']['loss'][-1]:.4f}, held-out {bpb:.3f} "
            f"bits/byte (unigram {unigram:.3f}), "
            f"{tokens_per_epoch / (time.perf_counter() - start):,.0f} tokens/s", flush=True)
        if saver is not None and position == train.num_batches:  # as dtk.Trainer at an epoch's end
            saver.save({"epoch": epoch + 1, "batch_in_epoch": 0,
                        "steps_per_epoch": train.num_batches, "auto_steps_per_call": None,
                        "settings": settings, "history": history}, step=done)
        if stop.signum is not None:
            break
    stop.uninstall()
    if stop.signum is not None and done < FLAGS.steps:
        saver.close()  # the save finished and recorded, the directory released
        raise preemption.Preempted(stop.signum, saver.latest, done)
    if saver is not None:
        saver.close()
    loss, windows = heldout_loss()
    heldout_bpb = text.bits_per_byte(loss)
    say(f"held-out: {heldout_bpb:.3f} bits/byte vs {unigram:.3f} for the byte unigram "
        f"({windows} windows)", flush=True)
    sample = b""
    if FLAGS.sample_bytes:
        sample = generate(steps, pipe.meshes[0], _prompt(corpus), seq_len=FLAGS.seq_len,
                          n=FLAGS.sample_bytes, temperature=FLAGS.temperature, seed=FLAGS.seed)
        say("sample:\n" + sample.decode("utf-8", errors="replace"), flush=True)
    exported = steps.export(factory, FLAGS.export_dir) if FLAGS.export_dir else None
    cli.keep_until_exit(train, heldout)
    return {
        "export": exported,
        "mesh": str(spec), "num_clients": dtk.cluster.env.num_clients(), "layout": FLAGS.layout,
        "pipeline": {"stages": stages, "microbatches": config.microbatches,
                     "schedule": config.schedule, "units": [list(u) for u in pipe.units],
                     "bubble": pipeline.bubble(stages, config.microbatches)},
        "planned_bytes_per_device": max(memory, key=lambda m: m["total"]),
        "planned_bytes_per_device_by_stage": memory,
        "resume_changes": changes, "run_id": saver.run_id if saver is not None else None,
        "steps": done, "seq_len": FLAGS.seq_len, "dim": FLAGS.dim, "heads": FLAGS.heads,
        "layers": FLAGS.layers, "global_batch_size": FLAGS.global_batch_size,
        "train_loss": history["logs"]["loss"], "heldout_curve": curve,
        "heldout_bits_per_byte": heldout_bpb,
        "unigram_bits_per_byte": unigram,
        # None when this run trained no step (a finished run run again), as the Trainer's
        "ms_per_step_median": 1000 * statistics.median(times[1:] or times) if times else None,
        "first_step_s": times[0] if times else None,
        "sample": sample.decode("utf-8", errors="replace"),
        "wall_s": time.perf_counter() - _START,
    }


def _pipeline_checkpointer(pipe, steps, train):
    """The checkpointer of a pipelined run, and the settings it records: the checkpoint is the
    whole model's, as the Trainer writes it (``PipelineSteps.checkpoint_objects``), so either
    resumes the other, on any mesh."""
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    from dtk.train import checkpoint, resume  # pylint: disable=g-import-not-at-top
    try:
        model, optimizer = steps.checkpoint_objects()
    except ValueError as e:
        raise UsageError(f"--checkpoint_dir: {e}") from None
    saver = checkpoint.Checkpointer(FLAGS.checkpoint_dir, model=model, optimizer=optimizer,
                                    mesh=pipe.mesh, host_write=True,
                                    asynchronous=FLAGS.async_checkpoints)
    sizes = dict(zip(pipe.mesh.dim_names, (pipe.mesh.dim_size(n) for n in pipe.mesh.dim_names)))
    settings = resume.named(resume.settings(
        seed=FLAGS.seed, optimizer=steps.local_optimizer, model=pipe.whole, data=train,
        mesh=",".join(f"{k}={v}" for k, v in sizes.items()),
        num_clients=dtk.cluster.env.num_clients(),
        extra={"corpus": FLAGS.text_file or "stdlib"}), SETTING_NAMES)
    return saver, settings


def _resume_pipeline(state, settings, saver, steps, train, say):
    """Checks a restored checkpoint's settings, as the Trainer does; ``(epoch, batches of it
    trained, the changes allowed)``."""
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    from dtk.train import resume  # pylint: disable=g-import-not-at-top
    changes = resume.check(resume.named(state.get("settings") or {}, SETTING_NAMES), settings,
                           allow_change=FLAGS.allow_change, restored=saver.restored,
                           lead=dtk.cluster.env.is_lead_client())
    steps.restored()
    rate = changes.get("learning_rate", {}).get("new")
    if isinstance(rate, float):
        for opt in steps.optimizers:
            opt.learning_rate.assign(rate)
    epoch, skip = int(state["epoch"]), int(state["batch_in_epoch"])
    if state.get("steps_per_epoch") != train.num_batches:
        raise UsageError(f"checkpoint {saver.restored} was written with "
                         f"{state.get('steps_per_epoch')} steps per epoch, this run has "
                         f"{train.num_batches} (--eval_every); use the same, or a new "
                         "--checkpoint_dir")
    if skip >= train.num_batches:
        epoch, skip = epoch + 1, 0
    say(f"resumed from {saver.restored}: step {steps.iterations}", flush=True)
    if steps.iterations >= FLAGS.steps:
        say(f"the run is already complete: {saver.restored} is at step {steps.iterations} of "
            f"{FLAGS.steps}; nothing is trained (raise --steps to train further)", flush=True)
    return epoch, skip, changes


def run() -> dict:
    import dtk  # pylint: disable=g-import-not-at-top
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import experts, layouts, sequence  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.data import text  # pylint: disable=g-import-not-at-top
    spec, mesh, table, factory, plan, memory, auto_plan = _setup()
    lead = dtk.cluster.env.is_lead_client()
    say = print if lead else (lambda *a, **k: None)
    if FLAGS.explain_plan:
        say(auto_plan.explain(), flush=True)
        return {}
    if auto_plan is not None:
        say(auto_plan.explain().splitlines()[-1], flush=True)
    say(dtk.describe_mesh(mesh), flush=True)
    if _is_pipeline():
        summary = _run_pipeline(spec, mesh, table, factory, say)
        return {**summary, "auto_plan": cli.plan_summary(auto_plan)} if summary else summary
    if FLAGS.explain_layouts:
        print(layouts.explain(plan))
        if FLAGS.device_memory_gb:
            print(layouts.budget_note(memory, FLAGS.device_memory_gb * 2 ** 30))
        return {}

    corpus, unigram = _load_text(say)
    # token ids sharded along the sequence too, where the mesh has the table's sequence axis
    seq_axis = table.sequence_axis if table.sequence_axis in mesh.dim_names else None
    train, heldout = _datasets(corpus, mesh, seq_axis)
    optimizer = dtk.make_optimizer("adamw", mesh, learning_rate=FLAGS.learning_rate,
                                   weight_decay=0.01, global_clipnorm=1.0)
    trainer = dtk.Trainer(
        mesh=mesh, model=factory, layout=table, optimizer=optimizer,
        allow_replicated=FLAGS.allow_replicated,
        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        config=dtk.TrainerConfig(seed=FLAGS.seed, checkpoint_dir=FLAGS.checkpoint_dir,
                                 tensorboard_dir=FLAGS.tensorboard_dir,
                                 restart_from_scratch=FLAGS.restart_from_scratch,
                                 allow_change=tuple(FLAGS.allow_change),
                                 settings={"corpus": FLAGS.text_file or "stdlib"},
                                 setting_names=SETTING_NAMES,
                                 shard_optimizer_state=("auto" if FLAGS.shard_optimizer_state is None
                                                        else FLAGS.shard_optimizer_state),
                                 max_steps=FLAGS.steps, verbose=1 if lead else 0,
                                 fsdp=FLAGS.fsdp, gradient_accumulation_steps=FLAGS.grad_accum,
                                 async_checkpoints=FLAGS.async_checkpoints,
                                 remat=models.MODEL_SPECS["lm"].remat_patterns(FLAGS.remat)))
    say(layouts.explain(trainer.layout_plan).splitlines()[-1] +
        f"; per device: weights {memory['weights'] / 2**20:.2f} MiB + AdamW state "
        f"{memory['optimizer'] / 2**20:.2f} MiB", flush=True)

    curve = []
    tokens_per_epoch = FLAGS.eval_every * FLAGS.global_batch_size * FLAGS.seq_len
    clock = {"t": time.perf_counter()}

    def report(epoch, logs):
        now = time.perf_counter()
        bpb = text.bits_per_byte(logs["val_loss"])
        routing = experts.routing_stats(trainer.model)  # this interval's training steps
        experts.reset_routing_stats(trainer.model)
        curve.append({"step": trainer.global_step, "heldout_bits_per_byte": bpb, **routing})
        say(f"step {trainer.global_step}: train loss {logs['loss']:.4f}, held-out "
            f"{bpb:.3f} bits/byte (unigram {unigram:.3f}), "
            f"{tokens_per_epoch / (now - clock['t']):,.0f} tokens/s", flush=True)
        if routing:
            say("  " + experts.describe_routing(routing, FLAGS.moe_capacity_factor), flush=True)
        clock["t"] = now

    epochs = -(-FLAGS.steps // FLAGS.eval_every)
    history = trainer.fit(train, epochs=epochs, validation_data=heldout, on_epoch_end=[report])
    final = trainer.evaluate(heldout)
    heldout_bpb = text.bits_per_byte(final["loss"])
    say(f"held-out: {heldout_bpb:.3f} bits/byte vs {unigram:.3f} for the byte unigram "
        f"({final['examples']} windows)", flush=True)
    sample = b""
    if FLAGS.sample_bytes:
        sample = generate(trainer, mesh, _prompt(corpus), seq_len=FLAGS.seq_len,
                          n=FLAGS.sample_bytes, temperature=FLAGS.temperature, seed=FLAGS.seed)
        say("sample:\n" + sample.decode("utf-8", errors="replace"), flush=True)
    exported = trainer.export(FLAGS.export_dir) if FLAGS.export_dir else None
    cli.keep_until_exit(train, heldout)  # no time spent tearing them down
    return {
        "export": exported,
        "mesh": str(spec), "num_clients": dtk.cluster.env.num_clients(), "layout": FLAGS.layout,
        "resume_changes": trainer.resume_changes, "run_id": trainer.run_id,
        "fsdp": FLAGS.fsdp, "remat_layers": trainer.remat_layers,
        "grad_accum": FLAGS.grad_accum, "planned_bytes_per_device": memory,
        "auto_plan": cli.plan_summary(auto_plan),
        "steps": trainer.global_step, "seq_len": FLAGS.seq_len, "dim": FLAGS.dim,
        "heads": FLAGS.heads, "layers": FLAGS.layers, "global_batch_size": FLAGS.global_batch_size,
        "moe": {"experts": FLAGS.moe_experts, "top_k": FLAGS.moe_top_k,
                "capacity_factor": FLAGS.moe_capacity_factor, "every": FLAGS.moe_every,
                "group_size": _moe_group_size()} if FLAGS.moe_experts else None,
        "train_loss": history.history.get("loss", []),
        "heldout_curve": curve, "heldout_bits_per_byte": heldout_bpb,
        "unigram_bits_per_byte": unigram,
        "weights_bytes_per_device": memory["weights"],
        "optimizer_bytes_per_device": memory["optimizer"],
        "ms_per_step_median": trainer.timing.ms_per_step_median(skip_epoch=0),
        "first_step_s": trainer.timing.first_step_s,
        "sample": sample.decode("utf-8", errors="replace"),
        "wall_s": time.perf_counter() - _START,
    }


def main(argv):
    from dtk import cli  # pylint: disable=g-import-not-at-top
    return cli.main(argv, run, verbose=FLAGS["verbosity"].present,
                    summary_json=FLAGS.summary_json, precheck=_check_text_file)



# ``dtk-train-lm`` (a console script) and ``python scripts/train_lm.py``
entry = cli.entry_point(main, __name__)


if __name__ == "__main__":
    entry()
