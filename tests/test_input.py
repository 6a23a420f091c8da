"""The input path: MNIST sources, the packer on every mesh and client, the remainder policies."""

import gzip
import itertools
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk
from dtk.data import input as input_lib
from dtk.data import mnist
from tests import procs
from tests.dtensor_asserts import assert_dtensor

DATA = procs.REPO.parent / "shared" / "data" / "mnist"
SPECS = ["batch=8", "batch=4,model=2", "model=2,batch=4", "batch=2,model=4", "batch=1"]


def _batch(b=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((b, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, b).astype(np.int64),
            np.ones(b, np.float32))


@pytest.mark.parametrize("spec", SPECS)
def test_pack_global_value_and_layout(spec):
    mesh = dtk.build_mesh(spec)
    x, y, w = _batch()
    px, py, pw = input_lib.pack(mesh, (x, y, w))
    assert_dtensor(px, layout=dtensor.Layout.batch_sharded(mesh, "batch", 4), value=x)
    assert_dtensor(py, layout=dtensor.Layout.batch_sharded(mesh, "batch", 1), value=y)
    assert_dtensor(pw, value=w)
    # Device (batch=i, any model index) holds rows i*per .. (i+1)*per - 1.
    per = 16 // mesh.dim_size("batch")
    for shard, loc in zip(dtensor.unpack(py), mesh.local_device_locations()):
        np.testing.assert_array_equal(shard.numpy(), y[loc["batch"] * per:(loc["batch"] + 1) * per])


@pytest.mark.parametrize("spec", ["batch=8", "model=2,batch=4"])
def test_pack_stacked_and_nested(spec):
    mesh = dtk.build_mesh(spec)
    x, y, _ = _batch(24)
    stack = {"x": x.reshape(3, 8, 28, 28, 1), "y": y.reshape(3, 8)}
    packed = input_lib.pack(mesh, stack, stacked=True)
    assert dtensor.fetch_layout(packed["x"]).sharding_specs == [
        dtensor.UNSHARDED, "batch", dtensor.UNSHARDED, dtensor.UNSHARDED, dtensor.UNSHARDED]
    assert_dtensor(packed["y"], value=stack["y"])
    assert_dtensor(packed["x"], value=stack["x"])


def test_pack_without_batch_axis_is_an_error():
    """Inputs silently replicated on every device would train on the wrong batch."""
    mesh = dtk.build_mesh("model=8")
    _, y, _ = _batch(6)
    with pytest.raises(ValueError, match=r"batch_axis 'batch' is not an axis of mesh model=8; use "
                                         r"one of \['model'\].*add a batch=1 axis"):
        input_lib.pack(mesh, y)
    with pytest.raises(ValueError, match=r"InputConfig.batch_axis 'data' is not an axis of mesh "
                                         r"batch=8"):
        input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices((y, y)),
                                     dtk.build_mesh("batch=8"),
                                     input_lib.InputConfig(global_batch_size=8, batch_axis="data"))


@pytest.mark.parametrize("tree, kwargs, words", [
    ((np.zeros((100, 3)), np.zeros(100)), {}, r"element 0: dim 0 \(100\) is not divisible by mesh "
                                                r"axis 'batch' \(size 8\); use a global batch size "
                                                r"that is a multiple of 8 or set remainder='pad'"),
    (input_lib.Batch(np.zeros((8, 2)), np.zeros(16), np.ones(8)), {}, "labels: batch dim 0 is 16"),
    ((np.float32(1.0),), {}, "rank 0"),
    ((np.zeros((16, 2)),), {"stacked": True}, r"dim 1 \(2\) is not divisible"),
    ((np.zeros(16),), {"stacked": True}, "rank 1 .* has no batch dim 1"),
])
def test_pack_rejects_bad_input(tree, kwargs, words):
    with pytest.raises(ValueError, match=words):
        input_lib.pack(dtk.build_mesh("batch=8"), tree, **kwargs)


def _dataset(n, seed=0):
    rng = np.random.default_rng(seed)
    return tf.data.Dataset.from_tensor_slices(
        (rng.random((n, 4), dtype=np.float32), np.arange(n, dtype=np.int64)))


def _labels(data, epoch=0, skip=0):
    out = []
    for batch in data.epoch(epoch, skip_batches=skip):
        labels = dtk.global_value(batch.labels)
        weights = dtk.global_value(batch.weights)
        out.append(labels.reshape(-1, labels.shape[-1]) if labels.ndim > 1 else labels[None])
        if weights.ndim == 1:
            assert weights.shape == labels.shape
    return np.concatenate([o.ravel() for o in out]) if out else np.zeros(0)


def test_remainder_policies():
    mesh = dtk.build_mesh("batch=8")
    cfg = lambda **kw: input_lib.InputConfig(global_batch_size=16, **kw)  # noqa: E731
    drop = input_lib.DistributedDataset(_dataset(70), mesh, cfg())
    assert (drop.num_examples, drop.num_batches, drop.num_dropped) == (70, 4, 6)
    np.testing.assert_array_equal(_labels(drop), np.arange(64))

    pad = input_lib.DistributedDataset(_dataset(70), mesh, cfg(remainder="pad"))
    assert (pad.num_batches, pad.num_dropped) == (5, 0)
    batches = list(pad.epoch(0))
    last = batches[-1]
    assert last.labels.shape == [8]                  # 6 real rows padded to a multiple of 8
    np.testing.assert_array_equal(dtk.global_value(last.weights), [1] * 6 + [0] * 2)
    assert sum(float(tf.reduce_sum(dtk.global_value(b.weights))) for b in batches) == 70

    with pytest.raises(ValueError, match=r"70 examples do not divide into global batches of 16 "
                                         r"\(4 full batches, 6 left over\)"):
        input_lib.DistributedDataset(_dataset(70), mesh, cfg(remainder="error"))
    exact = input_lib.DistributedDataset(_dataset(64), mesh, cfg(remainder="error"))
    assert exact.num_batches == 4


@pytest.mark.parametrize("kwargs, words", [
    (dict(global_batch_size=100), r"global_batch_size \(100\) is not divisible by mesh axis 'batch' "
                                  r"\(size 8\); use a multiple of 8"),
    (dict(global_batch_size=0), "global_batch_size must be a positive integer"),
    (dict(global_batch_size=16, remainder="keep"), "remainder 'keep' is not one of drop, pad, error"),
    (dict(global_batch_size=16, steps_per_call=0), "steps_per_call must be a positive integer"),
])
def test_bad_config(kwargs, words):
    with pytest.raises(ValueError, match=words):
        input_lib.DistributedDataset(_dataset(64), dtk.build_mesh("batch=8"),
                                     input_lib.InputConfig(**kwargs))


def test_order_is_deterministic_across_meshes_and_resumable():
    cfg = input_lib.InputConfig(global_batch_size=8, shuffle=True, seed=11)
    orders = {spec: [_labels(input_lib.DistributedDataset(_dataset(40), dtk.build_mesh(spec), cfg), e)
                     for e in range(2)] for spec in ["batch=8", "batch=2,model=4", "model=2,batch=4"]}
    first = orders["batch=8"]
    for spec, order in orders.items():
        for e in range(2):
            np.testing.assert_array_equal(order[e], first[e], err_msg=spec)
    assert not np.array_equal(first[0], first[1])           # reshuffled each epoch
    assert sorted(first[0]) == list(range(40))
    data = input_lib.DistributedDataset(_dataset(40), dtk.build_mesh("batch=8"), cfg)
    np.testing.assert_array_equal(_labels(data, 1, skip=3), first[1][24:])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stacked_items_for_steps_per_execution(prefetch):
    mesh = dtk.build_mesh("batch=4,model=2")
    cfg = input_lib.InputConfig(global_batch_size=8, steps_per_call=3, prefetch=prefetch)
    data = input_lib.DistributedDataset(_dataset(56), mesh, cfg)   # 7 batches: 3 + 3 + 1
    items = list(data.epoch(0))
    assert [int(i.labels.shape[0]) for i in items] == [3, 3, 1]
    assert items[0].features.shape == [3, 8, 4]
    np.testing.assert_array_equal(_labels(data), np.arange(56))
    np.testing.assert_array_equal(_labels(data, skip=2), np.arange(16, 56))


def test_prefetch_stops_early_and_reraises(monkeypatch):
    data = input_lib.DistributedDataset(_dataset(64), dtk.build_mesh("batch=8"),
                                        input_lib.InputConfig(global_batch_size=8))
    assert len(list(itertools.islice(data.epoch(0), 2))) == 2   # abandoning the iterator is fine

    def broken(*args, **kwargs):
        raise RuntimeError("packing failed")

    monkeypatch.setattr(data, "_pad", broken)
    with pytest.raises(RuntimeError, match="packing failed"):
        list(data.epoch(0))


def test_the_stream_is_not_autotuned_so_a_restart_never_waits_for_tf_data():
    """Issue 39's prefetch stall: destroying an autotuned tf.data iterator waits for its
    optimization loop's timed sleep (gdb: ``RootDataset::Iterator::~Iterator`` in
    ``Model::OptimizeLoop``'s wait), and every restart of the stream destroys the last iterator
    (a predict or evaluate after a fit: DenseNet121's predict after a 2-epoch fit took 33-44 s in 4
    of 5 runs, 3.6-3.9 s without autotuning). tf.data alone did not reproduce it (iterators idle
    for 30-40 s were destroyed at once), so this checks the setting on the stream, and that the
    user's own options are kept."""
    source = _dataset(40).with_options(_deterministic_off())
    data = input_lib.DistributedDataset(source, dtk.build_mesh("batch=8"),
                                        input_lib.InputConfig(global_batch_size=8))
    options = data._stream_dataset().options()  # pylint: disable=protected-access
    assert options.autotune.enabled is False
    assert options.deterministic is False  # the user's setting survives
    np.testing.assert_array_equal(_labels(data), np.arange(40))


def _deterministic_off() -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = False
    return options


# -- sources --------------------------------------------------------------------------------------
@pytest.mark.full_mnist
def test_idx_mnist_counts_and_values():
    train = mnist.load_mnist("train", source="idx", data_dir=str(DATA))
    test = mnist.load_mnist("test", source="idx", data_dir=str(DATA))
    mesh = dtk.build_mesh("batch=8")
    evaluation = input_lib.DistributedDataset(test, mesh, input_lib.InputConfig(
        global_batch_size=128, remainder="pad"))
    assert evaluation.num_examples == 10_000
    counted = sum(float(tf.reduce_sum(dtk.global_value(b.weights))) for b in evaluation.epoch(0))
    assert counted == 10_000
    training = input_lib.DistributedDataset(train, mesh, input_lib.InputConfig(global_batch_size=128))
    assert (training.num_examples, training.num_batches, training.num_dropped) == (24_345, 190, 25)
    image, label = next(iter(train))
    assert image.shape == (28, 28, 1) and image.dtype == tf.float32 and label.dtype == tf.int64
    assert 0.0 <= float(tf.reduce_min(image)) and float(tf.reduce_max(image)) <= 1.0
    labels = np.concatenate([y for _, y in train.batch(4096).as_numpy_iterator()])
    np.testing.assert_array_equal(np.bincount(labels),
                                  [2406, 2770, 2381, 2524, 2386, 2181, 2401, 2524, 2328, 2444])


def _write_idx(path: Path, magic: bytes, dims, payload: bytes, compress=False):
    data = magic + b"".join(int(d).to_bytes(4, "big") for d in dims) + payload
    if compress:
        data = gzip.compress(data)
    path.write_bytes(data)


def test_idx_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        mnist.load_mnist("train", source="idx", data_dir=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\[.gz\] not found"):
        mnist.load_mnist("test", source="idx", data_dir=str(tmp_path))
    images, labels = tmp_path / "t10k-images-idx3-ubyte", tmp_path / "t10k-labels-idx1-ubyte.gz"
    _write_idx(images, b"\x00\x00\x08\x03", (3, 28, 28), bytes(3 * 784))
    _write_idx(labels, b"\x00\x00\x08\x01", (2,), bytes(2), compress=True)
    with pytest.raises(ValueError, match="holds 3 images but .* holds 2 labels"):
        mnist.load_mnist("test", source="idx", data_dir=str(tmp_path))
    _write_idx(images, b"\x12\x34\x08\x03", (3, 28, 28), bytes(3 * 784))
    with pytest.raises(ValueError, match=f"IDX file {images}: bad magic number '12340803'"):
        mnist.load_mnist("test", source="idx", data_dir=str(tmp_path))
    _write_idx(images, b"\x00\x00\x08\x03", (3, 28, 28), bytes(100))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        mnist.load_mnist("test", source="idx", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="split 'validation' is not one of train, test"):
        mnist.load_mnist("validation", source="idx", data_dir=str(DATA))
    with pytest.raises(ValueError, match="source 'web'"):
        mnist.load_mnist("test", source="web")


@pytest.mark.slow  # TFDS still tries the network for some lookups: 0.7-60 s, depending on order
def test_tfds_route_with_mock_data(monkeypatch):
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core.utils import gcs_utils
    monkeypatch.setattr(mnist, "network_reachable", lambda: True)
    # Else TFDS looks the dataset's info up on GCS first: a 60 s timeout with no network.
    monkeypatch.setattr(gcs_utils, "_is_gcs_disabled", True)
    with tfds.testing.mock_data(num_examples=40):
        ds = mnist.load_mnist("train", source="tfds")
        data = input_lib.DistributedDataset(ds, dtk.build_mesh("batch=8"),
                                            input_lib.InputConfig(global_batch_size=16,
                                                                  remainder="pad"))
    assert data.num_examples == 40 and data.num_batches == 3
    batch = next(iter(data))
    assert batch.features.shape == [16, 28, 28, 1] and batch.features.dtype == tf.float32
    values = dtk.global_value(batch.features)
    assert 0.0 <= values.min() and values.max() <= 1.0


@pytest.mark.slow  # importing TFDS's builders can wait on network lookups: 1-25 s by test order
def test_tfds_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("DTK_OFFLINE", "1")
    with pytest.raises(mnist.DataUnavailableError, match="source='idx' with data_dir"):
        mnist.load_mnist("train", source="tfds", data_dir=str(tmp_path))


# -- multi-client ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_clients_pack_the_same_global_batch():
    code = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        from tensorflow.experimental import dtensor
        import dtk
        from dtk.data import input as input_lib
        mesh = dtk.build_mesh("batch=4,model=2", device_type="cpu")
        rng = np.random.default_rng(0)
        x = rng.random((16, 3), dtype=np.float32)
        px = input_lib.pack(mesh, x)
        shards = dtensor.unpack(px)
        per = 16 // 4
        own = all(np.array_equal(s.numpy(), x[loc["batch"] * per:(loc["batch"] + 1) * per])
                  for s, loc in zip(shards, mesh.local_device_locations()))
        full = dtk.global_value(px)
        total = float(tf.reduce_sum(dtk.global_value(tf.reduce_sum(px, axis=0))))
        print("RESULT", len(shards), own, np.array_equal(full, x), abs(total - x.sum()) < 1e-4)
    """)
    results = procs.run_clients(code, 2, timeout=150)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert "RESULT 4 True True True" in res.stdout


# -- streaming ------------------------------------------------------------------------------------
def _labels_of(items):
    return np.concatenate([dtk.global_value(b.labels) for b in items])


def test_nothing_is_materialized():
    """A billion-example dataset (about 16 GB of features) is ready at once and streams batches."""
    huge = tf.data.Dataset.range(10 ** 9).map(
        lambda i: (tf.fill([4], tf.cast(i, tf.float32)), i))
    data = input_lib.DistributedDataset(huge, dtk.build_mesh("batch=8"),
                                        input_lib.InputConfig(global_batch_size=16))
    assert data.num_batches == 10 ** 9 // 16
    first = list(itertools.islice(data.epoch(0), 3))
    np.testing.assert_array_equal(_labels_of(first), np.arange(48))


def test_augmentation_in_the_pipeline_runs_every_epoch():
    """Even with a global seed set (which makes every new iterator replay the same random
    numbers), each epoch gets new augmentation: dtk reads all epochs as one stream."""
    tf_keras.utils.set_random_seed(0)
    augmented = _dataset(32).map(lambda x, y: (x + tf.random.uniform([4]), y))
    data = input_lib.DistributedDataset(augmented, dtk.build_mesh("batch=8"),
                                        input_lib.InputConfig(global_batch_size=16))
    first = [dtk.global_value(next(iter(data.epoch(e))).features) for e in range(2)]
    assert not np.allclose(first[0], first[1])   # new random shifts in epoch 2
    np.testing.assert_array_equal(_labels(data, 0), _labels(data, 1))  # same examples


def test_infinite_dataset_needs_steps_per_epoch_and_streams_on():
    mesh = dtk.build_mesh("batch=8")
    with pytest.raises(ValueError, match=r"dataset is infinite .*steps_per_epoch=N"):
        input_lib.DistributedDataset(_dataset(24).repeat(), mesh,
                                     input_lib.InputConfig(global_batch_size=8))
    cfg = input_lib.InputConfig(global_batch_size=8, steps_per_epoch=2)
    data = input_lib.DistributedDataset(_dataset(24).repeat(), mesh, cfg)
    assert (data.num_batches, data.num_examples) == (2, 16)
    epochs = [_labels(data, e) for e in range(3)]   # one stream: epoch e is batches 2e, 2e+1
    np.testing.assert_array_equal(np.concatenate(epochs), np.arange(48) % 24)
    resumed = input_lib.DistributedDataset(_dataset(24).repeat(), mesh, cfg)
    np.testing.assert_array_equal(_labels(resumed, 2, skip=1), epochs[2][8:])


def test_unknown_cardinality_is_counted_and_padded():
    odd = _dataset(50).filter(lambda x, y: y % 2 == 1)    # 25 examples, cardinality unknown
    data = input_lib.DistributedDataset(odd, dtk.build_mesh("batch=8"),
                                        input_lib.InputConfig(global_batch_size=16, remainder="pad"))
    assert (data.num_examples, data.num_batches) == (25, 2)
    batches = list(data.epoch(0))
    assert sum(float(np.sum(dtk.global_value(b.weights))) for b in batches) == 25


def test_sample_weights_and_nested_features():
    rng = np.random.default_rng(0)
    features = {"image": rng.random((16, 3), dtype=np.float32),
                "extra": rng.random((16, 2), dtype=np.float32)}
    weights = np.linspace(0.1, 1.6, 16).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((features, np.arange(16), weights))
    data = input_lib.DistributedDataset(ds, dtk.build_mesh("batch=4,model=2"),
                                        input_lib.InputConfig(global_batch_size=8))
    batch = next(iter(data))
    assert set(batch.features) == {"image", "extra"}
    np.testing.assert_allclose(dtk.global_value(batch.features["extra"]), features["extra"][:8])
    np.testing.assert_allclose(dtk.global_value(batch.weights), weights[:8])


def test_variable_length_features_must_be_padded_by_the_pipeline():
    ragged = tf.data.Dataset.range(8).map(lambda i: (tf.range(i), i))
    with pytest.raises(ValueError, match=r"dims of unknown size .*pad variable-length features"):
        input_lib.DistributedDataset(ragged, dtk.build_mesh("batch=8"),
                                     input_lib.InputConfig(global_batch_size=8))
    padded = ragged.map(lambda x, y: (tf.ensure_shape(tf.pad(x, [[0, 8 - tf.size(x)]]), [8]), y))
    data = input_lib.DistributedDataset(padded, dtk.build_mesh("batch=8"),
                                        input_lib.InputConfig(global_batch_size=8))
    assert dtk.global_value(next(iter(data)).features).shape == (8, 8)


def test_a_slow_source_is_named_while_the_step_waits(monkeypatch, caplog):
    """A batch that takes longer than STALL_REPORT_S to come is reported (a slow input pipeline
    is named, not mistaken for a hung step), and the batches still arrive in order."""
    import logging  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(input_lib, "STALL_REPORT_S", 0.05)
    mesh = dtk.build_mesh("batch=8")

    def slow(x):
        time.sleep(0.4)
        return x

    data = tf.data.Dataset.range(16).map(
        lambda i: (tf.py_function(slow, [tf.cast(i, tf.float32)], tf.float32)[None],
                   tf.cast(i, tf.int64)))
    data = data.map(lambda x, y: (tf.ensure_shape(x, [1]), y))
    stream = input_lib.DistributedDataset(data, mesh, input_lib.InputConfig(
        global_batch_size=8, prefetch=1))
    with caplog.at_level(logging.WARNING, logger="dtk"):
        labels = [dtk.global_value(b.labels) for b in stream.epoch(0)]
    np.testing.assert_array_equal(np.concatenate(labels), np.arange(16))
    assert any("no batch for" in r.getMessage() and "prefetch thread" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
