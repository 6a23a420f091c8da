"""Issue 61: pipeline parallelism. Stages on sub-meshes of a ``stage`` axis, microbatches in a
GPipe or 1F1B schedule, each stage its own compiled forward and backward: one device's losses
with dropout, on every mesh and schedule."""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk
from dtk import models
from dtk.data import input as input_lib
from dtk.parallel import layouts, pipeline
from dtk.train import pipeline as pipeline_steps

SEQ, B, N = 16, 16, 10
LM = functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8, layers=2,
                       dropout=0.1)


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 64, (N, B, SEQ)).astype(np.int32),
            rng.integers(0, 64, (N, B, SEQ)).astype(np.int64))


def _adam(mesh):
    return tf_keras.optimizers.Adam(3e-3, mesh=mesh)


@functools.lru_cache(maxsize=None)
def _one_device():
    mesh = dtk.build_mesh("batch=1")
    model, _ = layouts.build_model(LM, mesh, "transformer_lm", seed=7)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                      optimizer=_adam(mesh), config=dtk.StepConfig(shard_optimizer_state=False))
    x, y = _data()
    return np.array([float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(B, np.float32)))))
                     for i in range(N)])


def _pipelined(spec, schedule, microbatches=4, factory=LM, table="transformer_lm", **kwargs):
    config = pipeline.PipelineConfig(microbatches=microbatches, schedule=schedule, **kwargs)
    pipe = pipeline.build(factory, dtk.build_mesh(spec), table, seed=7, config=config)
    return pipe, pipeline_steps.PipelineSteps(pipe, loss="sparse_categorical_crossentropy",
                                              optimizer=_adam, config=config)


@pytest.mark.parametrize("spec, schedule", [
    pytest.param("stage=2,batch=4", "1f1b", marks=pytest.mark.slow),
    pytest.param("stage=2,batch=4", "gpipe", marks=pytest.mark.slow),
    pytest.param("stage=2,batch=2,model=2", "1f1b", marks=pytest.mark.slow),
    pytest.param("stage=2,batch=2,model=2", "gpipe", marks=pytest.mark.slow),
    pytest.param("stage=4,batch=2", "1f1b", marks=pytest.mark.slow),
    pytest.param("stage=4,batch=2", "gpipe", marks=pytest.mark.slow),
])
def test_the_pipelined_lm_trains_like_one_device(spec, schedule):
    """10 steps of the LM with dropout 0.1, 4 microbatches: batch=1's losses at 1e-5. Each stage
    holds its own layers' weights only, on its own devices."""
    pipe, steps = _pipelined(spec, schedule)
    x, y = _data()
    losses = np.array([steps.train(x[i], y[i]) for i in range(N)])
    np.testing.assert_allclose(losses, _one_device(), rtol=1e-5)
    whole = {p for p, _ in layouts.weight_paths(LM())}
    held = [{p for p, _ in layouts.weight_paths(m)} for m in pipe.models]
    assert sum(len(h) for h in held) == len(whole) and set().union(*held) == whole
    devices = [set(mesh.local_devices()) for mesh in pipe.meshes]
    assert all(not (a & b) for i, a in enumerate(devices) for b in devices[i + 1:])
    for mesh, model in zip(pipe.meshes, pipe.models):
        assert all(dtensor.fetch_layout(v).mesh == mesh for v in model.trainable_variables)
    assert steps.iterations == N
    if "model" in spec:  # issue 70: the logits of a stage with a model axis, gathered whole
        got = steps.predict_value(x[0])
        assert got.shape == (B, *pipe.models[-1].output_shape[1:]) and np.isfinite(got).all()


def test_a_sequential_model_is_cut_between_its_layers():
    """Any Sequential model's top-level layers are units: the MNIST MLP with dropout on
    stage=2,batch=4, 2 microbatches, equals batch=1 through dtk.Steps."""
    factory = functools.partial(models.mnist_mlp, dropout=0.2)
    rng = np.random.default_rng(1)
    x = rng.random((3, 16, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, (3, 16)).astype(np.int64)
    mesh = dtk.build_mesh("batch=1")
    model, _ = layouts.build_model(factory, mesh, "data_parallel", seed=7)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                      optimizer=_adam(mesh), config=dtk.StepConfig(shard_optimizer_state=False))
    want = [float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(16, np.float32)))))
            for i in range(3)]
    pipe, piped = _pipelined("stage=2,batch=4", "1f1b", 2, factory=factory,
                             table="data_parallel")
    units, _ = pipeline.cuts(factory())
    assert len(pipe.units[0]) + len(pipe.units[1]) == len(units)
    np.testing.assert_allclose([piped.train(x[i], y[i]) for i in range(3)], want, rtol=1e-5)


def test_the_lm_is_cut_between_its_blocks():
    """The LM's units: its top-level layers and its blocks (the residual + inside a block
    belongs to it); stages are balanced by cost, or start where the user says."""
    units, between = pipeline.cuts(LM())
    names = [u.name for u in units]
    assert names == ["embed", "pos", "seq_in", "drop_in", "block0", "block1", "ln_f", "head"]
    assert all(t is not None for t in between)  # one tensor crosses between any two
    assert pipeline.split(LM(), 2) == [(0, 4), (5, 7)]
    assert pipeline.split(LM(), 2, ["block1_ln1"]) == [(0, 4), (5, 7)]
    assert pipeline.split(LM(), 2, ["ln_f"]) == [(0, 5), (6, 7)]
    deep = functools.partial(models.transformer_lm, vocab=64, seq_len=SEQ, dim=32, heads=8,
                             layers=8)
    stages = pipeline.split(deep(), 4)
    units, _ = pipeline.cuts(deep())
    blocks = [sum(units[i].name.startswith("block") for i in range(a, b + 1)) for a, b in stages]
    assert blocks == [2, 2, 2, 2], (stages, blocks)


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_schedules_run_every_op_once_after_what_it_needs(stages, microbatches):
    """GPipe and 1F1B: every forward and backward of every stage and microbatch once, each
    after its inputs; 1F1B keeps at most S - s microbatches in flight on stage s (GPipe: M)."""
    for schedule in pipeline.SCHEDULES:
        order = pipeline.dispatch_order(schedule, stages, microbatches)
        want = {(k, s, j) for k in "FB" for s in range(stages) for j in range(microbatches)}
        assert len(order) == len(want) and set(order) == want
        seen = set()
        for kind, s, j in order:
            need = ("F", s - 1, j) if kind == "F" and s else ("B", s + 1, j) \
                if kind == "B" and s < stages - 1 else ("F", s, j) if kind == "B" else None
            assert need is None or need in seen, (schedule, kind, s, j)
            seen.add((kind, s, j))
        for s in range(stages):
            live = peak = 0
            for kind, _ in pipeline.stage_order(schedule, stages, microbatches, s):
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == (min(stages - s, microbatches) if schedule == "1f1b" else microbatches)
    assert pipeline.bubble(stages, microbatches) == (stages - 1) / (microbatches + stages - 1)


@pytest.mark.parametrize("make, message", [
    (lambda: pipeline.split(LM(), 9), "9 pipeline stages for model 'transformer_lm', which can be "
                                      "cut in 8 parts at most"),
    (lambda: pipeline.split(LM(), 2, ["block1_attn"]), "pipeline boundary 'block1_attn': more "
                                                       "than one tensor crosses there"),
    (lambda: pipeline.split(LM(), 2, ["nope"]), "pipeline boundary 'nope' is no layer"),
    (lambda: pipeline.split(LM(), 3, ["block1_ln1"]), "3 stages need 2"),
    (lambda: pipeline.split(LM(), 3, ["ln_f", "block1_ln1"]), "must be in model order"),
    (lambda: pipeline.PipelineConfig(microbatches=0), "microbatches must be a positive integer"),
    (lambda: pipeline.PipelineConfig(schedule="zigzag"),
     "schedule 'zigzag' is not a schedule dtk knows; use one of gpipe, 1f1b"),
    (lambda: pipeline.stage_meshes(dtk.build_mesh("batch=8")), "has no 'stage' axis"),
])
def test_bad_pipelines_are_one_value_error(make, message):
    with pytest.raises(ValueError, match=None) as e:
        make()
    assert message in str(e.value)


def test_a_subclassed_model_has_no_boundary_dtk_can_find():
    class Net(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = tf_keras.layers.Dense(4), tf_keras.layers.Dense(2)

        def call(self, x):
            return self.b(self.a(x))

    net = Net()
    net(tf.zeros([1, 3]))
    with pytest.raises(ValueError, match="is a subclassed model: dtk finds pipeline stages"):
        pipeline.split(net, 2)


def test_a_batch_the_microbatches_do_not_divide_is_named():
    _, steps = _pipelined("stage=2,batch=4", "1f1b", 4)
    x, y = _data()
    with pytest.raises(ValueError, match=r"global batch 8 is not divisible by microbatches 4 x "
                                         r"mesh axis 'batch' of size 4"):
        steps.train(x[0][:8], y[0][:8])


@pytest.mark.slow
def test_train_lm_in_stages_trains_like_the_trainer_on_batch_8_and_resumes_on_any_mesh(tmp_path):
    """``train_lm.py --mesh stage=2,batch=4 --microbatches 4`` (AdamW clipped to a global norm
    of 1, dropout 0.1): 3 steps give the train loss and held-out bits per byte of ``--mesh
    batch=8``'s Trainer run at step 3 (1e-5). Its checkpoint (``--checkpoint_dir``) is the
    Trainer's: resumed to step 6 on ``batch=8`` (the Trainer) and in 4 stages, each gives the
    uninterrupted ``batch=8`` run's losses, held-out bits per byte (1e-5) and sample, and the
    stages' ``--export_dir`` holds the plain tf_keras model with the Trainer's export's
    weights (and ``--tensorboard_dir`` the epoch's losses). The same pipeline on 2 clients x 4
    devices (stage 0 on client 0's devices, stage 1 on client 1's: every activation and gradient
    crosses between the processes) gives the one process's numbers bit for bit."""
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import json  # pylint: disable=import-outside-toplevel
    import shutil  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    from tests import procs  # pylint: disable=import-outside-toplevel
    common = ["--eval_every", "3", "--eval_batches", "2", "--global_batch_size", "16",
              "--seq_len", "32", "--dim", "32", "--heads", "4", "--sample_bytes", "8",
              "--dropout", "0.1"]
    launch = [sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2",
              "--devices_per_client", "4", "--"]
    stages = ["--mesh", "stage=2,batch=4", "--microbatches", "4"]
    ckpt = tmp_path / "stages_ckpt"

    def run(name, *args, prefix=()):
        summary = tmp_path / f"{name}.json"
        res = subprocess.run([*prefix, sys.executable, str(procs.REPO / "scripts" / "train_lm.py"),
                              *common, *args, "--summary_json", str(summary)],
                             capture_output=True, text=True, timeout=300, cwd=procs.REPO,
                             env=procs.base_env())
        assert res.returncode == 0, name + res.stdout[-3000:] + res.stderr[-3000:]
        return json.loads(summary.read_text()), res

    # at most two single-process runs at once (4 TensorFlow processes with the test workers)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        straight = pool.submit(run, "batch8", "--steps", "6", "--mesh", "batch=8")
        first, _ = run("stages", "--steps", "3", *stages, "--checkpoint_dir", str(ckpt),
                       "--tensorboard_dir", str(tmp_path / "tb"))
        batch8, _ = straight.result()
    for copy in ("to_batch8", "to_stage4"):
        shutil.copytree(ckpt, tmp_path / copy)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        on_batch8 = pool.submit(run, "to_batch8", "--steps", "6", "--mesh", "batch=8",
                                "--checkpoint_dir", str(tmp_path / "to_batch8"),
                                "--export_dir", str(tmp_path / "export8"))
        in_four, _ = run("to_stage4", "--steps", "6", "--mesh", "stage=4,batch=2",
                         "--microbatches", "2", "--checkpoint_dir", str(tmp_path / "to_stage4"),
                         "--export_dir", str(tmp_path / "export4"))
        on_batch8, res = on_batch8.result()
    two, _ = run("two_clients", "--steps", "3", *stages, prefix=launch)

    assert first["pipeline"]["stages"] == 2 and first["pipeline"]["microbatches"] == 4
    logged = {}  # TensorBoard: the epoch's loss and held-out loss, as the Trainer logs them
    for events in (tmp_path / "tb").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                logged[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    assert logged[("loss", 1)] == pytest.approx(first["train_loss"][0], rel=1e-6), logged
    assert ("val_loss", 1) in logged, logged
    np.testing.assert_allclose(first["train_loss"], batch8["train_loss"][:1], rtol=1e-5)
    np.testing.assert_allclose(first["heldout_bits_per_byte"],
                               batch8["heldout_curve"][0]["heldout_bits_per_byte"], rtol=1e-5)
    said = res.stdout + res.stderr
    assert "resumes exactly across meshes" in said and "Resumed from" in said, said[-3000:]
    for name, resumed in (("batch=8", on_batch8), ("stage=4,batch=2", in_four)):
        assert resumed["steps"] == 6 and resumed["resume_changes"] == {}, name
        np.testing.assert_allclose(resumed["train_loss"], batch8["train_loss"], rtol=1e-5,
                                   err_msg=name)
        np.testing.assert_allclose(resumed["heldout_bits_per_byte"],
                                   batch8["heldout_bits_per_byte"], rtol=1e-5, err_msg=name)
        assert resumed["sample"] == batch8["sample"], name
    assert two["num_clients"] == 2
    for key in ("train_loss", "heldout_bits_per_byte", "sample"):
        assert two[key] == first[key], key
    # the stages export the whole model as plain tf_keras: the Trainer's export's weights
    staged = tf_keras.models.load_model(in_four["export"]["keras"], compile=False)
    whole = tf_keras.models.load_model(on_batch8["export"]["keras"], compile=False)
    assert len(staged.weights) == len(whole.weights) > 30
    for a, b in zip(staged.weights, whole.weights):
        # (measured: 7.4e-8 at most; atol for weights near zero)
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)



def _restored(spec, directory, *, stages: bool):
    """A fresh run on ``spec`` (in stages, or the whole model), restored from ``directory``:
    ``(train a batch -> loss, model, optimizer, the loop state)``; ``model`` and ``optimizer``
    are the stages' ``checkpoint_objects``."""
    from dtk.train import checkpoint  # pylint: disable=import-outside-toplevel
    if stages:
        _, steps = _pipelined(spec, "1f1b")
        model, opt = steps.checkpoint_objects()
        train = steps.train
    else:
        mesh = dtk.build_mesh(spec)
        model, _ = layouts.build_model(LM, mesh, "transformer_lm", seed=7)
        opt = _adam(mesh)
        one = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh, optimizer=opt,
                        config=dtk.StepConfig(shard_optimizer_state=False))
        opt = one.optimizer  # (the one Keras's compiled step updates)

        def train(x, y):
            return float(one.train(input_lib.pack(mesh, (x, y, np.ones(len(x), np.float32)))))
    state = checkpoint.Checkpointer(str(directory), model=model, optimizer=opt, lock=False,
                                    host_write=stages).restore()
    if stages:
        steps.restored()
    return train, model, opt, state


def _values(model, opt) -> dict:
    """Every variable of ``tf.train.Checkpoint(model, optimizer)`` by its checkpoint key."""
    from dtk.train import checkpoint  # pylint: disable=import-outside-toplevel
    out, seen = {}, set()
    # Breadth first, as TensorFlow's checkpoint names a variable: by its shortest path (a
    # compiled model's optimizer is reached as "optimizer/...", not "model/optimizer/...").
    queue = [(tf.train.Checkpoint(model=model, optimizer=opt), "")]
    while queue:
        obj, prefix = queue.pop(0)
        for name, child in tf.train.TrackableView(obj).children(obj).items():
            if isinstance(child, tf.Variable):
                out.setdefault(id(child), (f"{prefix}{name}", child))
            elif id(child) not in seen:
                seen.add(id(child))
                queue.append((child, f"{prefix}{name}/"))
    return {key: checkpoint.global_value(v) for key, v in out.values()}


def _save(directory, model, opt, step) -> dict:
    from dtk.train import checkpoint  # pylint: disable=import-outside-toplevel
    checkpoint.Checkpointer(str(directory), model=model, optimizer=opt, lock=False,
                            host_write=True).save(
        {"epoch": 0, "batch_in_epoch": step}, step=step)
    return _values(model, opt)


@pytest.mark.slow
def test_a_checkpoint_of_stages_resumes_on_any_mesh_with_or_without_stages(tmp_path):
    """A checkpoint of the LM trained in 2 stages (dropout 0.1, Adam) is the checkpoint of the
    whole model: it restores, bit for bit, into the whole model on ``batch=8`` and into 4
    stages, and each goes on with one device's losses (1e-5); the whole model's checkpoint
    restores into 2 stages bit for bit and goes on likewise."""
    x, y = _data()
    want = _one_device()
    _, steps = _pipelined("stage=2,batch=4", "1f1b")
    for i in range(3):
        steps.train(x[i], y[i])
    saved = _save(tmp_path / "stages", *steps.checkpoint_objects(), 3)
    keys = {name for name, _ in tf.train.list_variables(str(tmp_path / "stages" / "ckpt-3"))}
    assert "model/layer_with_weights-0/embeddings/.ATTRIBUTES/VARIABLE_VALUE" in keys
    # every weight, Adam's m and v of each trainable one, the step and the learning rate
    assert len(saved) == len(LM().weights) + 2 * len(LM().trainable_weights) + 2
    for spec, stages, where, begin in (("stage=4,batch=2", True, "stages", 3),
                                       ("batch=8", False, "stages", 3),
                                       ("stage=2,batch=4", True, "whole", 5)):
        train, model, opt, state = _restored(spec, tmp_path / where, stages=stages)
        restored = _values(model, opt)
        assert state["batch_in_epoch"] == begin and set(restored) == set(saved), spec
        for key, value in saved.items():
            np.testing.assert_array_equal(restored[key], value, err_msg=f"{spec}: {key}")
        losses = [train(x[i], y[i]) for i in range(begin, begin + 2)]
        np.testing.assert_allclose(losses, want[begin:begin + 2], rtol=1e-5, err_msg=spec)
        if spec == "batch=8":  # the whole model's checkpoint, for the stages
            saved = _save(tmp_path / "whole", model, opt, 5)


def test_a_rule_another_stage_uses_is_no_warning():
    """Issue 70: ``train_lm.py --mesh stage=2,batch=4`` printed "WARNING: 2 rule(s) matched
    nothing" for each stage (the head's rules on the first, the embeddings' on the last). A
    rule no stage uses is still one."""
    pipe = pipeline.build(LM, dtk.build_mesh("stage=2,batch=4"), "transformer_lm", seed=7)
    for plan in pipe.plans:
        assert plan.unused_rules == ()
        assert "WARNING" not in layouts.explain(plan).splitlines()[-1]
    assert any("['head\\\\.bias', 'head\\\\.kernel'] match weights of other stages" in w
               for w in pipe.plans[0].warnings), pipe.plans[0].warnings
    table = layouts.load_table("transformer_lm")
    extra = dataclasses.replace(table, rules=table.rules + (
        layouts.LayoutRule(pattern="nothing", dims=(None,)),))
    pipe = pipeline.build(LM, dtk.build_mesh("stage=2,batch=4"), extra, seed=7)
    assert all([r.pattern for r in p.unused_rules] == ["nothing"] for p in pipe.plans)
