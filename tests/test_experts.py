"""Issue 60: a mixture-of-experts LM whose experts are sharded over an ``expert`` axis (or over
``batch``), with routing that does not depend on the mesh: the losses of one device on every
mesh, with dropout, for top-1 and top-2 routing."""

import dataclasses
import functools
import glob
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk import models
from dtk.data import input as input_lib
from dtk.parallel import experts, layouts
from tests import procs

SEQ, B, N = 16, 8, 10


def _factory(top_k, group=4, **kwargs):
    return functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8,
                             layers=1, dropout=0.1, moe_experts=8, moe_top_k=top_k,
                             moe_group_size=group, moe_capacity_factor=1.0, **kwargs)


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 64, (N, B, SEQ)).astype(np.int32),
            rng.integers(0, 64, (N, B, SEQ)).astype(np.int64))


def _table(spec, attention=None):
    table = layouts.load_table("transformer_lm_moe" if "expert" in spec or spec == "batch=1"
                               else "transformer_lm_moe_batch")
    return dataclasses.replace(table, sequence_attention=attention) if attention else table


def _run(spec, top_k, n=N, attention=None, factory=None, group=4):
    mesh = dtk.build_mesh(spec)
    table = _table(spec, attention)
    model, _ = layouts.build_model(factory or _factory(top_k, group), mesh, table, seed=7)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                      optimizer=tf_keras.optimizers.Adam(3e-3, mesh=mesh),
                      config=dtk.StepConfig(shard_optimizer_state=False))
    seq = table.sequence_axis if table.sequence_axis in mesh.dim_names else None
    x, y = _data()
    losses = np.array([float(steps.train(input_lib.pack(
        mesh, (x[i], y[i], np.ones(B, np.float32)), sequence_axis=seq))) for i in range(n)])
    return model, steps, losses


@functools.lru_cache(maxsize=None)
def _one_device(top_k, group=4):
    model, _, losses = _run("batch=1", top_k, group=group)
    return losses, experts.routing_stats(model)


@pytest.mark.parametrize("spec, top_k, group", [
    ("batch=2,expert=4", 1, 4),
    pytest.param("batch=2,expert=4", 2, 4, marks=pytest.mark.slow),
    pytest.param("batch=8", 1, 4, marks=pytest.mark.slow),           # experts over batch
    pytest.param("batch=8", 2, 4, marks=pytest.mark.slow),
    pytest.param("batch=2,expert=2,model=2", 2, 4, marks=pytest.mark.slow),
    # 2 groups of 8 a sequence, cut by the 4 devices of expert: gathered before routing
    pytest.param("batch=2,expert=4", 1, 8, marks=pytest.mark.slow),
])
def test_the_moe_lm_trains_like_one_device(spec, top_k, group):
    """10 steps of the MoE LM (8 experts, groups of 4 positions, capacity factor 1.0, so tokens
    are dropped) with dropout 0.1: batch=1's losses at 1e-5, and the same routing: the same
    fraction of choices dropped and the same expert loads."""
    model, _, losses = _run(spec, top_k, group=group)
    want, stats = _one_device(top_k, group)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got = experts.routing_stats(model)
    assert got == pytest.approx(stats, rel=1e-6)
    assert 0 < got["moe_dropped"] < 1  # capacity 1.0 on groups of 4 drops some, not all
    w1 = model.get_layer("block0_moe").w1
    axis = "expert" if "expert" in spec else "batch"
    assert tf.experimental.dtensor.fetch_layout(w1).sharding_specs[0] == axis


@pytest.mark.slow
def test_two_clients_train_the_moe_lm_like_one_device(tmp_path):
    """2 clients x 4 devices (python -m dtk.cluster.launch) on batch=2,expert=4, top-1 and
    top-2 (one launch) with dropout: batch=1's losses over 10 steps at 1e-5 and the same
    routing. Each client packs its own devices' shards; the experts of client 0's devices and
    client 1's trade tokens by the all-to-all across the processes."""
    out = tmp_path / "two.json"
    res = subprocess.run(
        [sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2",
         "--devices_per_client", "4", "--", sys.executable,
         str(procs.REPO / "tests" / "mc_moe_client.py")],
        capture_output=True, text=True, timeout=240, cwd=procs.REPO,
        env=procs.base_env(MC_OUT=str(out), MC_MESH="batch=2,expert=4", MC_TOP_K="1,2"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    for k in (1, 2):
        want, stats = _one_device(k)
        np.testing.assert_allclose(got[str(k)]["loss"], want, rtol=1e-5, err_msg=f"top-{k}")
        assert got[str(k)]["routing"] == pytest.approx(stats, rel=1e-6)


def _collectives(function, *args):
    """The names of the collective ops one call of ``function`` runs (from a profile)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    try:
        function(*args)
    finally:
        tf.profiler.experimental.stop()
    names = set()
    for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names.update(md.name.split(":")[-1] for md in plane.event_metadata.values()
                         if md.name.split(":")[-1].startswith("Collective"))
    return names


def test_the_tokens_reach_their_experts_by_an_all_to_all():
    """On batch=2,expert=4 the MoE LM's step runs CollectiveAllToAllV2 (the expert relayouts),
    and the same LM without experts does not (attention gathers its keys and values over the
    sequence here, all_gather, so that no other all-to-all is in the step)."""
    x, y = _data()
    found = {}
    dense = functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8,
                              layers=1)
    for name, spec, factory, table in (
            ("moe", "batch=2,expert=4", _factory(1), "transformer_lm_moe"),
            ("dense", "batch=2,seq=4", dense, "transformer_lm")):  # the same tokens' split
        mesh = dtk.build_mesh(spec)
        model, _ = layouts.build_model(factory, mesh, dataclasses.replace(
            layouts.load_table(table), sequence_attention="all_gather"), seed=7)
        steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                          optimizer=tf_keras.optimizers.Adam(3e-3, mesh=mesh),
                          config=dtk.StepConfig(shard_optimizer_state=False))
        seq = spec.split(",")[1].split("=")[0]
        batch = input_lib.pack(mesh, (x[1], y[1], np.ones(B, np.float32)), sequence_axis=seq)
        float(steps.train(batch))  # traced before the profile
        found[name] = _collectives(lambda b: float(steps.train(b)), batch)
    assert "CollectiveAllToAllV2" in found["moe"], found
    assert "CollectiveAllToAllV2" not in found["dense"], found


def test_the_layer_works_in_plain_tf_keras_and_counts_what_it_drops(tmp_path):
    """The layer on one device, no dtk: its losses (balance and z) in model.losses, a capacity
    too small for its tokens drops choices and counts them (those tokens' outputs are 0: the
    residual carries them), and a model with it saves and loads in plain tf_keras with the
    same outputs."""
    inputs = tf_keras.Input((8, 4))
    outputs = experts.MixtureOfExperts(4, 8, top_k=2, capacity_factor=0.25, group_size=4,
                                       name="moe")(inputs)
    model = tf_keras.Model(inputs, outputs)
    x = tf.random.stateless_normal([2, 8, 4], seed=[1, 2])
    y = model(x, training=True)
    assert y.shape == (2, 8, 4)
    assert len(model.losses) == 2 and all(float(v) > 0 for v in model.losses)
    layer = model.get_layer("moe")
    assert layer.capacity(4) == 1  # ceil(0.25 * 2 * 4 / 4)
    stats = experts.routing_stats(model)
    # 16 tokens x 2 choices, 4 groups x 4 experts x 1 slot: at least half dropped
    assert stats["moe_dropped"] >= 0.5
    assert float(layer.tokens) == 16
    assert float(layer.dropped) + float(tf.reduce_sum(layer.load)) == 32
    path = str(tmp_path / "moe.keras")
    model.save(path)
    loaded = tf_keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)
    assert loaded.get_layer("moe").get_config() == layer.get_config()


@pytest.mark.parametrize("kwargs, message", [
    ({"num_experts": 0, "hidden": 8}, "num_experts must be a positive integer; got 0"),
    ({"num_experts": 2, "hidden": 8, "top_k": 3}, "top_k must be 1 (Switch) or 2 (GShard)"),
    ({"num_experts": 1, "hidden": 8, "top_k": 2}, "top_k=2 is more than the 1 expert"),
    ({"num_experts": 4, "hidden": 8, "capacity_factor": 0}, "capacity_factor must be a finite number > 0"),
    ({"num_experts": 4, "hidden": 8, "capacity_factor": -1.0}, "capacity_factor must be a finite number > 0"),
    ({"num_experts": 4, "hidden": 8, "capacity_factor": float("inf")},
     "capacity_factor must be a finite number > 0"),
    ({"num_experts": 4, "hidden": 8, "capacity_factor": float("nan")},
     "capacity_factor must be a finite number > 0"),
    ({"num_experts": 4, "hidden": 0}, "hidden must be a positive integer"),
    ({"num_experts": 4, "hidden": 8, "group_size": 0}, "group_size must be a positive integer"),
])
def test_bad_layer_settings_are_one_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        experts.MixtureOfExperts(**kwargs)


def test_experts_the_axis_cannot_divide_are_named():
    """6 experts on an expert axis of 4: refused when the model is laid out, naming the count,
    the axis, its size and the fix."""
    factory = functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8,
                                layers=1, moe_experts=6)
    with pytest.raises(ValueError, match=r"dim 0 \(6\) is not divisible by mesh axis 'expert' "
                                         r"\(size 4\).*multiple of 4"):
        layouts.build_model(factory, dtk.build_mesh("batch=2,expert=4"),
                            "transformer_lm_moe", seed=0)


def test_a_group_size_that_does_not_divide_the_sequence_is_named():
    layer = experts.MixtureOfExperts(4, 8, group_size=5, name="moe")
    with pytest.raises(ValueError, match="group_size 5 does not divide the sequence length 16"):
        layer(tf.zeros([1, 16, 4]))


def _trainer(spec, ckpt, factory=None, **config):
    mesh = dtk.build_mesh(spec)
    return dtk.Trainer(mesh=mesh, model=factory or _factory(2), layout=_table(spec),
                       optimizer=tf_keras.optimizers.Adam(3e-3, mesh=mesh),
                       loss="sparse_categorical_crossentropy",
                       config=dtk.TrainerConfig(seed=7, verbose=0, steps_per_execution=1,
                                                checkpoint_dir=ckpt, **config))


def _fit(trainer, epochs):
    x, y = _data()
    seq = "expert" if "expert" in trainer.mesh.dim_names else None
    data = dtk.DistributedDataset(
        tf.data.Dataset.from_tensor_slices((x[:4].reshape(-1, SEQ), y[:4].reshape(-1, SEQ))),
        trainer.mesh, dtk.InputConfig(global_batch_size=B, sequence_axis=seq))
    return trainer.fit(data, epochs=epochs).history["loss"]


@pytest.mark.slow
def test_a_resume_onto_another_expert_mesh_continues_like_one_device(tmp_path):
    """Epoch 1 on batch=2,expert=4 (experts over expert), resumed for epoch 2 on batch=8
    (experts over batch, another table): batch=1's losses (1e-5), top-2 with dropout. A resume
    with another number of experts is refused, naming the setting."""
    want = _fit(_trainer("batch=1", None), 2)
    ckpt = str(tmp_path / "ckpt")
    first = _fit(_trainer("batch=2,expert=4", ckpt), 1)
    resumed = _fit(_trainer("batch=8", ckpt, allow_change=("mesh",)), 2)  # epoch 1 restored
    np.testing.assert_allclose(first, want[:1], rtol=1e-5)
    np.testing.assert_allclose(resumed, want, rtol=1e-5)
    more = functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8,
                             layers=1, dropout=0.1, moe_experts=16, moe_top_k=2,
                             moe_group_size=4, moe_capacity_factor=1.0)
    with pytest.raises(ValueError, match="num_experts 8 -> 16"):
        _fit(_trainer("batch=8", ckpt, factory=more, allow_change=("mesh",)), 3)


def test_experts_over_batch_with_the_sequence_sharded_are_refused_with_the_way_out():
    """Experts over batch (transformer_lm_moe_batch) on batch=4,model=2, where Megatron's
    sequence parallelism shards the sequence over model: DTensor fails to lower the relayouts
    (measured), so the build refuses it, naming the axes and the table that works."""
    with pytest.raises(ValueError, match=r"experts sharded over the batch axis 'batch' with the "
                                         r"sequence sharded over 'model'.*transformer_lm_moe"):
        layouts.build_model(_factory(1), dtk.build_mesh("batch=4,model=2"),
                            "transformer_lm_moe_batch", seed=0)


def test_routing_statistics_after_a_resume_are_the_uninterrupted_runs(tmp_path):
    """Issue 70: the routing counters are saved with the weights; a resumed run added its first
    interval's counts to the checkpointed interval's (36.4% dropped reported for steps 3-4 where
    the uninterrupted run dropped 38.8%). Each epoch's statistics (reset after each, as
    train_lm.py reports them) now equal the uninterrupted run's after a resume at epoch 2."""
    x, y = _data()
    mesh = dtk.build_mesh("batch=8")

    def fit(directory, epochs):
        data = input_lib.DistributedDataset(
            tf.data.Dataset.from_tensor_slices((x[:4].reshape(-1, SEQ), y[:4].reshape(-1, SEQ))),
            mesh, input_lib.InputConfig(global_batch_size=B))
        trainer = dtk.Trainer(mesh=mesh, model=_factory(2), layout=_table("batch=8"),
                              optimizer=dtk.make_optimizer("adam", mesh, learning_rate=3e-3),
                              loss="sparse_categorical_crossentropy", metrics=[],
                              config=dtk.TrainerConfig(seed=7, verbose=0, steps_per_execution=1,
                                                       checkpoint_dir=str(directory)))
        stats = []

        def report(epoch, logs):
            stats.append(experts.routing_stats(trainer.model)["moe_dropped"])
            experts.reset_routing_stats(trainer.model)

        trainer.fit(data, epochs=epochs, on_epoch_end=[report])
        return stats

    whole = fit(tmp_path / "whole", 3)
    fit(tmp_path / "resumed", 2)
    resumed = fit(tmp_path / "resumed", 3)
    assert len(whole) == 3 and len(resumed) == 1
    assert resumed[0] == pytest.approx(whole[2], rel=1e-6), (whole, resumed)


def test_the_layer_routes_in_float32_under_mixed_precision():
    """Issue 70: ``--mixed_precision`` with experts was "Incompatible type conversion requested
    to type 'float32' for AutoCastVariable". The router now reads its float32 weight as float32
    (routing in float32), the experts compute in bfloat16: outputs in bfloat16 within its
    precision of the float32 layer's, with the same weights."""
    x = tf.random.stateless_normal([2, 8, 4], seed=[1, 2])

    def call(policy):
        tf_keras.mixed_precision.set_global_policy(policy)
        try:
            tf_keras.utils.set_random_seed(0)
            layer = experts.MixtureOfExperts(4, 8, top_k=2, group_size=4, name="moe")
            return layer, layer(x, training=True)
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")

    full, want = call("float32")
    mixed, got = call("mixed_bfloat16")
    assert got.dtype == tf.bfloat16 and mixed.router.dtype == tf.float32
    np.testing.assert_array_equal(mixed.router.numpy(), full.router.numpy())
    np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), want.numpy(),
                               atol=0.02 * float(tf.reduce_max(tf.abs(want))))
    assert all(np.isfinite(float(v)) for v in mixed.losses)


@pytest.mark.parametrize("pattern", ["block0_moe", "block.*"])
def test_remat_of_an_expert_layer_is_one_line_naming_it(pattern):
    """Issue 70: ``--remat`` naming an expert layer got Keras's add_loss text ("wrap your loss
    computation in a zero argument lambda"), naming neither the flag nor the layer."""
    from dtk.parallel import remat  # pylint: disable=import-outside-toplevel
    model = _factory(1)()
    with pytest.raises(ValueError, match=r"^remat \(--remat\) of layer 'block0_moe': it is a "
                                         r"MixtureOfExperts, which adds its routing losses with "
                                         r"add_loss.*leave it out of the remat patterns"):
        remat.apply(model, [pattern])


def test_the_routing_line_says_which_flags_drop_fewer():
    """Issue 70: MoE runs logged 37-68% of choices dropped with no hint of what changes it."""
    stats = {"moe_dropped": 0.42, "moe_load_min": 0.1, "moe_load_max": 2.5, "moe_load_mean": 1.0}
    line = experts.describe_routing(stats, 1.25)
    assert line.startswith("experts: 42.0% of the tokens' choices dropped (capacity factor 1.25)")
    assert "to drop fewer, raise capacity_factor (--moe_capacity_factor" in line
    assert "group_size (--moe_group_size" in line
    assert "drop fewer" not in experts.describe_routing({**stats, "moe_dropped": 0.05}, 1.25)
