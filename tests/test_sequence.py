"""Issue 44: activations sharded along the sequence (dtk.parallel.sequence): context parallelism
over a ``seq`` axis and Megatron's sequence parallelism over ``model``, against one device, with
dropout, and across a resume onto another mesh."""

import dataclasses
import functools
import logging

import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk
from dtk import models
from dtk.data import input as input_lib
from dtk.parallel import layouts, sequence

SEQ = 16
FACTORY = functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8,
                            layers=1, dropout=0.1)
B, N = 8, 20


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 64, (N, B, SEQ)).astype(np.int32),
            rng.integers(0, 64, (N, B, SEQ)).astype(np.int64))


def _table_with(attention):
    table = layouts.load_table("transformer_lm")
    return dataclasses.replace(table, sequence_attention=attention) if attention else table


def _losses(spec, n=N, attention=None, factory=FACTORY, sequence_axis=None):
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(factory, mesh, _table_with(attention), seed=7)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                      metrics=["accuracy"],
                      optimizer=tf_keras.optimizers.Adam(3e-3, mesh=mesh),
                      config=dtk.StepConfig(shard_optimizer_state=False))
    x, y = _data()
    return model, mesh, np.array([float(steps.train(input_lib.pack(
        mesh, (x[i], y[i], np.ones(B, np.float32)), sequence_axis=sequence_axis)))
        for i in range(n)])


@functools.lru_cache(maxsize=None)
def _one_device():
    return _losses("batch=1")[2]


def _stream_layout(model, mesh, layer="block0_seq1"):
    """The layout of the residual stream after ``layer``, from an eager call on a packed batch."""
    probe = tf_keras.Model(model.inputs, model.get_layer(layer).output)
    x, _ = _data()
    return dtensor.fetch_layout(tf.function(probe)(input_lib.pack(mesh, x[0]))).sharding_specs


@pytest.mark.parametrize("spec, stream", [
    ("batch=2,seq=4", ["batch", "seq", "unsharded"]),                 # context parallelism
    pytest.param("batch=2,seq=2,model=2", ["batch", "seq", "unsharded"], marks=pytest.mark.slow),
    pytest.param("batch=2,model=4", ["batch", "model", "unsharded"],  # Megatron sequence parallel
                 marks=pytest.mark.slow),
    pytest.param("batch=8", ["batch", "unsharded", "unsharded"], marks=pytest.mark.slow),
])
def test_the_lm_with_dropout_trains_like_one_device_with_its_sequence_sharded(spec, stream):
    """20 steps of the LM with dropout 0.1: the losses of batch=1 (1e-5), with the residual
    stream sharded along the sequence as the mesh says."""
    model, mesh, losses = _losses(spec)
    np.testing.assert_allclose(losses, _one_device(), rtol=1e-5)
    assert _stream_layout(model, mesh) == stream


@pytest.mark.parametrize("spec, attention", [
    ("batch=2,seq=4", "all_to_all"),
    pytest.param("batch=2,seq=4", "all_gather", marks=pytest.mark.slow),
    pytest.param("batch=1,seq=8", "all_to_all", marks=pytest.mark.slow),
])
def test_both_ways_of_attention_over_the_sequence_train_like_one_device(spec, attention):
    """Attention with its keys and values gathered, and re-sharded to heads by an all-to-all
    (Ulysses; 8 heads over seq): the losses of batch=1 with dropout (1e-5), attention's too."""
    model, _, losses = _losses(spec, attention=attention)
    np.testing.assert_allclose(losses, _one_device(), rtol=1e-5)
    relayout = getattr(model.get_layer("block0_attn"), "_dtk_all_to_all", None)
    assert (relayout is not None) == (attention == "all_to_all")


def test_auto_times_both_ways_on_the_mesh_and_says_which(caplog):
    sequence._TIMED.clear()  # pylint: disable=protected-access
    with caplog.at_level(logging.INFO, logger="dtk"):
        model, _, losses = _losses("batch=2,seq=4", n=3, attention="auto")
    line = next(r.getMessage() for r in caplog.records if "sharded along the sequence" in
                r.getMessage())
    found = re.search(r"all-to-all ([\d.]+) ms, all-gather ([\d.]+) ms", line)
    assert found, line
    a2a, gather = map(float, found.groups())
    chosen = model.get_layer("block0_attn")._dtk_all_to_all is not None  # pylint: disable=protected-access
    assert chosen == (a2a < gather)
    assert ("all-to-all to heads (Ulysses)" in line) == chosen
    np.testing.assert_allclose(losses, _one_device()[:3], rtol=1e-5)


@pytest.mark.parametrize("spec", ["batch=2,seq=4", pytest.param("batch=2,seq=2,model=2",
                                                                 marks=pytest.mark.slow)])
def test_inputs_packed_along_the_sequence_train_like_one_device(spec):
    """InputConfig/pack(sequence_axis="seq"): each device gets its rows' T/seq positions of the
    token ids and labels (not whole rows), and the losses stay those of batch=1 (1e-5)."""
    mesh = dtk.build_mesh(spec)
    x, y = _data()
    packed = input_lib.pack(mesh, (x[0], y[0], np.ones(B, np.float32)), sequence_axis="seq")
    seq = mesh.dim_size("seq")
    assert dtensor.fetch_layout(packed[0]).sharding_specs == ["batch", "seq"]
    assert dtensor.fetch_layout(packed[2]).sharding_specs == ["batch"]  # rank 1: rows only
    shards = dtensor.unpack(packed[0])
    assert shards[0].shape == (B // 2, SEQ // seq)
    np.testing.assert_array_equal(shards[1].numpy(), x[0][:B // 2, SEQ // seq:2 * SEQ // seq]
                                  if "model" not in spec else x[0][:B // 2, :SEQ // seq])
    _, _, losses = _losses(spec, sequence_axis="seq")
    np.testing.assert_allclose(losses, _one_device(), rtol=1e-5)


def test_a_sequence_dim_the_axis_cannot_divide_is_named():
    mesh = dtk.build_mesh("batch=2,seq=4")
    with pytest.raises(ValueError, match=r"element 1: sequence dim 1 \(18\) is not divisible by mesh "
                                         r"axis 'seq' \(size 4\); use a sequence length that is "
                                         r"a multiple of 4"):
        input_lib.pack(mesh, (np.zeros((8, 16), np.int32), np.zeros((8, 18), np.int32)),
                       sequence_axis="seq")
    with pytest.raises(ValueError, match=r"InputConfig.sequence_axis 'sq' is not an axis of the "
                                         r"mesh batch=2,seq=4; name one of \['batch', 'seq'\]"):
        input_lib.DistributedDataset(
            tf.data.Dataset.from_tensor_slices((np.zeros((8, 16)), np.zeros(8))), mesh,
            input_lib.InputConfig(global_batch_size=8, sequence_axis="sq"))


@pytest.mark.slow
def test_a_resume_onto_another_sequence_mesh_continues_like_one_device(tmp_path):
    """10 steps on batch=2,seq=4, a checkpoint, 10 more on batch=2,seq=2,model=2: the losses of 20
    steps on one device."""
    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x.reshape(-1, SEQ), y.reshape(-1, SEQ))).repeat()
    losses = []
    for epochs, spec in ((1, "batch=2,seq=4"), (2, "batch=2,seq=2,model=2")):
        mesh = dtk.build_mesh(spec)
        trainer = dtk.Trainer(
            mesh=mesh, model=FACTORY, layout="transformer_lm",
            optimizer=tf_keras.optimizers.Adam(3e-3, mesh=mesh),
            loss="sparse_categorical_crossentropy",
            config=dtk.TrainerConfig(seed=7, verbose=0, checkpoint_dir=str(tmp_path / "ckpt"),
                                     steps_per_execution=1, shard_optimizer_state=False,
                                     allow_change=("mesh",)))
        losses = trainer.fit(input_lib.DistributedDataset(data, mesh, input_lib.InputConfig(
            global_batch_size=B, steps_per_epoch=N // 2, sequence_axis="seq")),
            epochs=epochs).history["loss"]
    one = _one_device()
    np.testing.assert_allclose(losses, [one[:N // 2].mean(), one[N // 2:].mean()], rtol=1e-5)


def test_the_sequence_layers_are_the_identity_outside_a_mesh():
    tf_keras.utils.set_random_seed(1)
    x = tf.random.normal([2, 8, 4])
    assert sequence.SequenceSharding()(x) is x or np.array_equal(sequence.SequenceSharding()(x), x)
    layer = sequence.SequenceGather(megatron_only=True)
    assert layer.get_config()["megatron_only"] is True
    np.testing.assert_array_equal(layer(x), x)


def _table(tmp_path, body):
    path = tmp_path / "t.toml"
    path.write_text(body)
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("seq_len", r"sequence length 18 \(layer 'seq_in'\) is not divisible by mesh axis 'seq' of "
                r"size 4: each device holds seq_len / 4 positions. Use a --seq_len that is a "
                r"multiple of 4"),
    ("no_sequence_dim", r"mesh axis 'seq' \(size 4\) shards activations along their sequence "
                        r"dim .* but model 'mnist_mlp' has no sequence layers"),
    ("table_axis", r"sequence_axis 'sq' must be one of the table's axes \['batch', 'seq'\]"),
    ("plain_table", r"mesh axis 'seq' of size 4 shards no weight and no input"),
    ("fsdp", r"fsdp=True \(--fsdp\) with the sequence sharded over mesh axis 'seq' \(size 4\) "
             r"fails inside DTensor; drop --fsdp"),
    ("heads", r"sequence_attention = \"all_to_all\" \(layout table\) cannot run: attention layer "
              r"'block0_attn' has 2 heads, which mesh axis 'seq' of size 4 cannot divide .* Use "
              r"heads divisible by 4, or sequence_attention = \"all_gather\""),
    ("attention_key", r"sequence_attention 'ulysses' must be \"auto\", \"all_gather\" or "
                      r"\"all_to_all\""),
])
def test_bad_sequence_sharding_is_one_value_error(tmp_path, case, message):
    mesh = dtk.build_mesh("batch=2,seq=4")
    with pytest.raises(ValueError, match=message):
        if case == "seq_len":
            layouts.build_model(functools.partial(FACTORY, seq_len=18), mesh, "transformer_lm",
                                seed=0)
        elif case == "no_sequence_dim":
            table = _table(tmp_path, 'axes = ["batch", "seq"]\noptional_axes = ["seq"]\n'
                                     'sequence_axis = "seq"\ndefault = "replicated"\n')
            layouts.build_model(models.mnist_mlp, mesh, table, seed=0)
        elif case == "fsdp":
            layouts.build_model(FACTORY, mesh, "transformer_lm", seed=0, fsdp=True)
        elif case == "heads":
            layouts.build_model(functools.partial(FACTORY, heads=2), mesh,
                                _table_with("all_to_all"), seed=0)
        elif case == "attention_key":
            layouts.load_table(_table(tmp_path, 'axes = ["batch", "seq"]\nsequence_axis = "seq"\n'
                                                'sequence_attention = "ulysses"\n'))
        elif case == "table_axis":
            layouts.load_table(_table(tmp_path, 'axes = ["batch", "seq"]\nsequence_axis = "sq"\n'))
        else:
            layouts.build_model(models.mnist_mlp, mesh, "data_parallel", seed=0)


@pytest.mark.parametrize("spec, mode", [
    ("batch=2,seq=4", "all_gather"), ("batch=2,seq=4", "all_to_all"),
    pytest.param("batch=2,seq=2,model=2", None, marks=pytest.mark.slow),
    pytest.param("batch=1,seq=8", None, marks=pytest.mark.slow)])
def test_blockwise_attention_trains_like_one_device_on_sequence_meshes(monkeypatch, spec, mode):
    """The LM with blockwise attention (4 keys a block; residual dropout 0.1) on sequence meshes,
    its blocks chained as long sequences run them: the losses of batch=1 (1e-5) for 20 steps.
    With the keys gathered (the queries stay sharded along the sequence: every block meets every
    query) and with Ulysses' all-to-all (whole sequences a device: future blocks skipped).
    On ``batch=1,seq=8`` (one head a device after the all-to-all) a 4-D ``tf.transpose`` failed
    DTensor's SPMD expansion ("needs communication": a size-1 batch axis against unsharded), as
    the README's long-context command did; einsum permutes instead."""
    from dtk.parallel import attention  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(attention, "_CHAIN_BYTES", 0)
    factory = functools.partial(FACTORY, attention="blockwise", block_size=4)
    runs = {}
    for mesh_spec in ("batch=1", spec):
        mesh = dtk.build_mesh(mesh_spec)
        model, _ = layouts.build_model(factory, mesh, _table_with(
            mode if mesh_spec != "batch=1" else None), seed=7)
        if mode and mesh_spec != "batch=1":
            sharded = getattr(model.get_layer("block0_attn"), "_dtk_queries_sharded", False)
            assert sharded == (mode == "all_gather")
        steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                          optimizer=tf_keras.optimizers.Adam(3e-3, mesh=mesh),
                          config=dtk.StepConfig(shard_optimizer_state=False))
        x, y = _data()
        runs[mesh_spec] = [float(steps.train(input_lib.pack(
            mesh, (x[i], y[i], np.ones(B, np.float32))))) for i in range(N)]
    np.testing.assert_allclose(runs[spec], runs["batch=1"], rtol=1e-5)
    assert runs[spec][-1] < runs[spec][0]
