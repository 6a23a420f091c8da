"""Bad inputs, as a new user makes them: each gets one clear error that names the argument, its value
and the fix; none trains silently wrong, hangs, or shows a traceback on the command line.

Three tables: command-line flags checked in-process through train_mnist's flag checker (no
training), command-line cases that need TensorFlow in subprocesses (with timeouts), and library
calls.
"""

import gzip
import importlib
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from absl import flags

import dtk
from dtk.train import checkpoint as ckpt_lib
from dtk.cluster import env as cluster
from dtk.parallel import layouts
from dtk.data import mnist
from dtk.train import trainer as trainer_lib
from dtk.data import input as input_lib
from dtk.cluster.launch import LaunchConfig
from tests import procs

SCRIPT = procs.REPO / "scripts" / "train_mnist.py"
cli = importlib.import_module("dtk.apps.train_mnist")  # the code behind the script


@pytest.fixture(name="paths", scope="module")
def _paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "file").write_text("x")
    (tmp / "dir").mkdir()
    (tmp / "broken.toml").write_text("rules = [ [")
    (tmp / "extra.toml").write_text('axes = ["batch"]\ncolour = "red"\n')
    return tmp


def _check_cli(argv, paths):
    argv = [a.replace("{tmp}", str(paths)) for a in argv]
    cli.FLAGS.unparse_flags()
    cli.FLAGS(["train_mnist.py", *argv])
    try:
        cli._check_flags(dtk)
    finally:
        cli.FLAGS.unparse_flags()


CLI_CASES = [  # (flags, phrase the one-line error must contain)
    (["--mesh", "batch8"], "--mesh: mesh spec 'batch8': item 'batch8' is not of the form axis=size"),
    (["--mesh", "batch=0"], "axis 'batch' has size 0; sizes must be positive"),
    (["--mesh", "batch=8,batch=2"], "axis 'batch' appears twice"),
    (["--mesh", ""], "mesh spec '' is empty; give at least one axis, e.g. 'batch=8'"),
    (["--mesh", "batch=x"], "size of axis 'batch' is 'x', not an integer"),
    (["--mesh", "b-1=8"], "axis name 'b-1' is not a valid name"),
    (["--mesh", "model=8"], "--mesh model=8 has no 'batch' axis"),
    # issue 61: pipeline stages are train_lm.py's
    (["--mesh", "stage=2,batch=4"], "a 'stage' axis splits a model into pipeline stages, which "
     "train_lm.py runs (its blocks are the stages); train_mnist.py trains one model"),
    (["--mesh", "batch=256", "--global_batch_size", "256"], "needs 256 virtual CPUs on a machine with"),
    (["--epochs", "0"], "--epochs must be a positive integer; got 0"),
    (["--global_batch_size", "0"], "--global_batch_size must be a positive integer; got 0"),
    (["--global_batch_size", "100"], "--global_batch_size 100 is not divisible by mesh axis "
                                     "'batch' (size 8); use a multiple of 8"),
    (["--mesh", "batch=4,model=2", "--global_batch_size", "30"], "not divisible by mesh axis "
                                                                   "'batch' (size 4)"),
    (["--steps_per_execution", "0"], "--steps_per_execution must be auto or a positive integer; got 0"),
    (["--max_steps", "0"], "--max_steps must be a positive integer; got 0"),
    (["--virtual_devices", "0"], "--virtual_devices must be a positive integer; got 0"),
    (["--grad_accum", "0"], "--grad_accum must be a positive integer; got 0"),
    (["--learning_rate", "-1"], "--learning_rate must be a positive, finite number; got -1.0"),
    (["--learning_rate", "inf"], "--learning_rate must be a positive, finite number; got inf"),
    (["--learning_rate", "nan"], "--learning_rate must be a positive, finite number; got nan"),
    (["--optimizer", "adamm"], "--optimizer 'adamm' is unknown; choose one of"),
    (["--optimizer", "nadam"], "--optimizer 'nadam' is unknown"),
    (["--layout", "no_such_table"], "--layout: layout table 'no_such_table' is unknown; tables:"),
    (["--layout", "/no/such.toml"], "layout table file /no/such.toml does not exist"),
    (["--layout", "{tmp}/dir"], "is a directory; pass a .toml file"),
    (["--layout", "{tmp}/broken.toml"], "broken.toml cannot be read"),
    (["--layout", "{tmp}/extra.toml"], "unknown keys ['colour']"),
    (["--dataset", "idx"], "--dataset idx needs --data_dir DIR"),
    (["--dataset", "idx", "--data_dir", "/no/such/dir"], "--data_dir '/no/such/dir' is not a "
                                                         "directory"),
    (["--data_dir", "/no/such/dir"], "--data_dir '/no/such/dir' is not a directory"),
    (["--dataset", "sample", "--data_dir", "{tmp}/dir"], "--dataset sample reads the sample "
                                                         "bundled with dtk; drop --data_dir"),
    (["--checkpoint_dir", "{tmp}/file"], "--checkpoint_dir '"),
    (["--export_dir", "{tmp}/file"], "is a file; give a directory"),
    (["--tensorboard_dir", "{tmp}/file"], "--tensorboard_dir"),
    (["--summary_json", "{tmp}/dir"], "--summary_json '"),
    (["--summary_json", "{tmp}/new/"], "is a directory; give a file path"),
    (["--summary_json", "{tmp}/file/summary.json"], "is a file, where a directory should be"),
    (["--checkpoint_dir", "{tmp}/file/sub"], "is a file, where a directory should be"),
    (["--checkpoint_dir", "/proc/nope/ckpt"], "is not writable"),
]


@pytest.mark.parametrize("argv, phrase", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_cli_flag_errors(argv, phrase, paths):
    with pytest.raises(cli.UsageError) as info:
        _check_cli(argv, paths)
    message = str(info.value)
    assert phrase.replace("{tmp}", str(paths)) in message, message
    assert "\n" not in message  # one line


@pytest.mark.parametrize("argv, phrase", [
    (["--model", "resnet"], "value should be one of <mlp|cnn>"),
    (["--device", "fpga"], "value should be one of <auto|cpu|gpu|tpu>"),
    (["--epochs", "three"], "invalid literal for int"),
    (["--dataset", "web"], "value should be one of <tfds|idx|sample>"),
])
def test_cli_flag_parse_errors(argv, phrase):
    """absl rejects these while parsing (one line, exit status 1, no traceback)."""
    cli.FLAGS.unparse_flags()
    with pytest.raises(flags.Error, match=phrase):
        cli.FLAGS(["train_mnist.py", *argv])
    cli.FLAGS.unparse_flags()


def _write_idx(path, array, type_code=0x08):
    header = bytes([0, 0, type_code, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture(name="bad_idx", scope="module")
def _bad_idx(tmp_path_factory):
    """IDX files of 14x14 images (not MNIST) and one with a bad magic number."""
    small = tmp_path_factory.mktemp("small_idx")
    for prefix in ("train", "t10k"):
        _write_idx(small / f"{prefix}-images-idx3-ubyte.gz", np.zeros((10, 14, 14)))
        _write_idx(small / f"{prefix}-labels-idx1-ubyte.gz", np.zeros(10))
    magic = tmp_path_factory.mktemp("magic_idx")
    for prefix in ("train", "t10k"):
        (magic / f"{prefix}-images-idx3-ubyte").write_bytes(b"\x12\x34\x56\x78" + bytes(20))
        _write_idx(magic / f"{prefix}-labels-idx1-ubyte.gz", np.zeros(10))
    return small, magic


SUBPROCESS_CASES = [  # flags, phrase; each run needs TensorFlow
    (["--device", "tpu"], "--device tpu: this machine has no TPU"),
    (["--mesh", "batch=16", "--virtual_devices", "8"], "needs 16 devices (16 in this process), "
                                                         "but only 8 CPU device(s) exist"),
    (["--mesh", "batch=4,model=2", "--layout", "transformer_block"],
     "layout table 'transformer_block' shards weights on mesh axes ['model'], but on this model "
     "it shards none"),
    (["--dataset", "idx", "--data_dir", "{small}"], "holds images of 14x14 pixels; MNIST images "
                                                    "are 28x28"),
    (["--dataset", "idx", "--data_dir", "{magic}"], "bad magic number"),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, phrase", SUBPROCESS_CASES,
                         ids=[" ".join(c[0][:2]) for c in SUBPROCESS_CASES])
def test_cli_errors_in_one_line(argv, phrase, bad_idx):
    small, magic = bad_idx
    argv = [a.format(small=small, magic=magic) for a in argv]
    res = subprocess.run([sys.executable, str(SCRIPT), "--epochs", "1", *argv], cwd=procs.REPO,
                         capture_output=True, text=True, timeout=120,
                         env=procs.base_env(DTK_OFFLINE="1"))
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and phrase in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_cli_checkpoint_of_another_model_is_one_line(tmp_path):
    common = ["--dataset", "sample", "--epochs", "1", "--max_steps", "2",
              "--checkpoint_dir", str(tmp_path)]
    first = subprocess.run([sys.executable, str(SCRIPT), *common], cwd=procs.REPO, timeout=180,
                           capture_output=True, text=True, env=procs.base_env())
    assert first.returncode == 0, first.stderr[-2000:]
    res = subprocess.run([sys.executable, str(SCRIPT), *common, "--model", "cnn"], timeout=180,
                         cwd=procs.REPO, capture_output=True, text=True, env=procs.base_env())
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "error: checkpoint" in res.stderr and "does not match this model" in res.stderr


# -- the library ----------------------------------------------------------------------------------
class _NoMeshMetric(tf_keras.metrics.Metric):
    """A user's metric whose class does not take mesh=."""

    def __init__(self, name="no_mesh"):
        super().__init__(name=name)

    def update_state(self, *args, **kwargs):
        pass

    def result(self):
        return 0.0


def _mesh():
    return dtk.build_mesh("batch=8")


def _ds(n=64, classes=10, x_shape=(28, 28, 1), nan=False):
    rng = np.random.default_rng(0)
    x = rng.random((n, *x_shape), dtype=np.float32)
    if nan:
        x[n // 2:] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, rng.integers(0, classes, n).astype(np.int64)))


def _data(n=64, gbs=32, num_classes=10, **kw):
    return input_lib.DistributedDataset(_ds(n, **kw), _mesh(), input_lib.InputConfig(
        global_batch_size=gbs, num_classes=num_classes))


def _trainer(**kw):
    kw.setdefault("config", dtk.TrainerConfig(verbose=0))
    return dtk.Trainer(mesh=_mesh(), model=kw.pop("model", dtk.models.mnist_mlp), **kw)


def _plain_model():
    return dtk.models.mnist_mlp()


API_CASES = [  # (id, call, exception, phrase)
    ("model is an array", lambda: _trainer(model=np.zeros(3)), TypeError,
     "model must be a tf_keras.Model or a factory returning one; got ndarray"),
    ("factory returns None", lambda: _trainer(model=lambda: None), TypeError,
     "model_factory must return a tf_keras.Model; it returned NoneType"),
    ("plain built model", lambda: _trainer(model=_plain_model()), ValueError,
     "is a plain (not laid-out) tf_keras model"),
    ("config is a dict", lambda: _trainer(config={}), TypeError, "config must be a dtk.TrainerConfig"),
    ("trainer batch axis", lambda: _trainer(config=dtk.TrainerConfig(batch_axis="data", verbose=0)),
     ValueError, "TrainerConfig.batch_axis 'data' is not an axis of mesh batch=8"),
    ("fit on numpy", lambda: _trainer().fit((np.zeros((8, 28, 28, 1)), np.zeros(8)), epochs=1),
     TypeError, "data must be a dtk.DistributedDataset"),
    ("fit on tf.data", lambda: _trainer().fit(_ds(), epochs=1), TypeError,
     "Wrap a tf.data.Dataset of unbatched (features, labels) with dtk.DistributedDataset"),
    ("fit epochs 0", lambda: _trainer().fit(_data(), epochs=0), ValueError,
     "epochs must be a positive integer; got 0"),
    ("labels out of range", lambda: _trainer().fit(_data(classes=40), epochs=1), ValueError,
     "value(s) outside [0, 10) in a batch (e.g. 10; InputConfig(num_classes=10))"),
    ("no batches", lambda: _trainer().fit(_data(n=5, gbs=8), epochs=1), ValueError,
     "data has no batches: 5 example(s) with global_batch_size=8"),
    ("load_table(123)", lambda: layouts.load_table(123), TypeError,
     "layout table must be a name"),
    ("load_table(dir)", lambda: layouts.load_table(procs.REPO / "layouts"), ValueError,
     "is a directory; pass a .toml file"),
    ("load_table unknown", lambda: layouts.load_table("nope"), ValueError,
     "layout table 'nope' is unknown"),
    ("negative learning rate", lambda: dtk.make_optimizer("adam", _mesh(), learning_rate=-1e-3),
     ValueError, "learning_rate must be a positive, finite number; got -0.001"),
    ("zero learning rate", lambda: dtk.make_optimizer("sgd", _mesh(), learning_rate=0.0),
     ValueError, "learning_rate must be a positive, finite number; got 0.0"),
    ("nan learning rate", lambda: dtk.make_optimizer("sgd", _mesh(), learning_rate=float("nan")),
     ValueError, "got nan"),
    ("nadam", lambda: dtk.make_optimizer("nadam", _mesh()), ValueError,
     "optimizer 'nadam' is not supported under DTensor"),
    ("optimizer without mesh", lambda: dtk.make_optimizer(tf_keras.optimizers.Adam(), _mesh()),
     ValueError, "is not bound to the mesh"),
    ("legacy optimizer", lambda: dtk.make_optimizer(tf_keras.optimizers.legacy.Adam(), _mesh()),
     ValueError, "is a legacy tf_keras optimizer"),
    ("optimizer is a number", lambda: dtk.make_optimizer(3, _mesh()), TypeError,
     "optimizer must be a name or a tf_keras.optimizers.Optimizer; got int"),
    ("repeated metrics", lambda: dtk.make_metrics(["accuracy", "accuracy"], _mesh()), ValueError,
     "metric names ['accuracy'] are repeated"),
    ("custom metric without mesh", lambda: dtk.make_metrics([_NoMeshMetric()], _mesh()),
     ValueError, "is not bound to the mesh: without mesh= it runs under DTensor but reports "
                 "wrong values, and dtk cannot make it again"),
    ("unknown loss", lambda: dtk.make_loss("hinge_loss"), ValueError, "loss 'hinge_loss' is unknown"),
    ("loss is a number", lambda: dtk.make_loss(42), TypeError, "loss must be a name"),
    ("global batch 0", lambda: input_lib.InputConfig(global_batch_size=0), ValueError,
     "global_batch_size must be a positive integer; got 0"),
    ("remainder keep", lambda: input_lib.InputConfig(global_batch_size=8, remainder="keep"),
     ValueError, "remainder 'keep' is not one of drop, pad, error"),
    ("prefetch -1", lambda: input_lib.InputConfig(global_batch_size=8, prefetch=-1), ValueError,
     "prefetch must be >= 0"),
    ("dataset is numpy", lambda: input_lib.DistributedDataset(
        (np.zeros((8, 2)), np.zeros(8)), _mesh(), input_lib.InputConfig(global_batch_size=8)),
     TypeError, "Wrap arrays with tf.data.Dataset.from_tensor_slices((x, y))"),
    ("dataset is batched", lambda: input_lib.DistributedDataset(
        _ds().batch(16), _mesh(), input_lib.InputConfig(global_batch_size=16)), ValueError,
     "dataset looks batched"),
    ("dataset repeats forever", lambda: input_lib.DistributedDataset(
        _ds().repeat(), _mesh(), input_lib.InputConfig(global_batch_size=16)), ValueError,
     "dataset is infinite"),
    ("input batch axis", lambda: input_lib.DistributedDataset(
        _ds(), _mesh(), input_lib.InputConfig(global_batch_size=16, batch_axis="data")),
     ValueError, "InputConfig.batch_axis 'data' is not an axis of mesh batch=8"),
    ("global batch not divisible", lambda: input_lib.DistributedDataset(
        _ds(), _mesh(), input_lib.InputConfig(global_batch_size=12)), ValueError,
     "global_batch_size (12) is not divisible by mesh axis 'batch' (size 8)"),
    ("elements not pairs", lambda: input_lib.DistributedDataset(
        tf.data.Dataset.from_tensor_slices(np.zeros((8, 2))), _mesh(),
        input_lib.InputConfig(global_batch_size=8)), ValueError,
     "dataset elements must be (features, labels) or (features, labels, sample_weights) tuples"),
    ("steps_per_execution 0", lambda: dtk.StepConfig(steps_per_execution=0), ValueError,
     "steps_per_execution must be a positive integer"),
    ("max_steps 0", lambda: dtk.TrainerConfig(max_steps=0), ValueError,
     "max_steps must be a positive integer or None; got 0"),
    ("verbose 3", lambda: dtk.TrainerConfig(verbose=3), ValueError, "verbose must be 0, 1 or 2"),
    ("mesh too large", lambda: dtk.build_mesh("batch=16"), ValueError,
     "needs 16 devices (16 in this process), but only 8 CPU device(s) exist"),
    ("mesh spec None", lambda: dtk.parse_mesh_spec(None), TypeError,
     "mesh spec must be a string like 'batch=4,model=2'"),
    ("device type", lambda: dtk.build_mesh("batch=8", device_type="fpga"), ValueError,
     "device_type 'fpga' is not one of auto, cpu, gpu, tpu"),
    ("bad job address", lambda: cluster.client_env(jobs=["nohostport"], client=0), ValueError,
     "job address 'nohostport' is not host:port"),
    ("client id outside jobs", lambda: cluster.client_env(jobs=["a:1", "b:2"], client=2),
     ValueError, "client id 2 is outside the 2 jobs"),
    ("launch 0 clients", lambda: LaunchConfig(num_clients=0), ValueError,
     "num_clients must be at least 1; got 0"),
    ("checkpoint dir empty", lambda: ckpt_lib.Checkpointer("", model=None, optimizer=None),
     ValueError, "checkpoint directory is empty"),
    ("mnist split", lambda: mnist.load_mnist("validation", source="sample"), ValueError,
     "split 'validation' is not one of train, test"),
    ("mnist source", lambda: mnist.load_mnist("test", source="web"), ValueError,
     "source 'web' is not one of tfds, idx, sample"),
    # Issue 41: settings a built model cannot honour are refused, not silently dropped.
    ("fsdp with a built model", lambda: _trainer(
        model=layouts.build_model(dtk.models.mnist_mlp, _mesh(), "data_parallel", seed=0)[0],
        config=dtk.TrainerConfig(fsdp=True, verbose=0)), ValueError,
     "TrainerConfig.fsdp apply only when model is a factory"),
    ("input_shape with a built model", lambda: _trainer(
        model=layouts.build_model(dtk.models.mnist_mlp, _mesh(), "data_parallel", seed=0)[0],
        input_shape=(28, 28, 1)), ValueError, "input_shape apply only when model is a factory"),
    ("seed not an integer", lambda: dtk.TrainerConfig(seed="abc"), ValueError,
     "seed must be an integer; got str 'abc'"),
    ("remat of numbers", lambda: dtk.TrainerConfig(remat=[1, 2]), ValueError,
     "remat must be a tuple of layer-name patterns (strings)"),
    ("plan of a name", lambda: dtk.plan("mlp", devices=8, global_batch_size=64), TypeError,
     "model_factory must be a function that builds the tf_keras model"),
    ("plan budget as a string", lambda: dtk.plan(dtk.models.mnist_mlp, devices=8,
                                                 global_batch_size=64, device_memory_gb="1"),
     ValueError, "device_memory_gb must be a positive number of GiB"),
    ("plan remat patterns as a string", lambda: dtk.plan(
        dtk.models.mnist_mlp, devices=8, global_batch_size=64, remat_patterns="d1"), ValueError,
     "remat_patterns must be a list of layer-name patterns"),
    ("plan input_shape wrong", lambda: dtk.plan(
        dtk.models.mnist_mlp, devices=8, global_batch_size=64, input_shape="28x28"), ValueError,
     "input_shape must be one example's shape as positive integers"),
    ("label ids beyond the model's classes", lambda: _trainer().fit(
        input_lib.DistributedDataset(_ds(classes=13), _mesh(), input_lib.InputConfig(
            global_batch_size=32)), epochs=1), ValueError,
     "outside [0, 10) in a batch (e.g. 1"),
    ("allow_change typo on a fresh run", lambda: _trainer(
        config=dtk.TrainerConfig(verbose=0, allow_change=("learning_rat",))).fit(
            _data(), epochs=1), ValueError,
     "allow_change (--allow_change) names setting(s) ['learning_rat']"),
    # Issue 59: raw errors of the library API, each one clear line now.
    ("string labels", lambda: _trainer().fit(input_lib.DistributedDataset(
        tf.data.Dataset.from_tensor_slices((np.zeros((64, 28, 28, 1), np.float32),
                                            np.array([b"cat", b"dog"] * 32))), _mesh(),
        input_lib.InputConfig(global_batch_size=32)), epochs=1), ValueError,
     "labels are strings (e.g. b'cat'), not class ids"),
    ("sequence axis is the batch axis", lambda: input_lib.DistributedDataset(
        _ds(), _mesh(), input_lib.InputConfig(global_batch_size=32, sequence_axis="batch")),
     ValueError, "InputConfig.sequence_axis 'batch' is the batch axis"),
    ("export onto a file", lambda: _export_onto_a_file(), ValueError,
     "export_dir '/dev/null' is a file; give a directory"),
    ("table planned twice", lambda: __import__("dtk.planning.tables", fromlist=["x"]).plan_mesh(
        [__import__("dtk.planning.tables", fromlist=["x"]).Table(path="t.embeddings", rows=64,
                                                                 dim=8)] * 2,
        8, global_batch_size=64), ValueError, "tables names ['t.embeddings'] more than once"),
    ("distribute batch_size the axis cannot divide", lambda: _distributed().fit(
        np.zeros((64, 28, 28, 1), np.float32), np.zeros(64, np.int64), batch_size=30,
        verbose=0), ValueError,
     "fit(batch_size=30): mesh axis 'batch' of size 8 cannot split it evenly"),
    ("distribute run_eagerly", lambda: _distributed(run_eagerly=True), ValueError,
     "compile(run_eagerly=True): a laid-out model's steps run as compiled functions"),
    ("distribute a legacy optimizer", lambda: _distributed(
        optimizer=tf_keras.optimizers.legacy.Adam()), ValueError,
     "optimizer is a legacy optimizer (Adam), which cannot be bound to a DTensor mesh"),
    ("plan_layouts of a built model", lambda: layouts.plan_layouts(
        "data_parallel", _mesh(), dtk.models.mnist_mlp()), TypeError,
     "plan_layouts needs the model FACTORY (a function that builds the model"),
    ("distribute a mesh without a batch axis", lambda: dtk.distribute(
        dtk.models.mnist_mlp, dtk.build_mesh("model=8")), ValueError, "'batch'"),
    # Issue 70: the old raw cases, one line each naming the argument and the fix
    ("features_wrong_shape_32x32", lambda: _trainer().fit(input_lib.DistributedDataset(
        _ds(x_shape=(32, 32, 1)), _mesh(), input_lib.InputConfig(global_batch_size=32)),
        epochs=1), ValueError,
     "fit(train_data=...): one example's features have shape (32, 32, 1), but model 'mnist_mlp' "
     "takes (28, 28, 1) (its Input 'flatten_input'); reshape or resize them"),
    ("validation features of the wrong shape", lambda: _trainer().fit(
        _data(), epochs=1, validation_data=input_lib.DistributedDataset(
            _ds(x_shape=(14, 14, 1)), _mesh(), input_lib.InputConfig(global_batch_size=32))),
     ValueError, "fit(validation_data=...): one example's features have shape (14, 14, 1)"),
    ("validation_data as a tf.data dataset", lambda: _trainer().fit(
        _data(), epochs=1, validation_data=_ds().batch(32)), TypeError,
     "fit(validation_data=...): data must be a dtk.DistributedDataset; got _BatchDataset. "
     "Wrap a tf.data.Dataset of unbatched "
     "(features, labels) with dtk.DistributedDataset"),
    ("plan over devices that cannot split the batch", lambda: dtk.plan(
        dtk.models.mnist_mlp, devices=3, global_batch_size=128), ValueError,
     "no candidate can run: every mesh of these devices splits the global batch 128 over a "
     "batch axis of 3, which does not divide it; use a global_batch_size (--global_batch_size) "
     "that 3 divides (e.g. 129), or a device count that divides 128"),
    ("plan input_shape the model cannot take", lambda: dtk.plan(
        dtk.models.mnist_mlp, devices=8, global_batch_size=64, input_shape=(32, 32, 1)),
     ValueError, "plan(input_shape=(32, 32, 1)): one example's features have shape (32, 32, 1), "
                 "but model 'mnist_mlp' takes (28, 28, 1)"),
    ("a Keras 3 layer in a tf_keras model", lambda: _trainer(model=_keras3_layer_inside),
     TypeError, "model_factory mixes Keras 3 (Dense, from the keras package) into a tf_keras "
                "model"),
    ("mse and sgd for class ids", lambda: _trainer(loss="mse", optimizer="sgd").fit(
        _data(), epochs=1), ValueError,
     "fit(train_data=...): the labels are one number per example (shape ()), but the loss "
     "'mean_squared_error' compares them with the 10 scores per example that model "
     "'mnist_mlp' outputs; for class ids use loss='sparse_categorical_crossentropy'"),
    ("dict features into a Sequential", lambda: _trainer().fit(input_lib.DistributedDataset(
        tf.data.Dataset.from_tensor_slices(({"image": np.zeros((64, 28, 28, 1), np.float32)},
                                            np.zeros(64, np.int64))), _mesh(),
        input_lib.InputConfig(global_batch_size=32)), epochs=1), ValueError,
     "fit(train_data=...): the features are a dict with keys ['image'], but model 'mnist_mlp' "
     "takes one input, 'flatten_input' of shape (28, 28, 1); map the data to "
     "(features['image'], labels)"),
]


def _keras3_layer_inside():
    import keras  # pylint: disable=import-outside-toplevel
    return tf_keras.Sequential([tf_keras.layers.Flatten(input_shape=(28, 28, 1)),
                                keras.layers.Dense(10)])


class _Subclassed(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.flat, self.dense = tf_keras.layers.Flatten(), tf_keras.layers.Dense(10)

    def call(self, x):
        return self.dense(self.flat(x))


def test_a_subclassed_model_called_on_a_tensor_in_its_factory_trains():
    """Issue 70's old case (raw before): built by a call on a host tensor in the factory, it
    trains with the Trainer like the same model built by Keras."""
    def factory():
        model = _Subclassed()
        model(tf.zeros((1, 28, 28, 1)))
        return model

    history = _trainer(model=factory).fit(_data(), epochs=2).history
    assert history["loss"][1] < history["loss"][0]


def _distributed(**compile_kwargs):
    model = dtk.distribute(dtk.models.mnist_mlp, _mesh())
    compile_kwargs.setdefault("optimizer", "adam")
    model.compile(loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_kwargs)
    return model


def _export_onto_a_file():
    trainer = _trainer()
    return trainer.export("/dev/null")


@pytest.mark.parametrize("call, error, phrase", [c[1:] for c in API_CASES],
                         ids=[c[0] for c in API_CASES])
def test_library_errors(call, error, phrase):
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), str(info.value)


@pytest.mark.parametrize("variable, value, phrase", [
    ("DTK_VIRTUAL_DEVICES", "four", "DTK_VIRTUAL_DEVICES='four' is not an integer"),
    ("DTK_VIRTUAL_DEVICES", "0", "DTK_VIRTUAL_DEVICES='0' must be >= 1"),
    ("DTK_REGISTER_TIMEOUT_S", "-5", "DTK_REGISTER_TIMEOUT_S='-5' must be a positive, finite"),
    ("DTK_OFFLINE", "maybe", "DTK_OFFLINE='maybe' is not a boolean"),
])
def test_environment_variables_are_validated(monkeypatch, variable, value, phrase):
    from dtk import _env  # pylint: disable=import-outside-toplevel
    monkeypatch.setenv(variable, value)
    getter = {"DTK_VIRTUAL_DEVICES": lambda: _env.get_int(variable),
              "DTK_REGISTER_TIMEOUT_S": lambda: _env.get_seconds(variable, 1.0),
              "DTK_OFFLINE": lambda: _env.get_flag(variable)}[variable]
    with pytest.raises(ValueError, match=phrase.replace("(", r"\(")):
        getter()


def test_client_id_outside_the_jobs(monkeypatch):
    monkeypatch.setenv("DTENSOR_JOBS", "a:1,b:2")
    monkeypatch.setenv("DTENSOR_CLIENT_ID", "5")
    with pytest.raises(ValueError, match=r"DTENSOR_CLIENT_ID='5' is not a client id of this run: "
                                         r"DTENSOR_JOBS names 2 client\(s\)"):
        cluster.client_id()


def test_non_finite_loss_stops_training_with_epoch_and_step():
    trainer = _trainer()
    with pytest.raises(trainer_lib.NonFiniteLossError, match=r"became nan in epoch 1, by step 2; "
                                                             r".*stop_on_nan=False"):
        trainer.fit(_data(nan=True), epochs=3)  # the second batch holds NaN features
    off = _trainer(config=dtk.TrainerConfig(stop_on_nan=False, verbose=0))
    assert np.isnan(off.fit(_data(nan=True), epochs=1).history["loss"][0])


@pytest.mark.slow
def test_failed_step_is_one_clear_error():
    """A label out of range that reaches a step (no host check): one clear error that says the
    process must restart. In its own process: a failed DTensor step cancels the collectives."""
    code = """
import tests.conftest
import tf_keras
from tests.test_bad_inputs import _data, _trainer
def loss(y, p):
    return tf_keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)
try:
    _trainer(loss=loss).fit(_data(classes=40, num_classes=None), epochs=1)
except ValueError as e:
    print("ERROR", e)
"""
    res = procs.run_python(code, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"ERROR a step failed in epoch 1, at or before step \d: (INVALID_ARGUMENT: )?Received a label value "
                     r"of \d+ which is outside the valid range of \[0, 10\).*restart the process",
                     res.stdout), res.stdout[-2000:]


@pytest.mark.parametrize("case", ["predict", "fit", "sparse fit"])
def test_an_id_outside_a_row_sharded_table_is_one_clear_error(case):
    """An id beyond a row-sharded table's rows (issue 59: predict raised a raw
    InvalidArgumentError, and fit with sparse tables a raw CancelledError while it formatted its
    own message): one error naming the layer, its rows, the ids and the fix, for the Trainer's
    fit (dense and sparse updates) and predict. Each in its own process: a failed DTensor step
    cancels the process's collectives, and every later step reports only that."""
    code = """
import functools, numpy as np, tensorflow as tf, tf_keras
import tests.conftest
import dtk
from dtk.data import input as input_lib
mesh = dtk.build_mesh("batch=4,model=2")
factory = functools.partial(dtk.models.dlrm, table_sizes=(64, 32), bottom=(8,), top=(8,), dim=4)
x = {"dense": np.zeros((64, 8), np.float32), "ids": np.zeros((64, 2), np.int32)}
x["ids"][5, 0] = 100
y = np.zeros((64, 1), np.float32)
def data():
    return input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                        input_lib.InputConfig(global_batch_size=32))
def trainer(sparse):
    return dtk.Trainer(mesh=mesh, model=factory, layout="recsys", loss="binary_crossentropy",
                       optimizer=dtk.make_optimizer("adagrad", mesh, learning_rate=0.1),
                       config=dtk.TrainerConfig(verbose=0, sparse_tables=sparse))
call = {"predict": lambda: trainer(False).predict(data()),
        "fit": lambda: trainer(False).fit(data(), epochs=1),
        "sparse fit": lambda: trainer(True).fit(data(), epochs=1)}[CASE]
try:
    call()
    print("NO ERROR")
except Exception as e:
    print("ERROR", type(e).__name__, str(e).replace(chr(10), " "))
"""
    res = procs.run_python(code.replace("[CASE]", f"[{case!r}]"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [l for l in res.stdout.splitlines() if l.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 1, res.stdout[-3000:]
    for line in lines:
        if "an id is outside the rows of Embedding table0 (its table" not in line:
            # The failing device's error lost the race to the others' cancelled collectives
            # (rare; more so on a busy machine): the message names the tables and the check.
            assert "a cancelled collective" in line and "Embedding table0 (64 rows)" in line \
                and "check that every id is below its table's rows" in line, line
            continue
        assert "an id is outside the rows of Embedding table0 (its table has 64 rows, sharded " \
               "on them over mesh axis model): ids must be in [0, 64); give the layer " \
               "input_dim above the largest id" in line and "[100]" in line, line


def test_unmatched_rules_are_logged(caplog):
    table = layouts.load_table("mlp_model_parallel")
    renamed = lambda: tf_keras.Sequential([  # noqa: E731  (layers not named d1, d2)
        tf_keras.layers.Flatten(input_shape=(28, 28, 1)), tf_keras.layers.Dense(8),
        tf_keras.layers.Dense(10)])
    with caplog.at_level("WARNING", logger="dtk"):
        with pytest.raises(ValueError, match="shards none"):
            layouts.build_model(renamed, dtk.build_mesh("batch=4,model=2"), table, seed=0)
        layouts.build_model(renamed, _mesh(), table, seed=0)  # batch=8: model axis absent
    assert "match no weight of this model" in caplog.text
    assert "4 weight(s) matched no rule" in caplog.text
    assert os.environ.get("DTENSOR_JOBS") is None


@pytest.mark.parametrize("jobs, client, phrase", [
    ("garbage", "0", "DTENSOR_JOBS='garbage': address 'garbage' is not host:port"),
    ("localhost:1,,localhost:2", "0", "has an empty entry"),
    ("localhost:1,localhost:70000", "0", "address 'localhost:70000' is not host:port"),
    ("localhost:1,localhost:2", "5", "DTENSOR_CLIENT_ID='5' is not a client id of this run"),
])
def test_malformed_dtensor_cluster_variables_are_one_line(monkeypatch, jobs, client, phrase):
    """Issue 41: checked before TensorFlow tries to join (its error was a traceback)."""
    monkeypatch.setenv("DTENSOR_JOBS", jobs)
    monkeypatch.setenv("DTENSOR_CLIENT_ID", client)
    with pytest.raises(ValueError) as info:
        cluster.check_environment()
    assert phrase in str(info.value), str(info.value)


# -- dtk.distribute: Keras's own compile/fit/evaluate/predict on the mesh (issues 58, 59) --------
# Each row: (id, call, outcome, expected). Outcomes:
#   clear    - an error of the given type whose message names the argument and the fix (dtk's,
#              or Keras's own where plain Keras raises the same clear error);
#   refused  - something plain Keras accepts that dtk refuses before any step, with the reason;
#   accepted - runs as Keras runs it; ``expected`` checks the result (numbers equal to plain
#              tf_keras at 1e-5 where a plain run is cheap).
_DX = np.random.default_rng(0).random((64, 4), dtype=np.float32)
_DY = np.random.default_rng(1).integers(0, 3, 64).astype(np.int64)
_SCE = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _small():
    return tf_keras.Sequential([tf_keras.Input((4,)),
                                tf_keras.layers.Dense(8, activation="relu", name="h"),
                                tf_keras.layers.Dense(3, name="out")])


def _named():
    a, b = tf_keras.Input((4,), name="a"), tf_keras.Input((2,), name="b")
    return tf_keras.Model({"a": a, "b": b},
                          tf_keras.layers.Dense(3)(tf_keras.layers.Concatenate()([a, b])))


class _Sub(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.d = tf_keras.layers.Dense(3)

    def call(self, x):
        return self.d(x)


class _SwapOptimizer(tf_keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.optimizer = tf_keras.optimizers.SGD(0.1)


def _dm(factory=_small, *, mesh="batch=8", **compile_kwargs):
    model = dtk.distribute(factory, dtk.build_mesh(mesh), seed=0)
    compile_kwargs.setdefault("optimizer", "adam")
    compile_kwargs.setdefault("loss", _SCE)
    model.compile(**compile_kwargs)
    return model


def _plain(factory=_small, **compile_kwargs):
    tf_keras.utils.set_random_seed(0)
    model = factory()
    compile_kwargs.setdefault("optimizer", "adam")
    compile_kwargs.setdefault("loss", _SCE)
    model.compile(**compile_kwargs)
    return model


def _dfit(model=None, **kwargs):
    model = model or _dm()
    kwargs.setdefault("batch_size", 16)
    kwargs.setdefault("verbose", 0)
    kwargs.setdefault("epochs", 1)
    kwargs.setdefault("shuffle", False)
    x, y = kwargs.pop("x", _DX), kwargs.pop("y", _DY)
    return model.fit(x, y, **kwargs)


def _same_as_plain(compile_kwargs=None, **fit_kwargs):
    """Keras's fit on batch=8 and plain tf_keras's give the same history (1e-5)."""
    compile_kwargs = compile_kwargs or {}
    factory = compile_kwargs.pop("factory", _small)
    make = lambda: {k: (v() if callable(v) and k == "optimizer" else v)  # noqa: E731
                    for k, v in compile_kwargs.items()}
    ours = _dfit(_dm(factory, **make()), **dict(fit_kwargs)).history
    theirs = _dfit(_plain(factory, **make()), **dict(fit_kwargs)).history
    assert ours.keys() == theirs.keys(), (ours, theirs)
    for key in ours:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)
    return True


def _tmp(name):
    import tempfile  # pylint: disable=import-outside-toplevel
    return os.path.join(tempfile.mkdtemp(), name)


def _checkpoint_then_load(name, **kwargs):
    path = _tmp(name)
    _dfit(callbacks=[tf_keras.callbacks.ModelCheckpoint(path, **kwargs)])
    return os.path.exists(path)


def _saved_loads_in_plain_keras(name):
    model = _dm()
    _dfit(model)
    path = _tmp(name)
    model.save(path)
    loaded = tf_keras.models.load_model(path, compile=False)
    # (one device's matmul over 8 rows against 8 devices' over 1 row each: the kernels' sum
    # order differs by an ULP; 1.2e-6 measured on one of 24 values)
    np.testing.assert_allclose(loaded.predict(_DX[:8], verbose=0),
                               model.predict(_DX[:8], verbose=0), rtol=1e-5, atol=1e-7)
    return True


def _lr_after(callback, epochs):
    model = _dm()
    history = _dfit(model, epochs=epochs, callbacks=[callback]).history
    return history["lr"], float(model.optimizer.learning_rate.numpy())


DS = tf.data.Dataset.from_tensor_slices((_DX, _DY))

DISTRIBUTE_CASES = [
    # dtk.distribute's own arguments
    ("factory is a built model", lambda: dtk.distribute(_small(), _mesh()), "clear", TypeError,
     "needs the model FACTORY (a function that builds the model), not a built model"),
    ("factory returns None", lambda: dtk.distribute(lambda: None, _mesh()), "clear", TypeError,
     "model_factory must return a tf_keras.Model; it returned NoneType"),
    ("factory returns a model laid out on another mesh", lambda: dtk.distribute(
        lambda: dtk.distribute(_small, dtk.build_mesh("batch=4,model=2"), allow_replicated=True),
        _mesh()), "clear", ValueError,
     "model_factory returned a model already laid out on a mesh (batch=4,model=2; weight h/kernel"),
    # (Keras 3's own distribution API, dtk.train.keras3: tests/test_keras3.py)
    ("factory returns a Keras 3 model", lambda: dtk.distribute(
        lambda: __import__("keras").Sequential([__import__("keras").layers.Dense(2)]),
        "batch=8")._dtk_distribution is not None, "accepted", None, True),
    ("mesh as a spec string", lambda: isinstance(dtk.distribute(_small, "batch=8"),
                                                 tf_keras.Model), "accepted", None, True),
    ("mesh as a list", lambda: dtk.distribute(_small, [_mesh()]), "clear", TypeError,
     "mesh must be a dtensor.Mesh (dtk.build_mesh(...)), a mesh spec string like 'batch=8'"),
    ("layout unknown", lambda: dtk.distribute(_small, _mesh(), layout="nope"), "clear",
     ValueError, "layout table 'nope' is unknown; tables:"),
    ("seed a string", lambda: dtk.distribute(_small, _mesh(), seed="x"), "clear", ValueError,
     "Expected `seed` argument to be an integer. Received: seed=x"),
    ("batch_axis not on the mesh", lambda: dtk.distribute(_small, _mesh(), batch_axis="data"),
     "clear", ValueError, "batch_axis 'data' is not an axis of mesh batch=8; use one of ['batch']"),
    ("subclassed without input_shape", lambda: dtk.distribute(_Sub, _mesh()), "clear", ValueError,
     "returned an unbuilt _Sub (a subclassed model creates its weights on its first call); "
     "pass input_shape="),
    ("subclassed with input_shape", lambda: len(_dfit(_dm_sub()).history["loss"]), "accepted",
     None, 1),
    ("strict table with unmatched rules", lambda: dtk.distribute(
        _small, dtk.build_mesh("batch=4,model=2"), layout="mlp_model_parallel", strict=True),
     "clear", ValueError, "match no weight of this model; fix the patterns or pass strict=False"),
    # compile()
    ("compile run_eagerly", lambda: _dm(run_eagerly=True), "refused", ValueError,
     "compile(run_eagerly=True): a laid-out model's steps run as compiled functions"),
    ("compile jit_compile", lambda: _dm(jit_compile=True), "refused", ValueError,
     "compile(jit_compile=True): a laid-out model's step is compiled by DTensor's SPMD expansion"),
    ("compile optimizer name unknown", lambda: _dm(optimizer="adamm"), "clear", ValueError,
     "Unknown optimizer: 'adamm'"),
    ("compile loss name unknown", lambda: _dm(loss="hinge_los"), "clear", ValueError,
     "Unknown loss function: 'hinge_los'"),
    ("compile no loss", lambda: _dfit(_dm(loss=None)), "clear", ValueError, "No loss found"),
    ("compile legacy optimizer", lambda: _dm(optimizer=tf_keras.optimizers.legacy.Adam()),
     "clear", ValueError, "optimizer is a legacy optimizer (Adam), which cannot be bound"),
    ("compile Nadam by name", lambda: _dm(optimizer="nadam"), "refused", ValueError,
     "optimizer Nadam is not supported under DTensor: it keeps a plain tf.Variable"),
    ("compile Nadam object", lambda: _dm(optimizer=tf_keras.optimizers.Nadam()), "refused",
     ValueError, "optimizer Nadam is not supported under DTensor"),
    ("compile a Keras 3 optimizer", lambda: _dm(
        optimizer=__import__("keras").optimizers.Adam()), "clear", TypeError,
     "is a Keras 3 object"),
    ("compile a Keras 3 loss", lambda: _dm(
        loss=__import__("keras").losses.SparseCategoricalCrossentropy()), "clear", TypeError,
     "compile(loss=...) SparseCategoricalCrossentropy is a Keras 3 object"),
    ("compile a Keras 3 metric", lambda: _dm(
        metrics=[__import__("keras").metrics.SparseCategoricalAccuracy()]), "clear", TypeError,
     "compile(metrics=...) SparseCategoricalAccuracy is a Keras 3 object"),
    ("compile an optimizer bound to another mesh", lambda: _dm(
        optimizer=tf_keras.optimizers.Adam(mesh=dtk.build_mesh("batch=4,model=2"))), "clear",
     ValueError, "optimizer Adam is bound to another mesh (batch=4, model=2) than the model's "
                 "(batch=8); create it without mesh="),
    ("compile an optimizer that already stepped", lambda: _dm(optimizer=_stepped_adam()),
     "clear", ValueError, "optimizer (Adam) has already taken steps off the mesh"),
    ("compile metrics by name", lambda: _same_as_plain({"metrics": ["accuracy"]}), "accepted",
     None, True),
    ("compile a metric object", lambda: _same_as_plain(
        {"metrics": [tf_keras.metrics.SparseTopKCategoricalAccuracy(k=2)]}), "accepted", None,
     True),
    ("compile weighted_metrics", lambda: _same_as_plain(
        {"weighted_metrics": ["accuracy"]}, sample_weight=np.linspace(0.5, 1.5, 64)),
     "accepted", None, True),
    ("compile loss_weights", lambda: _same_as_plain({"loss_weights": [0.5]}), "accepted", None,
     True),
    ("compile steps_per_execution", lambda: _same_as_plain({"steps_per_execution": 2}),
     "accepted", None, True),
    ("compile a learning-rate schedule", lambda: _same_as_plain({
        "optimizer": lambda: tf_keras.optimizers.Adam(
            tf_keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5))}), "accepted", None,
     True),
    ("compile clipnorm", lambda: _same_as_plain({
        "optimizer": lambda: tf_keras.optimizers.SGD(0.5, clipnorm=0.01)}), "accepted", None,
     True),
    ("compile global_clipnorm", lambda: _same_as_plain({
        "optimizer": lambda: tf_keras.optimizers.SGD(0.5, global_clipnorm=0.01)}), "accepted",
     None, True),
    ("compile twice, the second optimizer trains", lambda: _compiled_twice(), "accepted", None,
     True),
    ("fit before compile", lambda: dtk.distribute(_small, _mesh()).fit(_DX, _DY, verbose=0),
     "clear", ValueError, "is not compiled; call model.compile(optimizer=..., loss=...)"),
    # fit()'s arguments
    ("fit batch_size the axis cannot divide", lambda: _dfit(batch_size=12), "refused",
     ValueError, "fit(batch_size=12): mesh axis 'batch' of size 8 cannot split it evenly"),
    ("fit batch_size a string", lambda: _dfit(batch_size="16"), "clear", TypeError,
     "fit(batch_size='16'): batch_size must be a positive integer"),
    ("fit batch_size 0", lambda: _dfit(batch_size=0), "clear", TypeError,
     "fit(batch_size=0): batch_size must be a positive integer"),
    ("fit batch_size None (Keras's 32)", lambda: _same_as_plain(batch_size=None), "accepted",
     None, True),
    ("fit epochs 0", lambda: _dfit(epochs=0), "clear", ValueError,
     "Expected epochs to be positive"),
    ("fit x and y of different lengths", lambda: _dfit(y=_DY[:60]), "clear", ValueError,
     "y has 60 examples; give every array the same number of examples"),
    ("fit a last partial batch (60 rows, batch 16)", lambda: _same_as_plain(
        x=_DX[:60], y=_DY[:60]), "accepted", None, True),
    ("fit fewer rows than one batch", lambda: _same_as_plain(x=_DX[:3], y=_DY[:3]), "accepted",
     None, True),
    ("fit a dataset batched by 30 (replicated batches)", lambda: _same_as_plain(
        x=DS.batch(30), y=None, batch_size=None), "accepted", None, True),
    ("fit a dataset batched by 16", lambda: _same_as_plain(x=DS.batch(16), y=None,
                                                            batch_size=None), "accepted", None,
     True),
    ("fit a repeated dataset with steps_per_epoch", lambda: _same_as_plain(
        x=DS.batch(16).repeat(), y=None, batch_size=None, steps_per_epoch=3, epochs=2),
     "accepted", None, True),
    ("fit an unbatched dataset", lambda: _dfit(x=DS, y=None, batch_size=None), "clear",
     ValueError, "the tf.data dataset is not batched"),
    ("fit validation_split", lambda: _same_as_plain(validation_split=0.25, epochs=2),
     "accepted", None, True),
    ("fit validation_split on a dataset", lambda: _dfit(x=DS.batch(16), y=None, batch_size=None,
                                                        validation_split=0.2), "clear",
     ValueError, "`validation_split` is only supported for Tensors or NumPy arrays"),
    ("fit validation_split 1.5", lambda: _dfit(validation_split=1.5), "clear", ValueError,
     "fit(validation_split=1.5): the fraction of the data held out must be in [0, 1)"),
    ("fit validation_data", lambda: _same_as_plain(validation_data=(_DX[:16], _DY[:16])),
     "accepted", None, True),
    ("fit validation_data of 3 rows", lambda: _same_as_plain(validation_data=(_DX[:3], _DY[:3])),
     "accepted", None, True),
    ("fit validation_freq", lambda: _same_as_plain(validation_data=(_DX[:16], _DY[:16]),
                                                   validation_freq=2, epochs=2), "accepted",
     None, True),
    ("fit class_weight", lambda: _same_as_plain(class_weight={0: 1.0, 1: 2.0, 2: 0.5}),
     "accepted", None, True),
    ("fit class_weight missing a class", lambda: _dfit(class_weight={0: 1.0, 1: 2.0}), "clear",
     ValueError, "fit(class_weight={0: 1.0, 1: 2.0}) has no weight for class(es) [2] found in y"),
    ("fit sample_weight", lambda: _same_as_plain(sample_weight=np.linspace(0.5, 1.5, 64)),
     "accepted", None, True),
    ("fit sample_weight of the wrong length", lambda: _dfit(sample_weight=np.ones(10)), "clear",
     ValueError, "sample_weight has 10 examples"),
    ("fit initial_epoch", lambda: _dfit(initial_epoch=2, epochs=3).epoch, "accepted", None, [2]),
    ("fit initial_epoch at epochs", lambda: _dfit(initial_epoch=3, epochs=3).epoch, "accepted",
     None, []),
    ("fit shuffle", lambda: len(_dfit(shuffle=True, epochs=2).history["loss"]), "accepted",
     None, 2),
    ("fit named inputs", lambda: _same_as_plain({"factory": _named},
                                                x={"a": _DX, "b": _DX[:, :2]}), "accepted",
     None, True),
    ("fit named inputs missing one", lambda: _dfit(_dm(_named), x={"a": _DX}), "clear",
     ValueError, "missing: ['b']"),
    ("fit string labels", lambda: _dfit(y=np.array([b"a", b"b"] * 32)), "clear", ValueError,
     "fit(y=...): labels are strings (e.g. b'a'), not class ids"),
    ("fit float labels with a sparse loss", lambda: _same_as_plain(y=_DY.astype(np.float32)),
     "accepted", None, True),
    ("fit verbose 2", lambda: _same_as_plain(verbose=2), "accepted", None, True),
    # callbacks
    ("fit a Keras 3 callback", lambda: _dfit(
        callbacks=[__import__("keras").callbacks.EarlyStopping()]), "clear", TypeError,
     "fit(callbacks=[...]) entry EarlyStopping is a Keras 3 object"),
    ("fit one callback, not a list", lambda: len(_dfit(
        callbacks=tf_keras.callbacks.TerminateOnNaN()).history["loss"]), "accepted", None, 1),
    ("fit EarlyStopping", lambda: _dfit(epochs=6, callbacks=[tf_keras.callbacks.EarlyStopping(
        monitor="loss", patience=1, min_delta=10)]).epoch, "accepted", None, [0, 1]),
    ("fit TerminateOnNaN", lambda: len(_dfit(x=np.full_like(_DX, np.nan), epochs=3, callbacks=[
        tf_keras.callbacks.TerminateOnNaN()]).history["loss"]), "accepted", None, 1),
    ("fit ModelCheckpoint of weights", lambda: _checkpoint_then_load(
        "w.h5", save_weights_only=True), "accepted", None, True),
    ("fit ModelCheckpoint of the model", lambda: _checkpoint_then_load("m.keras"), "accepted",
     None, True),
    ("fit ReduceLROnPlateau", lambda: _lr_after(tf_keras.callbacks.ReduceLROnPlateau(
        monitor="loss", patience=0, min_delta=10, factor=0.5), 3), "accepted", None,
     ([1e-3, 1e-3, 5e-4], 2.5e-4)),
    ("fit LearningRateScheduler", lambda: _lr_after(tf_keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: 0.01 / (epoch + 1)), 2), "accepted", None, ([0.01, 0.005], 0.005)),
    ("fit CSVLogger", lambda: _csv_rows(), "accepted", None, 3),
    ("fit TensorBoard scalars", lambda: _tensorboard_files(), "accepted", None, True),
    ("fit TensorBoard histograms", lambda: _dfit(callbacks=[tf_keras.callbacks.TensorBoard(
        _tmp("tb"), histogram_freq=1)]), "refused", ValueError,
     "TensorBoard's weight histograms and embeddings read the weights as one host tensor"),
    ("fit a callback that swaps the optimizer", lambda: _dfit(epochs=2, callbacks=[
        _SwapOptimizer()]), "refused", ValueError,
     "model.optimizer was replaced after the train step was compiled (by SGD, after Adam"),
    ("fit a LambdaCallback reading the batch logs", lambda: _batch_losses(), "accepted", None, 4),
    # evaluate, predict, the batch methods, saving
    ("evaluate batch_size the axis cannot divide", lambda: _dm().evaluate(
        _DX, _DY, batch_size=12, verbose=0), "refused", ValueError,
     "evaluate(batch_size=12): mesh axis 'batch' of size 8 cannot split it evenly"),
    ("evaluate before compile", lambda: dtk.distribute(_small, _mesh()).evaluate(
        _DX, _DY, verbose=0), "clear", ValueError, "evaluate: model"),
    ("evaluate 5 rows", lambda: _evaluate_like_plain(_DX[:5], _DY[:5]), "accepted", None, True),
    ("evaluate return_dict", lambda: sorted(_dm(metrics=["accuracy"]).evaluate(
        _DX, _DY, batch_size=16, verbose=0, return_dict=True)), "accepted", None,
     ["accuracy", "loss"]),
    ("predict batch_size the axis cannot divide", lambda: _dm().predict(
        _DX, batch_size=12, verbose=0), "refused", ValueError,
     "predict(batch_size=12): mesh axis 'batch' of size 8 cannot split it evenly"),
    ("predict before compile", lambda: dtk.distribute(_small, _mesh()).predict(
        _DX, verbose=0).shape, "accepted", None, (64, 3)),
    ("predict 5 rows", lambda: _dm().predict(_DX[:5], verbose=0).shape, "accepted", None,
     (5, 3)),
    ("predict the wrong feature size", lambda: _dm().predict(np.zeros((16, 5), np.float32),
                                                             verbose=0), "clear", ValueError,
     "predict(x=...): one example's features have shape (5,), but model"),
    ("predict_on_batch", lambda: _dm().predict_on_batch(_DX[:16]).shape, "accepted", None,
     (16, 3)),
    ("train_on_batch of 12 rows", lambda: np.isfinite(_dm().train_on_batch(_DX[:12], _DY[:12])),
     "accepted", None, True),
    ("test_on_batch", lambda: np.isfinite(_dm().test_on_batch(_DX[:16], _DY[:16])), "accepted",
     None, True),
    ("save .keras, loaded by plain tf_keras", lambda: _saved_loads_in_plain_keras("s.keras"),
     "accepted", None, True),
    ("save .h5, loaded by plain tf_keras", lambda: _saved_loads_in_plain_keras("s.h5"),
     "accepted", None, True),
    ("load_weights of a missing file", lambda: _dm().load_weights(_tmp("nope.h5")), "clear",
     (FileNotFoundError, OSError), "nope.h5"),
]


def _dm_sub():
    model = dtk.distribute(_Sub, _mesh(), input_shape=(4,), seed=0)
    model.compile(optimizer="adam", loss=_SCE)
    return model


def _stepped_adam():
    optimizer = tf_keras.optimizers.Adam()
    variable = tf.Variable([1.0])
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    return optimizer


def _compiled_twice():
    model = _dm()
    model.compile(optimizer=tf_keras.optimizers.SGD(0.5), loss=_SCE)
    ours = _dfit(model).history["loss"]
    plain = _plain(optimizer=tf_keras.optimizers.SGD(0.5))
    np.testing.assert_allclose(ours, _dfit(plain).history["loss"], rtol=1e-5)
    return isinstance(model.optimizer, tf_keras.optimizers.SGD)


def _csv_rows():
    path = _tmp("log.csv")
    _dfit(epochs=2, callbacks=[tf_keras.callbacks.CSVLogger(path)])
    return len(open(path, encoding="utf-8").read().strip().splitlines())


def _tensorboard_files():
    path = _tmp("tb")
    _dfit(callbacks=[tf_keras.callbacks.TensorBoard(path)])
    return any(files for _, _, files in os.walk(path))


def _batch_losses():
    seen = []
    _dfit(callbacks=[tf_keras.callbacks.LambdaCallback(
        on_batch_end=lambda batch, logs: seen.append(logs["loss"]))])
    return len(seen)


def _evaluate_like_plain(x, y):
    np.testing.assert_allclose(_dm().evaluate(x, y, verbose=0), _plain().evaluate(x, y, verbose=0),
                               rtol=1e-5)
    return True


@pytest.mark.parametrize("call, outcome, error, expected", [c[1:] for c in DISTRIBUTE_CASES],
                         ids=[c[0] for c in DISTRIBUTE_CASES])
def test_distribute_inputs(call, outcome, error, expected):
    assert outcome in ("clear", "refused", "accepted")
    if outcome == "accepted":
        result = call()
        if isinstance(expected, tuple) and expected and isinstance(expected[0], list):
            np.testing.assert_allclose(result[0], expected[0], rtol=1e-6)
            np.testing.assert_allclose(result[1], expected[1], rtol=1e-6)
        else:
            assert result == expected, result
        return
    with pytest.raises(error) as info:
        call()
    assert expected in str(info.value), str(info.value)[:2000]
