"""The transformer language model: parity with one device on every data x model mesh, the text
windows, the memory budget, and scripts/train_lm.py end to end."""

import concurrent.futures
import functools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk
from dtk.data import input as input_lib
from dtk.parallel import layouts, ops
from dtk import models
from dtk.data import text
from tests import procs

FACTORY = functools.partial(models.transformer_lm, vocab=64, seq_len=16, dim=32, heads=8,
                            layers=1)
B, N = 8, 10
MESHES = ["batch=8", "batch=4,model=2", "batch=2,model=4", "batch=1,model=8"]


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 64, (N, B, 16)).astype(np.int32),
            rng.integers(0, 64, (N, B, 16)).astype(np.int64))


def _optimizer(name, mesh=None):
    kwargs = {"learning_rate": 3e-3} | ({"weight_decay": 0.01} if name == "adamw" else {})
    cls = {"adam": tf_keras.optimizers.Adam, "adamw": tf_keras.optimizers.AdamW}[name]
    return cls(mesh=mesh, **kwargs) if mesh is not None else cls(**kwargs)


@functools.lru_cache(maxsize=None)
def _reference(opt_name, wide=False):
    """One device's losses over N steps: FACTORY on 16 positions, or WIDE on the first 4."""
    tf_keras.utils.set_random_seed(7)
    model = WIDE() if wide else FACTORY()
    opt = _optimizer(opt_name)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    x, y = _data()
    length = 4 if wide else 16
    return np.array([float(step(x[i, :, :length], y[i, :, :length])) for i in range(N)])


@pytest.mark.parametrize("spec, opt_name, shard", [  # every mesh; Adam, AdamW; sharded update
    pytest.param("batch=8", "adam", False, marks=pytest.mark.slow),
    ("batch=4,model=2", "adamw", False),
    pytest.param("batch=2,model=4", "adam", True, marks=pytest.mark.slow),
    pytest.param("batch=1,model=8", "adamw", True, marks=pytest.mark.slow)])
def test_lm_parity_with_one_device(spec, opt_name, shard, monkeypatch):
    # This LM's weights are small: the sharded update splits those of 1,024 elements a device
    # and more here (its default threshold would leave them all in place).
    monkeypatch.setattr(layouts, "SHARDED_UPDATE_MIN_ELEMENTS", 1 << 10)
    mesh = dtk.build_mesh(spec)
    model, plan = layouts.build_model(FACTORY, mesh, "transformer_lm", seed=7)
    if "model" in spec:
        kernel = {w.path: w.spec() for w in plan.weights}["block0_attn._query_dense.kernel"]
        assert kernel == "[unsharded, model, unsharded]"
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=_optimizer(opt_name, mesh), mesh=mesh,
                      config=dtk.StepConfig(shard_optimizer_state=shard))
    sharded = model._dtk_mesh_state.sharded  # pylint: disable=protected-access
    assert steps.shard_optimizer_state == shard
    assert not shard or mesh.dim_size("batch") == 1 or any(
        sharded.entry(v) is not None for v in model.trainable_variables)
    x, y = _data()
    losses = [float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(B, np.float32)))))
              for i in range(N)]
    np.testing.assert_allclose(losses, _reference(opt_name), rtol=1e-5)


def test_every_weight_has_a_rule_and_model_shards_most_bytes():
    plan = layouts.plan_layouts("transformer_lm", dtk.build_mesh("batch=1,model=8"), FACTORY,
                                strict=True)
    assert all(w.rule is not None for w in plan.weights)   # default = "error" would have raised
    total = sum(w.bytes_total for w in plan.weights)
    per_device = sum(w.bytes_per_device for w in plan.weights)
    assert per_device < total / 3


# The LM's own table with its token embedding sharded on dim 0 (the vocabulary) instead of dim 1.
_FEATURES_RULE = 'pattern = \'embed\\.embeddings\'\ndims = ["unsharded", "model"]'
_LM_TABLE = (procs.REPO / "layouts" / "transformer_lm.toml").read_text()
assert _FEATURES_RULE in _LM_TABLE, "the LM table's embedding rule changed"


def _rows_table(axis):
    return _LM_TABLE.replace(_FEATURES_RULE, _FEATURES_RULE.replace('["unsharded", "model"]',
                                                                    f'["{axis}", "unsharded"]'))


@pytest.mark.parametrize("spec, axis", [("batch=4,model=2", "model"), ("batch=2,model=4", "model"),
                                        ("batch=8", "batch")])
def test_vocab_sharded_embedding_trains_like_one_device(tmp_path, caplog, monkeypatch, spec, axis):
    """Issue 43: a table sharded on its rows (DTensor's gather refuses it) is looked up block by
    block (dtk.parallel.ops.row_sharded_lookup): the same losses as one device, and the table and
    its gradient stay sharded on their rows."""
    monkeypatch.setattr(ops, "DENSE_UPDATE_WARN_BYTES", 0)  # said from 1 MiB a device
    table = tmp_path / "rows.toml"
    table.write_text(_rows_table(axis))
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(FACTORY, mesh, str(table), seed=7)
    embeddings = model.get_layer("embed").embeddings
    assert dtensor.fetch_layout(embeddings).sharding_specs[0] == axis
    with caplog.at_level("WARNING", logger="dtk"):
        steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                          optimizer=_optimizer("adam", mesh), mesh=mesh,
                          config=dtk.StepConfig(shard_optimizer_state=False))
    # the update stays dense by default: its cost is said
    assert "Embedding 'embed': its table [64, 32] is sharded on its rows over axis" in caplog.text
    assert "its gradient and optimizer update are dense (the default" in caplog.text
    assert steps.sparse is None
    x, y = _data()
    losses = [float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(B, np.float32)))))
              for i in range(N)]
    np.testing.assert_allclose(losses, _reference("adam"), rtol=1e-5)
    assert dtensor.fetch_layout(embeddings).sharding_specs[0] == axis


@pytest.mark.slow
def test_an_id_outside_a_row_sharded_table_fails_the_step(tmp_path):
    """An id no block owns would look up zeros; like plain Keras on CPU, the step fails instead,
    naming the table's range and the id (in a fresh process: a failed step cancels DTensor's
    collectives for the rest of its process)."""
    res = procs.run_python(textwrap.dedent("""
        import pathlib, sys
        import numpy as np, dtk
        from dtk.parallel import layouts
        from dtk.data import input as input_lib
        from tests import test_lm as t
        table = pathlib.Path(sys.argv[1])
        table.write_text(t._rows_table("model"))
        mesh = dtk.build_mesh("batch=4,model=2", device_type="cpu")
        model, _ = layouts.build_model(t.FACTORY, mesh, str(table), seed=7)
        steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                          optimizer=t._optimizer("adam", mesh), mesh=mesh)
        x, y = t._data()
        x[0, 0, 0] = 70
        try:
            float(steps.train(input_lib.pack(mesh, (x[0], y[0], np.ones(t.B, np.float32)))))
        except Exception as e:  # pylint: disable=broad-except
            print("FAILED", type(e).__name__, " ".join(str(e).split())[:4000])
        """), args=(str(tmp_path / "rows.toml"),), timeout=200)
    assert "FAILED InvalidArgumentError" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    assert "an id is outside the rows of Embedding" in res.stdout
    assert "(its table has 64 rows, sharded on them over mesh axis model): ids must be in [0, 64)" \
        in res.stdout
    assert "[70]" in res.stdout


# Wide enough for few tokens (4 a row) that FSDP gathers the MLP's activations instead of its
# kernels, and narrow enough that attention's kernels are gathered (dtk.parallel.fsdp).
WIDE = functools.partial(models.transformer_lm, vocab=64, seq_len=4, dim=64, heads=8, layers=1)


@pytest.mark.parametrize("spec, table, embed", [
    # issue 57: the table the mesh leaves whole, cut on its rows by FSDP alone, is gathered
    # (it was looked up block by block, which replicated every activation after it)
    ("batch=8", None, ("[batch, unsharded]", "[unsharded, unsharded]")),
    # feature-sharded over model, cut on its rows over batch by FSDP
    ("batch=4,model=2", None, ("[batch, model]", "[unsharded, model]")),
    # row-sharded over model, cut on its features over batch: looked up block by block
    ("batch=4,model=2", "model", ("[model, batch]", "[model, unsharded]")),
    # row-sharded over batch: FSDP has no dim left to cut
    pytest.param("batch=8", "batch", ("[batch, unsharded]", None), marks=pytest.mark.slow)])
def test_fsdp_matches_one_device_on_every_table_path(tmp_path, monkeypatch, spec, table, embed):
    """FSDP meets every path the LM's rules take: tables sharded on rows or features, kernels
    gathered and kernels whose layer gathers its activations instead, weights FSDP cannot cut
    (kept replicated). One device's losses over 10 steps (1e-5)."""
    from dtk.parallel import fsdp  # pylint: disable=import-outside-toplevel
    plan_of, chosen = fsdp._activation_plan, set()  # pylint: disable=protected-access

    def recorded(layer, inputs):
        result = plan_of(layer, inputs)
        if result is not None:
            chosen.add(layer.name)
        return result

    monkeypatch.setattr(fsdp, "_activation_plan", recorded)
    path = "transformer_lm"
    if table:
        path = tmp_path / "rows.toml"
        path.write_text(_rows_table(table))
    mesh = dtk.build_mesh(spec)
    model, plan = layouts.build_model(WIDE, mesh, str(path), seed=7, fsdp=True)
    weights = {w.path: w for w in plan.weights}
    stored, computed = embed
    assert weights["embed.embeddings"].spec() == stored
    compute_dims = weights["embed.embeddings"].compute_dims
    assert (compute_dims and "[" + ", ".join(d or "unsharded" for d in compute_dims) + "]") \
        == computed
    assert weights["block0_ff1.kernel"].compute_dims is not None
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=_optimizer("adam", mesh), mesh=mesh)
    x, y = _data()
    losses = [float(steps.train(input_lib.pack(
        mesh, (x[i, :, :4], y[i, :, :4], np.ones(B, np.float32))))) for i in range(N)]
    np.testing.assert_allclose(losses, _reference("adam", wide=True), rtol=1e-5)
    # both of FSDP's paths ran on batch=8: the MLP gathered its activations, attention its
    # kernels (on model meshes, kernels the table shards over model are gathered)
    if "model" in spec:
        assert not chosen
    else:
        assert {"block0_ff1", "block0_ff2"} <= chosen and not chosen & {"query", "key", "value"}
    embeddings = model.get_layer("embed").embeddings
    assert dtensor.fetch_layout(embeddings).sharding_specs == \
        [d.strip() for d in stored[1:-1].split(",")]


def test_memory_budget_shows_the_arithmetic():
    big = functools.partial(models.transformer_lm, vocab=256, seq_len=128, dim=1024, heads=8,
                            layers=4)
    replicated = layouts.plan_layouts("transformer_lm", dtk.build_mesh("batch=8"), big)
    sharded = layouts.plan_layouts("transformer_lm", dtk.build_mesh("batch=1,model=8"), big)
    budget = 0.25 * 2 ** 30
    with pytest.raises(ValueError, match=r"weights .* \+ optimizer state .* = .* per device > "
                                         r"budget 256.0 MiB.*model=8"):
        layouts.check_memory_budget(replicated, budget)
    memory = layouts.check_memory_budget(sharded, budget)
    assert memory["total"] < budget
    full = layouts.memory_per_device(replicated)
    assert full["optimizer"] == 2 * full["weights"]
    assert memory["weights"] < full["weights"] / 6


def test_text_windows_and_corpus():
    corpus = text.load_corpus(max_bytes=2_000_000)
    assert len(corpus.train) > 10 * len(corpus.heldout) > 0
    assert 4.0 < text.unigram_bits_per_byte(corpus.train) < 6.0
    data = list(text.windows(b"abcdefghij" * 3, seq_len=4).as_numpy_iterator())
    x, y = data[0]
    assert bytes(x.astype(np.uint8)) == b"abcd" and bytes(y.astype(np.uint8)) == b"bcde"
    assert len(data) == (30 - 5) // 4 + 1
    with pytest.raises(ValueError, match="cannot be read"):
        text.load_corpus("/no/such/file.txt")


@pytest.mark.slow
def test_train_lm_learns_and_generates(tmp_path):
    summary = tmp_path / "lm.json"
    res = subprocess.run(
        [sys.executable, str(procs.REPO / "scripts" / "train_lm.py"), "--mesh", "batch=2,model=4",
         "--steps", "60", "--eval_every", "30", "--eval_batches", "4", "--sample_bytes", "20",
         "--seq_len", "64", "--dropout", "0.1", "--layers", "1",
         "--summary_json", str(summary)],
        capture_output=True, text=True, timeout=400, cwd=procs.REPO, env=procs.base_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert len(s["train_loss"]) == 2 and s["train_loss"][1] < s["train_loss"][0]
    assert s["heldout_bits_per_byte"] < s["unigram_bits_per_byte"] - 0.3
    assert s["sample"].startswith("def main(") and len(s["sample"].encode()) >= 29
    assert "held-out" in res.stdout and "bits/byte" in res.stdout and "tokens/s" in res.stdout


def _train_lm(tmp_path, name, *flags):
    summary = tmp_path / f"{name}.json"
    res = subprocess.run(
        [sys.executable, str(procs.REPO / "scripts" / "train_lm.py"), "--steps", "12",
         "--eval_every", "6", "--eval_batches", "1", "--sample_bytes", "0", "--seq_len", "32",
         "--layers", "1", "--dim", "32", "--heads", "4", "--global_batch_size", "16",
         "--dropout", "0.1", "--summary_json", str(summary), *flags],
        capture_output=True, text=True, timeout=400, cwd=procs.REPO,
        env=procs.base_env(DTK_PLAN_CACHE=str(tmp_path / "plan_cache.json")))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.slow
def test_train_lm_mesh_auto_equals_its_plan_given_by_hand(tmp_path):
    """``--mesh auto`` (with dropout 0.1) trains with the plan it reports: the
    same plan given by hand gives the same losses (1e-6), and batch=1 the same to the parity
    tolerance (1e-5). The batch=1 run goes beside the auto run (two single-process runs, so at
    most 4 TensorFlow processes with the two test workers)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        one_run = pool.submit(_train_lm, tmp_path, "one", "--mesh", "batch=1")
        auto = _train_lm(tmp_path, "auto", "--mesh", "auto")
        one = one_run.result()
    plan = auto["auto_plan"]
    assert plan and plan["chosen"].split()[0] == auto["mesh"], plan
    by_hand = ["--mesh", auto["mesh"], "--grad_accum", str(auto["grad_accum"]),
               "--fsdp" if auto["fsdp"] else "--nofsdp"]
    if auto["remat_layers"]:
        by_hand += ["--remat", "blocks"]
    if "zero" not in plan["chosen"].split()[1:]:
        by_hand.append("--noshard_optimizer_state")
    given = _train_lm(tmp_path, "given", *by_hand)
    np.testing.assert_allclose(auto["train_loss"], given["train_loss"], rtol=1e-6)
    np.testing.assert_allclose(auto["train_loss"], one["train_loss"], rtol=1e-5)


@pytest.mark.slow
def test_train_lm_seq_len_longer_than_the_text_names_the_flag(tmp_path):
    """Issue 41: one error line that names --seq_len and the longest that fits."""
    corpus = tmp_path / "short.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 2000)
    res = subprocess.run(
        [sys.executable, str(procs.REPO / "scripts" / "train_lm.py"), "--text_file", str(corpus),
         "--seq_len", "100000", "--steps", "2"],
        capture_output=True, text=True, timeout=200, cwd=procs.REPO, env=procs.base_env())
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--seq_len 100000 needs windows of 100001 bytes" in errors[0], \
        res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    # Issue 70: the sample of the user's own text starts from that text, not from "def main(".
    res = subprocess.run(
        [sys.executable, str(procs.REPO / "scripts" / "train_lm.py"), "--text_file", str(corpus),
         "--seq_len", "32", "--steps", "2", "--eval_every", "2", "--layers", "1", "--dim", "32",
         "--heads", "4", "--global_batch_size", "8", "--sample_bytes", "4"],
        capture_output=True, text=True, timeout=200, cwd=procs.REPO, env=procs.base_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "sample:\ndef f(x):" in res.stdout, res.stdout[-500:]


@pytest.mark.slow
def test_train_lm_fsdp_at_width_trains_like_one_device(tmp_path):
    """Issue 57: ``train_lm.py --fsdp`` at a width where FSDP gathers the MLP's activations (dim
    256, 128 tokens a step) failed at its first step on batch=8 (its table, cut on its rows by
    FSDP, was looked up block by block). It trains like batch=1 (1e-5) in one process, and on 2
    clients x 4 with the table row-sharded over model (looked up block by block, stored cut over
    batch across the clients), with dropout."""
    width = ("--dim", "256", "--seq_len", "8", "--heads", "8")
    rows = tmp_path / "rows.toml"
    rows.write_text(_rows_table("model"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        one_run = pool.submit(_train_lm, tmp_path, "one", "--mesh", "batch=1", *width)
        fsdp = _train_lm(tmp_path, "fsdp", "--mesh", "batch=8", "--fsdp", *width)
        one = one_run.result()
    np.testing.assert_allclose(fsdp["train_loss"], one["train_loss"], rtol=1e-5)
    summary = tmp_path / "two.json"
    res = subprocess.run(
        [sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2",
         "--devices_per_client", "4", "--", sys.executable,
         str(procs.REPO / "scripts" / "train_lm.py"), "--steps", "12", "--eval_every", "6",
         "--eval_batches", "1", "--sample_bytes", "0", "--layers", "1",
         "--global_batch_size", "16", "--dropout", "0.1", "--summary_json", str(summary),
         "--mesh", "batch=4,model=2", "--fsdp", "--layout", str(rows), *width],
        capture_output=True, text=True, timeout=400, cwd=procs.REPO, env=procs.base_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    two = json.loads(summary.read_text())
    np.testing.assert_allclose(two["train_loss"], one["train_loss"], rtol=1e-5)


def test_a_changed_dropout_is_named_and_allowed_by_the_flag(tmp_path):
    """Issue 59: --allow_change dropout was refused, and the refusal listed names such as
    model.4:Dropout.rate; the LM script names them by its flag (TrainerConfig.setting_names)."""
    mesh = dtk.build_mesh("batch=8")
    x, y = _data()
    names = (("model.*:Dropout.rate", "dropout"), ("model.*:MultiHeadAttention.dropout",
                                                   "dropout"))

    def fit(dropout, **config):
        trainer = dtk.Trainer(
            mesh=mesh, model=functools.partial(FACTORY, dropout=dropout),
            layout="transformer_lm", allow_replicated=True, optimizer=_optimizer("adam", mesh),
            loss="sparse_categorical_crossentropy",
            config=dtk.TrainerConfig(seed=7, verbose=0, checkpoint_dir=str(tmp_path),
                                     steps_per_execution=1, setting_names=names, **config))
        data = input_lib.DistributedDataset(
            tf.data.Dataset.from_tensor_slices((x.reshape(-1, 16), y.reshape(-1, 16))), mesh,
            input_lib.InputConfig(global_batch_size=B))
        trainer.fit(data, epochs=1 if dropout == 0.1 else 2)
        return trainer

    fit(0.1)
    with pytest.raises(ValueError, match=r"other settings: dropout 0.1 -> 0.2\. .*--allow_change "
                                         r"dropout;") as info:
        fit(0.2)
    assert "model." not in str(info.value)
    resumed = fit(0.2, allow_change=("dropout",))
    assert resumed.resume_changes == {"dropout": {"old": 0.1, "new": 0.2}}


def test_the_memory_budget_offers_only_the_fixes_that_apply():
    """Issue 70: a pipeline stage's budget error suggested ``--fsdp`` and the sharded optimizer
    state, both refused with stages; with FSDP on, it suggested FSDP."""
    big = functools.partial(models.transformer_lm, vocab=256, seq_len=128, dim=1024, heads=8,
                            layers=4)
    mesh = dtk.build_mesh("batch=8")
    plain = layouts.plan_layouts("transformer_lm", mesh, big)
    fsdp = layouts.plan_layouts("transformer_lm", mesh, big, fsdp=True)
    budget = 2 ** 20
    with pytest.raises(ValueError) as info:
        layouts.check_memory_budget(plain, budget, stage=1)
    message = str(info.value)
    assert "on pipeline stage 1's sub-mesh batch=8" in message
    assert "More stages (a larger stage axis); a model axis beside the stages" in message
    assert "fsdp" not in message and "shard_optimizer_state" not in message
    with pytest.raises(ValueError) as info:
        layouts.check_memory_budget(fsdp, budget, shard_optimizer_state=True)
    message = str(info.value)
    assert "--fsdp" not in message and "--shard_optimizer_state" not in message
    assert message.endswith("Shard it on a larger model axis (e.g. model=8), or raise the "
                            "budget (--device_memory_gb)")
    with pytest.raises(ValueError, match=r"fsdp=True, --fsdp\); turn on the sharded optimizer "
                                         r"update \(--shard_optimizer_state\), or raise"):
        layouts.check_memory_budget(plain, budget)
