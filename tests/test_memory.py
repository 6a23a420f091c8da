"""Memory that scales with the mesh: FSDP, remat and gradient accumulation keep one-device
numbers (and resume exactly); a build holds no full copy of the model; bad inputs are one line."""

import functools
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import dtk
from dtk.data import input as input_lib
from dtk.parallel import layouts
from dtk.train import input_checks
from dtk import models
from tests import procs

N_TRAIN, BATCH = 128, 32  # 4 steps per epoch

# (factory, layout table, remat patterns, example shape, labels) per model kind.
MODELS = {
    "mlp": (functools.partial(models.mnist_mlp, hidden=16, dropout=0.2), "mlp_model_parallel",
            (r"d\d",), (28, 28, 1), 10),
    "cnn": (functools.partial(models.mnist_cnn, filters=(8, 16), hidden=16), "cnn_data_parallel",
            (r"c\d", r"d\d"), (28, 28, 1), 10),
    "lm": (functools.partial(models.transformer_lm, vocab=32, seq_len=8, dim=16, heads=4, layers=1,
                             dropout=0.1), "transformer_lm", models.MODEL_SPECS["lm"].remat,
           (8,), 32),
    # Wide layers and few tokens (64 a batch): FSDP multiplies by the kernels' shards and
    # gathers activations instead (dtk.parallel.fsdp._activation_gathered), on a batch-only mesh.
    "wide_lm": (functools.partial(models.transformer_lm, vocab=32, seq_len=2, dim=256, heads=4,
                                  layers=1, dropout=0.1), "transformer_lm",
                models.MODEL_SPECS["lm"].remat, (2,), 32),
}
# The optimizer per model kind (Adam, lr 0.01, unless named here). The wide LM, whose FSDP
# partial products are summed in another order than one device's matmul, trains with SGD: Adam
# turned that rounding, in gradients near zero, into lr-sized steps of chance sign (1.2e-4 to
# 2.0e-4 in 2 of 65,536 elements, 3 to 7 times a one-device spread that itself varied from
# 3.0e-5 to 6.7e-5 between runs); SGD moves each weight by the gradient itself, so what is
# compared is the arithmetic, not Adam's amplification of its last bits.
OPTIMIZERS = {"wide_lm": ("sgd", 0.1)}
# What each variant changes; "all" combines them (accumulation over 4 microbatches).
VARIANTS = {"fsdp": {"fsdp": True}, "remat": {"remat": "model"},
            "accum": {"gradient_accumulation_steps": 4},
            "all": {"fsdp": True, "remat": "model", "gradient_accumulation_steps": 2}}


def _data(mesh, kind, n=N_TRAIN):
    _, _, _, shape, classes = MODELS[kind]
    rng = np.random.default_rng(1)
    if kind.endswith("lm"):
        x = rng.integers(0, classes, (n, *shape)).astype(np.int32)
        y = np.roll(x, -1, axis=1).astype(np.int64)
    else:
        x = rng.random((n, *shape), dtype=np.float32)
        y = rng.integers(0, classes, n).astype(np.int64)
    return input_lib.DistributedDataset(
        tf.data.Dataset.from_tensor_slices((x, y)), mesh,
        input_lib.InputConfig(global_batch_size=BATCH, shuffle=True, seed=2, num_classes=classes))


def _trainer(kind, spec, *, table=None, **config):
    factory, default_table, remat, _, _ = MODELS[kind]
    optimizer, learning_rate = OPTIMIZERS.get(kind, ("adam", 0.01))
    if config.get("remat") == "model":
        config["remat"] = remat
    mesh = dtk.build_mesh(spec)
    if spec.startswith("batch=1,") or spec == "batch=1" or "model" not in spec:
        table = table or ("data_parallel" if kind != "cnn" else default_table)
    config.setdefault("verbose", 0)
    config.setdefault("steps_per_execution", 1)
    return dtk.Trainer(mesh=mesh, model=factory, layout=table or default_table,
                       optimizer=dtk.make_optimizer(optimizer, mesh, learning_rate=learning_rate),
                       loss="sparse_categorical_crossentropy",
                       config=dtk.TrainerConfig(seed=3, **config))


_REFERENCE = {}


def _reference(kind):
    """Two epochs on one device, plain (no FSDP, remat or accumulation); once per model kind.

    Also the spread that summation order alone gives on one device: the same run with each batch
    split in four quarters whose gradients are added (accumulation, on batch=1). Adam (lr 0.01)
    turns rounding noise in near-zero gradients (attention's key bias has none in theory) into
    steps of 1e-5 to 1e-4, so the weights of two correct runs differ by that much; ``_check``
    holds dtk to a small multiple of this measured spread rather than to a fixed tolerance.
    """
    if kind not in _REFERENCE:
        one = _trainer(kind, "batch=1")
        history = one.fit(_data(one.mesh, kind), epochs=2).history["loss"]
        halves = _trainer(kind, "batch=1", gradient_accumulation_steps=4)
        halves.fit(_data(halves.mesh, kind), epochs=2)
        weights = dtk.gather_weights(one.model)
        spread = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(dtk.gather_weights(halves.model), weights))
        _REFERENCE[kind] = (history, weights, spread)
    return _REFERENCE[kind]


# How far dtk's weights may be from one device's, as a multiple of the spread of two one-device
# runs that differ only in summation order (measured: BUILD.md, "Tolerances"); a floor for
# models whose spread is exactly 0.
SPREAD_FACTOR, SPREAD_FLOOR = 4.0, 1e-6


def _check(trainer, history, kind):
    want_loss, want_weights, spread = _reference(kind)
    np.testing.assert_allclose(history, want_loss, rtol=1e-5)
    error = max(float(np.max(np.abs(a - b)))
                for a, b in zip(dtk.gather_weights(trainer.model), want_weights))
    assert error <= max(SPREAD_FACTOR * spread, SPREAD_FLOOR), (
        f"weights differ from one device's by {error:.2e}, more than {SPREAD_FACTOR:g} x the "
        f"one-device summation-order spread {spread:.2e}")


# The fast lane: cases under its 20 s budget (the LM's, with its one-device reference, take
# 15-44 s: slow).
_FAST = {("fsdp", "mlp", "batch=8"), ("accum", "cnn", "batch=8")}
# FSDP on every model and mesh; remat and accumulation on every model and every mesh, not every
# pair (the suite's time budget); all three together on two meshes.
CASES = [("fsdp", k, s) for k in ("mlp", "cnn", "lm")
         for s in ("batch=8", "batch=4,model=2", "batch=2,model=4")
         if not (k == "cnn" and "model" in s)]  # the CNN's table has no model axis
CASES += [("remat", "lm", "batch=2,model=4"), ("remat", "mlp", "batch=4,model=2"),
          ("remat", "cnn", "batch=8"), ("accum", "cnn", "batch=8"),
          ("accum", "mlp", "batch=4,model=2"), ("accum", "lm", "batch=2,model=4"),
          ("all", "lm", "batch=4,model=2"), ("all", "mlp", "batch=2,model=4")]


# Every run: the fast cases and one more per model kind ("all" is FSDP and remat on the LM); the rest
# of the matrix in the release lane (pytest -m zoo), for the suite's time budget.
_EVERY_RUN = {("fsdp", "cnn", "batch=8"),
              ("all", "mlp", "batch=2,model=4"), ("all", "lm", "batch=4,model=2")}


@pytest.mark.parametrize("variant, kind, spec", [
    pytest.param(*case, marks=() if case in _FAST else (pytest.mark.slow,) if case in _EVERY_RUN
                 else (pytest.mark.slow, pytest.mark.zoo)) for case in CASES])
def test_variant_matches_one_device(variant, kind, spec):
    trainer = _trainer(kind, spec, **VARIANTS[variant])
    history = trainer.fit(_data(trainer.mesh, kind), epochs=2).history["loss"]
    _check(trainer, history, kind)
    if VARIANTS[variant].get("fsdp"):
        assert trainer.layout_plan.fsdp and not trainer.shard_optimizer_state


@pytest.mark.parametrize("variant", [
    pytest.param("all", marks=pytest.mark.slow),
    pytest.param("fsdp", marks=(pytest.mark.slow, pytest.mark.zoo)),
    pytest.param("accum", marks=(pytest.mark.slow, pytest.mark.zoo))])
def test_variant_resumes_exactly(tmp_path, variant):
    """Stopped mid-epoch and resumed: the same numbers as one device, uninterrupted."""
    first = _trainer("lm", "batch=4,model=2", checkpoint_dir=str(tmp_path), max_steps=3,
                     **VARIANTS[variant])
    first.fit(_data(first.mesh, "lm"), epochs=2)
    assert first.global_step == 3
    second = _trainer("lm", "batch=4,model=2", checkpoint_dir=str(tmp_path), **VARIANTS[variant])
    history = second.fit(_data(second.mesh, "lm"), epochs=2).history["loss"]
    assert second.global_step == 2 * N_TRAIN // BATCH  # updates, not microbatches
    _check(second, history, "lm")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fsdp", "all"])
def test_fsdp_gathering_activations_matches_one_device(monkeypatch, variant):
    """Where a kernel moves more than its layer's activations, FSDP multiplies by its shards and
    gathers the activations: the MLP, and attention's projections (the output projection is
    sharded on head_dim, a dim that the kernel does not lead with). One device's numbers."""
    from dtk.parallel import fsdp  # pylint: disable=import-outside-toplevel
    plan, chosen = fsdp._activation_plan, set()  # pylint: disable=protected-access

    def recorded(layer, inputs):
        result = plan(layer, inputs)
        if result is not None:
            chosen.add(layer.name)
        return result

    monkeypatch.setattr(fsdp, "_activation_plan", recorded)
    trainer = _trainer("wide_lm", "batch=8", **VARIANTS[variant])
    history = trainer.fit(_data(trainer.mesh, "wide_lm"), epochs=2).history["loss"]
    assert chosen == {"block0_ff1", "block0_ff2", "query", "key", "value", "attention_output"}
    # The partial products are summed in another order than one device's matmul: with SGD
    # (OPTIMIZERS) the weights differ by rounding only, within the one-device spread (_check).
    _check(trainer, history, "wide_lm")


def test_fsdp_checkpoint_resumes_without_fsdp(tmp_path):
    """FSDP changes where weights live, not what a checkpoint holds."""
    first = _trainer("mlp", "batch=8", checkpoint_dir=str(tmp_path), max_steps=5, fsdp=True)
    first.fit(_data(first.mesh, "mlp"), epochs=2)
    second = _trainer("mlp", "batch=4,model=2", checkpoint_dir=str(tmp_path))
    history = second.fit(_data(second.mesh, "mlp"), epochs=2).history["loss"]
    assert second.run_id == first.run_id  # it resumed the FSDP run, not started again
    assert second.global_step > 5 and len(history) == 2
    _check(second, history, "mlp")  # and ends with one device's losses and weights


def test_fsdp_plan_and_explainer():
    mesh = dtk.build_mesh("batch=4,model=2")
    factory = functools.partial(models.transformer_lm, vocab=32, seq_len=8, dim=16, heads=4, layers=1)
    plan = layouts.plan_layouts("transformer_lm", mesh, factory, fsdp=True)
    plain = layouts.plan_layouts("transformer_lm", mesh, factory)
    by_path = {w.path: w for w in plan.weights}
    ff1 = by_path["block0_ff1.kernel"]  # [16, 64]: the table shards dim 1 on model
    assert ff1.compute_dims == (None, "model") and ff1.dims == ("batch", "model")
    assert ff1.bytes_per_device == 16 * 64 * 4 // 8
    mem, base = layouts.memory_per_device(plan), layouts.memory_per_device(plain)
    assert mem["weights"] < base["weights"] / 2 and mem["gathered_in_step"] > 0
    text = layouts.explain(plan)
    assert "(fsdp; computes [unsharded, model])" in text and "fsdp" in text.splitlines()[-1]
    # Weights the batch axis cannot split stay replicated, said once with their bytes.
    kept = [w for w in plan.weights if w.compute_dims is None]
    assert kept and all(all(d != "batch" for d in w.dims) for w in kept)
    warnings = [w for w in plan.warnings if w.startswith("fsdp:")]
    assert len(warnings) == 1 and f"{len(kept)} weight(s)" in warnings[0]


def test_accumulation_and_remat_bad_values():
    mesh = dtk.build_mesh("batch=8")
    with pytest.raises(ValueError, match=r"does not divide the per-device batch: global batch 32 "
                                         r"over mesh axis 'batch' \(size 8\) is 4 examples"):
        input_checks.check_accumulation(32, mesh, 3)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive integer"):
        dtk.TrainerConfig(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="tuple of layer-name patterns"):
        dtk.TrainerConfig(remat="d1")
    with pytest.raises(ValueError, match=r"remat pattern 'nope\\d' matches no layer"):
        _trainer("mlp", "batch=8", remat=(r"nope\d",))


# -- no full copy while building --------------------------------------------------------------
BUILD_CLIENT = """
import resource, sys
import dtk
mesh = dtk.build_mesh("batch=1,model=4", device_type="cpu")
def factory(units=2048, n=8):
    import tf_keras
    return tf_keras.Sequential([tf_keras.layers.Dense(units, input_shape=(units,), name="big0")] + [
        tf_keras.layers.Dense(units, name=f"big{i}") for i in range(1, n)])
dtk.build_model(lambda: factory(64), mesh, sys.argv[1], seed=0)  # DTensor's own first costs
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
dtk.build_model(factory, mesh, sys.argv[1], seed=0)
print("GROWTH", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, flush=True)
"""


@pytest.mark.slow
def test_two_client_build_holds_no_full_copy(tmp_path):
    """8 kernels of 16 MiB (128 MiB in all) sharded over 4 devices, 2 per client: a client's peak
    grows by its 64 MiB of shards plus transients of one weight at a time (measured 261-273 MiB).
    The plain build held the model, a numpy copy of it and replicated copies per device
    (measured 444-540 MiB), over the bound."""
    script, table = tmp_path / "build.py", tmp_path / "big.toml"
    table.write_text('name = "big"\naxes = ["model"]\n[[rules]]\npattern = \'big\\d\\.kernel\'\n'
                     'dims = ["unsharded", "model"]\n[[rules]]\npattern = \'big\\d\\.bias\'\n'
                     'dims = ["model"]\n')
    script.write_text(BUILD_CLIENT)
    res = subprocess.run([sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2",
                          "--devices_per_client", "2", "--", sys.executable, str(script), str(table)],
                         capture_output=True, text=True, timeout=240, env=procs.base_env(),
                         cwd=procs.REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    growths = [int(g) for g in re.findall(r"GROWTH (\d+)", res.stdout)]
    assert len(growths) == 2, res.stdout[-2000:]
    model, share = 8 * 2048 * 2048 * 4, 8 * 2048 * 2048 * 4 // 2
    for growth in growths:
        assert growth < share + 2 * model, f"a client's build grew by {growth / 2**20:.0f} MiB"


@pytest.mark.slow
def test_cli_grad_accum_that_does_not_divide_is_one_line():
    res = subprocess.run([sys.executable, str(procs.REPO / "scripts" / "train_mnist.py"), "--mesh",
                          "batch=8", "--dataset", "sample", "--global_batch_size", "32",
                          "--grad_accum", "3"], capture_output=True, text=True, timeout=120,
                         env=procs.base_env(), cwd=procs.REPO)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "does not divide the per-device batch" in lines[0] and "(size 8)" in lines[0]


FSDP_STEP_CLIENT = r"""
import os, sys
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor
from dtk.parallel import fsdp
schedule = sys.argv[1] == "scheduled"
mesh = dtensor.create_mesh([("batch", 8)], device_type="CPU")
D, L = 1024, 16  # 16 weights of 4 MiB: 64 MiB gathered per device, 512 MiB on the 8 devices
shard, full = dtensor.Layout(["batch", "unsharded"], mesh), dtensor.Layout.replicated(mesh, 2)
weights = []
for _ in range(L):
    w = dtensor.DVariable(dtensor.call_with_layout(tf.fill, shard, dims=[D, D], value=1e-3))
    w.__class__, w._dtk_compute_layout = fsdp.GatheredVariable, full
    weights.append(w)
x = dtensor.call_with_layout(tf.fill, shard, dims=[64, D], value=1.0)

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        with fsdp.gather_scope(), fsdp.recording() as gathered:
            h = x
            for w in weights:
                with fsdp.gather_after(h) if schedule else fsdp.gather_after(()):
                    h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h)
    mark = fsdp.graph_mark()
    grads = tape.gradient(loss, weights)
    if schedule:
        grads = fsdp.own_buffers(grads, weights, gathered)
        fsdp.regather_for_backward(gathered, mark, {id(w): g for w, g in zip(weights, grads)})
    for w, g in zip(weights, grads):
        w.assign_sub(1e-6 * g)
    return loss

for _ in range(2):
    tf.config.experimental.reset_memory_stats("CPU:0")
    loss = float(step(x))
print("PEAK", tf.config.experimental.get_memory_info("CPU:0")["peak"], "LOSS", loss, flush=True)
"""


@pytest.mark.slow
def test_fsdp_step_holds_one_layer_gathered_at_a_time(tmp_path):
    """The allocator's peak in an FSDP step of 16 layers (4 MiB weights, 8 devices): scheduled,
    a few layers' gathered weights and gradients at a time (measured ~100 MiB); unscheduled, every
    gathered weight at once and full-size gradients kept by the update (measured ~1 GB), with
    the same loss."""
    script = tmp_path / "step.py"
    script.write_text(FSDP_STEP_CLIENT)
    out = {}
    for mode in ("scheduled", "unscheduled"):
        res = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                             timeout=120, env={**procs.base_env(), "TF_CPU_ALLOCATOR_USE_BFC": "true"},
                             cwd=procs.REPO)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        peak, loss = re.search(r"PEAK (\d+) LOSS (\S+)", res.stdout).groups()
        out[mode] = (int(peak), float(loss))
    gathered_on_all_devices = 8 * 16 * 1024 * 1024 * 4
    assert out["scheduled"][0] < gathered_on_all_devices / 2, out
    assert out["unscheduled"][0] > gathered_on_all_devices, out
    assert out["scheduled"][1] == pytest.approx(out["unscheduled"][1], rel=1e-6), out


def test_accumulation_with_a_padded_last_batch_equals_one_device():
    """Issue 41: remainder='pad' with gradient accumulation pads the last batch to rows that the
    microbatches divide (it failed at the padded batch, naming a batch the user never set), and
    the padding, weighted 0, leaves the numbers of one device."""
    def run(spec, **config):
        trainer = _trainer("mlp", spec, **config)
        rng = np.random.default_rng(1)
        data = input_lib.DistributedDataset(
            tf.data.Dataset.from_tensor_slices((rng.random((50, 28, 28, 1), dtype=np.float32),
                                                rng.integers(0, 10, 50).astype(np.int64))),
            trainer.mesh, input_lib.InputConfig(global_batch_size=16, remainder="pad"))
        return trainer.fit(data, epochs=1).history["loss"]
    np.testing.assert_allclose(run("batch=8", gradient_accumulation_steps=2), run("batch=1"),
                               rtol=1e-5)
