"""dtk on Ray: the DTensor backend's addresses, 2 Ray Train workers = 1 process, restart after a
lost node from Ray's checkpoint on the workers left, a Tune search."""

import concurrent.futures
import json
import os
import textwrap

import numpy as np
import pytest

from tests import procs

ray = pytest.importorskip("ray", reason="the Ray backend is optional: pip install 'ray[train,tune]' (dtk's ray extra)")
dtk_ray = pytest.importorskip(
    "dtk.cluster.ray", reason="the Ray backend is optional (needs ray): pip install 'ray[train,tune]' (dtk's ray extra)")

# One training function for the single process and for every Ray worker: 3 epochs of 4 steps.
TRAIN = textwrap.dedent("""
    def train(checkpoint_dir=None, kill_at_step=None, marker=None, report=False, mesh="batch=8"):
        import json, os, signal, time
        import numpy as np, tensorflow as tf, dtk
        from dtk.data import input as input_lib
        mesh = dtk.build_mesh(mesh, device_type="cpu")
        rng = np.random.default_rng(0)
        data = tf.data.Dataset.from_tensor_slices(
            (rng.random((256, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 256).astype(np.int64)))
        train_data = input_lib.DistributedDataset(data, mesh, input_lib.InputConfig(
            global_batch_size=64, shuffle=True, seed=1))
        on_epoch_end, on_step_end = [], []
        if report:
            import dtk.cluster.ray
            dtk.cluster.ray.restore_from_ray(checkpoint_dir)
            on_epoch_end.append(dtk.cluster.ray.ReportCallback(checkpoint_dir))
        if kill_at_step is not None and dtk.cluster.env.client_id() == 1 and not os.path.exists(marker):
            def kill(step):
                if step >= kill_at_step:
                    import ray  # the marker names this worker's node (the elastic test removes it)
                    with open(marker, "w") as f:
                        f.write(ray.get_runtime_context().get_node_id())
                    time.sleep(4)  # Ray registers a report at its next health check (every 2 s)
                    os.kill(os.getpid(), signal.SIGKILL)
            on_step_end.append(kill)
        trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp,
                              optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3),
                              config=dtk.TrainerConfig(seed=0, verbose=0, checkpoint_dir=checkpoint_dir))
        return trainer.fit(train_data, epochs=3, on_epoch_end=on_epoch_end,
                           on_step_end=on_step_end).history["loss"]
""")

def _train_here():
    """TRAIN's losses in this test process (8 virtual CPUs): the same code the workers run, and no
    second start-up."""
    namespace = {}
    exec(TRAIN, namespace)  # pylint: disable=exec-used
    return namespace["train"]()


# A lost machine: three Ray nodes on this host (a head and two worker nodes of one "dtk" slot
# each). Client 1's node is removed at step 6; Ray's elastic ScalingConfig restarts the group on
# the one node left, and the flexible mesh batch=-1 spans its 4 devices.
ELASTIC = TRAIN + textwrap.dedent("""
    import json, os, sys, threading, time
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nodes on 127.0.0.1, not the host's IP
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    import dtk.cluster.env
    import dtk.cluster.ray
    out = sys.argv[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1, resources={"dtk": 1}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    marker = os.path.join(out, "killed")

    def remove_killed_node():
        while not (os.path.exists(marker) and open(marker).read()):
            time.sleep(0.2)
        node_id = open(marker).read().strip()
        cluster.remove_node(next(n for n in nodes if n.node_id == node_id), allow_graceful=False)

    threading.Thread(target=remove_killed_node, daemon=True).start()

    def loop(config):
        # (Ray Train 2.x hands a group restarted at a smaller size no checkpoint: measured,
        # get_checkpoint() is None there. It resumes from dtk's own directory, on storage every
        # worker sees; restore_from_ray's copy is test_restore_from_ray_copies_its_latest_checkpoint.)
        losses = train(checkpoint_dir=config["ckpt"], kill_at_step=6, marker=marker, report=True,
                       mesh="batch=-1")
        if dtk.cluster.env.client_id() == 0:
            with open(os.path.join(out, "elastic.json"), "w") as f:
                json.dump({"losses": losses, "clients": dtk.cluster.env.num_clients()}, f)

    result = dtk.cluster.ray.DTensorTrainer(
        loop, train_loop_config={"ckpt": os.path.join(out, "ckpt")},
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1, "dtk": 1}),
        run_config=RunConfig(name="elastic", storage_path=os.path.join(out, "ray"),
                             failure_config=FailureConfig(max_failures=2)),
        devices_per_worker=4, heartbeat_timeout_s=10).fit()
    print("RESULT", json.dumps({"error": repr(result.error), "epoch": result.metrics.get("epoch"),
                                "checkpoint": bool(result.checkpoint)}))
    ray.shutdown()
    cluster.shutdown()
""")


@pytest.mark.slow
@pytest.mark.zoo  # three Ray nodes and two groups (about 2 minutes)
def test_ray_train_workers_match_one_process_and_restart_on_the_workers_left(tmp_path):
    """2 Ray Train workers x 4 virtual CPUs train like one process of 8 until client 1's node is
    lost at step 6; ScalingConfig(num_workers=(1, 2)) then restarts the group on 1 worker (4
    virtual CPUs instead of 8), which restores the newest checkpoint into that mesh and keeps the
    global batch, data order and step count: the losses equal the uninterrupted single process's.
    (One Ray run covers the kill, the restart and the elastic mesh: a second run, killed and
    restarted on two workers, took 115-125 s of the suite.)"""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Ray starts while this process trains
        ray_run = pool.submit(
            procs.run_python, ELASTIC, args=(str(tmp_path),), timeout=420,
            env=procs.base_env(RAY_TRAIN_V2_ENABLED="1",
                               # Ray first retries the lost size until this passes ...
                               RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="20",
                               # ... unless its control store knows the node is dead: health
                               # checks every 0.5 s, dead after 3 failures (Ray's defaults: 3 s
                               # and 5; 86 -> 59 s for this test)
                               RAY_health_check_period_ms="500",
                               RAY_health_check_failure_threshold="3"))
        single = _train_here()  # batch=8 in this test process
        res = ray_run.result()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    # (Ray may log the removed node's raylet to stdout after it.)
    assert json.loads(res.stdout.split("RESULT")[1].splitlines()[0]) == {
        "error": "None", "epoch": 3, "checkpoint": True}
    got = json.loads((tmp_path / "elastic.json").read_text())
    assert got["clients"] == 1, "the group did not restart on the one node left"
    np.testing.assert_allclose(got["losses"], single, rtol=1e-5)
    assert (tmp_path / "killed").exists(), "client 1 was never killed"


# -- the backend's environment, without a cluster --------------------------------------------------
def _address(host, port, gpus=0, tf_initialized=False):
    return {"host": host, "port": port, "pid": 1, "gpus": gpus, "tf_initialized": tf_initialized}


def test_each_worker_gets_its_own_nodes_address_in_rank_order():
    envs = dtk_ray.worker_envs([_address("127.0.0.1", 5000), _address("127.0.0.2", 5001)],
                               dtk_ray.DTensorConfig(devices_per_worker=4, heartbeat_timeout_s=7))
    assert [e["DTENSOR_JOBS"] for e in envs] == ["127.0.0.1:5000,127.0.0.2:5001"] * 2
    assert [e["DTENSOR_CLIENT_ID"] for e in envs] == ["0", "1"]
    assert all(e["DTK_VIRTUAL_DEVICES"] == "4" and e["DTK_HEARTBEAT_TIMEOUT_S"] == "7" for e in envs)
    assert "DTENSOR_GPU_USE_NCCL_COMMUNICATION" not in envs[0]


def test_gpu_workers_use_nccl_and_no_virtual_devices(monkeypatch):
    monkeypatch.delenv("DTENSOR_GPU_USE_NCCL_COMMUNICATION", raising=False)
    envs = dtk_ray.worker_envs([_address("10.0.0.1", 5000, gpus=1), _address("10.0.0.2", 5000, gpus=1)],
                               dtk_ray.DTensorConfig(devices_per_worker=4))
    assert all(e["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "1" for e in envs)
    assert not any("DTK_VIRTUAL_DEVICES" in e for e in envs)
    assert envs[1]["DTENSOR_JOBS"] == "10.0.0.1:5000,10.0.0.2:5000"


@pytest.mark.parametrize("addresses, match", [
    ([_address("127.0.0.1", 5000), _address("127.0.0.1", 5001, tf_initialized=True)],
     "worker 1 .* already initialized TensorFlow"),
    ([_address("127.0.0.1", 5000), _address("127.0.0.1", 5000)], "same address"),
])
def test_backend_refuses_bad_workers(addresses, match):
    with pytest.raises(RuntimeError, match=match):
        dtk_ray.worker_envs(addresses, dtk_ray.DTensorConfig())


def test_backend_sets_every_workers_environment(monkeypatch):
    """on_start with a fake worker group: addresses gathered once, one environment per rank."""
    calls = []

    class Group:
        def execute(self, fn):
            assert fn is dtk_ray._reserve_address  # pylint: disable=protected-access
            return [_address("127.0.0.1", 5000), _address("127.0.0.2", 5001)]

        def execute_single_async(self, rank, fn, env, verbose):
            assert fn is dtk_ray._set_env and verbose is False  # pylint: disable=protected-access
            calls.append((rank, env["DTENSOR_CLIENT_ID"], env["DTENSOR_JOBS"]))
            return rank

    monkeypatch.setattr(dtk_ray.ray, "get", lambda refs: refs)
    dtk_ray._DTensorBackend().on_start(Group(), dtk_ray.DTensorConfig())  # pylint: disable=protected-access
    assert calls == [(0, "0", "127.0.0.1:5000,127.0.0.2:5001"), (1, "1", "127.0.0.1:5000,127.0.0.2:5001")]


@pytest.mark.parametrize("kwargs, match", [
    ({"devices_per_worker": 0}, "devices_per_worker must be a positive integer"),
    ({"start_timeout_s": 0}, "start_timeout_s must be positive"),
    ({"heartbeat_timeout_s": float("nan")}, "heartbeat_timeout_s must be positive"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dtk_ray.DTensorConfig(**kwargs)


def test_ray_checkpoint_staging_holds_the_latest_only(tmp_path):
    for step in (4, 8):
        for suffix in (".index", ".data-00000-of-00001"):
            (tmp_path / f"ckpt-{step}{suffix}").write_text("x")
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-8"\n'
                                         'all_model_checkpoint_paths: "ckpt-4"\n'
                                         'all_model_checkpoint_paths: "ckpt-8"\n')
    stage = dtk_ray._stage_latest(str(tmp_path))  # pylint: disable=protected-access
    assert sorted(os.listdir(stage)) == ["checkpoint", "ckpt-8.data-00000-of-00001", "ckpt-8.index"]
    assert dtk_ray._latest_step(stage) == 8  # pylint: disable=protected-access


def test_restore_from_ray_copies_its_latest_checkpoint(tmp_path, monkeypatch):
    """A restarted worker's fresh directory gets Ray's latest checkpoint (files, then the state
    file naming it); a directory that already holds it or a newer one is left alone."""
    reported = tmp_path / "reported"
    reported.mkdir()
    for suffix in (".index", ".data-00000-of-00001"):
        (reported / f"ckpt-8{suffix}").write_text("8")
    (reported / "checkpoint").write_text('model_checkpoint_path: "ckpt-8"\n')
    monkeypatch.setattr(ray.train, "get_checkpoint",
                        lambda: ray.train.Checkpoint.from_directory(str(reported)))
    fresh = tmp_path / "fresh"
    assert dtk_ray.restore_from_ray(str(fresh)) == 8
    assert sorted(os.listdir(fresh)) == ["checkpoint", "ckpt-8.data-00000-of-00001", "ckpt-8.index"]
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "checkpoint").write_text('model_checkpoint_path: "ckpt-12"\n')
    assert dtk_ray.restore_from_ray(str(newer)) == 8
    assert sorted(os.listdir(newer)) == ["checkpoint"]
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    assert dtk_ray.restore_from_ray(str(tmp_path / "first")) is None


@pytest.mark.slow
@pytest.mark.zoo  # 85-128 s, the longest test: the release lane (Ray Train runs every time)
def test_tune_search_over_two_worker_trials(tmp_path):
    """2 trials x 2 Ray Train workers under ASHA: every epoch reported, no placement group left."""
    summary = tmp_path / "tune.json"
    res = procs.run_python(
        "import runpy, sys; sys.argv = ['tune_mnist.py', *sys.argv[1:]]; "
        "runpy.run_path('scripts/tune_mnist.py', run_name='__main__')",
        args=("--trials", "2", "--epochs", "2", "--workers", "2", "--mesh", "batch=8",
              "--dataset", "sample", "--validation_examples", "500",
              "--storage_path", str(tmp_path / "ray"), "--summary_json", str(summary)),
        timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(summary.read_text())
    trials = result["trials"]
    assert len(trials) == 2 and not any(t["error"] for t in trials), trials
    # ASHA (grace period 1) stops one trial after epoch 1 at the latest; each report is an epoch.
    assert sorted(t["epochs"] for t in trials) in ([1, 2], [2, 2]), trials
    assert all(t["reports"] == t["epochs"] for t in trials), trials
    assert result["placement_groups_left"] == 0
    assert 0.5 < result["best"]["test_accuracy"] <= 1.0
