"""Scheduler bridges (TF_CONFIG, Slurm) and the coordination-service timeouts."""

import json
import textwrap
import time

import pytest
from tensorflow.python.eager import context

import dtk
from dtk.cluster import env as cluster
from dtk.parallel import mesh as mesh_lib
from tests import procs


@pytest.mark.parametrize("hostlist, hosts", [
    ("node1", ["node1"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[8-10]b,c", ["a8b", "a9b", "a10b", "c"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert cluster.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[1-", "node[3-1]", "node[a-b]"])
def test_expand_hostlist_errors(hostlist):
    with pytest.raises(ValueError, match="Slurm host list"):
        cluster.expand_hostlist(hostlist)


def test_tf_config_chief_and_workers():
    config = {"cluster": {"chief": ["c:1"], "worker": ["w0:2", "w1:3"]},
              "task": {"type": "worker", "index": 1}}
    assert cluster.env_from_tf_config(json.dumps(config)) == {
        "DTENSOR_JOBS": "c:1,w0:2,w1:3", "DTENSOR_CLIENT_ID": "2", "DTENSOR_JOB_NAME": "worker"}
    config["task"] = {"type": "chief", "index": 0}
    assert cluster.env_from_tf_config(config)["DTENSOR_CLIENT_ID"] == "0"
    workers_only = {"cluster": {"worker": ["w0:2", "w1:3"]}, "task": {"type": "worker", "index": 0}}
    assert cluster.env_from_tf_config(workers_only)["DTENSOR_JOBS"] == "w0:2,w1:3"


@pytest.mark.parametrize("config, words", [
    ("{not json", "not valid JSON"),
    ({"cluster": {}, "task": {"type": "worker"}}, "no chief or worker"),
    ({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}},
     "'ps' is not chief or worker"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}, "outside the cluster"),
])
def test_tf_config_errors(config, words):
    with pytest.raises(ValueError, match=words):
        cluster.env_from_tf_config(config if isinstance(config, str) else json.dumps(config))


def test_slurm():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "DTK_PORT_BASE": "9000"}
    assert cluster.env_from_slurm(env) == {
        "DTENSOR_JOBS": "n1:9000,n1:9001,n2:9000,n2:9001", "DTENSOR_CLIENT_ID": "3",
        "DTENSOR_JOB_NAME": "worker"}
    uneven = dict(env, SLURM_NTASKS="3", SLURM_PROCID="2", SLURM_STEP_TASKS_PER_NODE="2,1")
    assert cluster.env_from_slurm(uneven)["DTENSOR_JOBS"] == "n1:9000,n1:9001,n2:9000"
    with pytest.raises(ValueError, match="Slurm describes 4 tasks"):
        cluster.env_from_slurm(dict(env, SLURM_NTASKS="5"))
    with pytest.raises(ValueError, match="must be set"):
        cluster.env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_scheduler_env_precedence():
    tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                            "task": {"type": "worker", "index": 1}})
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
             "SLURM_TASKS_PER_NODE": "2"}
    assert cluster.scheduler_env({"DTENSOR_JOBS": "x:1", "TF_CONFIG": tf_config}) is None
    assert cluster.scheduler_env({"TF_CONFIG": tf_config, **slurm})[0] == "TF_CONFIG"
    assert cluster.scheduler_env(slurm) == ("Slurm", cluster.env_from_slurm(slurm))
    assert cluster.scheduler_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_coordination_timeouts_are_injected_and_removed():
    ctx = context.context()
    saved = ctx.coordination_service
    try:
        with cluster.coordination_timeouts(register_timeout_s=7, heartbeat_timeout_s=3):
            ctx.configure_coordination_service("standalone", "")
            config = ctx.coordination_service
        assert config.cluster_register_timeout_in_ms == 7000
        assert config.heartbeat_timeout_in_ms == 3000
        assert config.cluster_register_with_barrier
        assert "configure_coordination_service" not in vars(ctx)  # the wrapper is gone
    finally:
        ctx._coordination_service_config = saved


def test_bad_timeout_setting(monkeypatch):
    monkeypatch.setenv("DTK_REGISTER_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DTK_REGISTER_TIMEOUT_S='soon' is not a number"):
        with cluster.coordination_timeouts():
            pass


def test_same_on_all_clients_is_a_no_op_single_client():
    assert mesh_lib.check_same_on_all_clients(dtk.build_mesh("batch=8"), 1.5, what="x") == {0: 1.5}


@pytest.mark.slow
def test_missing_client_fails_within_the_deadline():
    code = "import dtk; dtk.build_mesh('batch=8', device_type='cpu', virtual_devices=4)"
    start = time.monotonic()
    res = procs.run_python(code, timeout=90, env=procs.base_env(
        DTENSOR_JOBS=",".join(f"localhost:{p}" for p in procs.free_ports(2)),
        DTENSOR_CLIENT_ID="0", DTENSOR_JOB_NAME="worker", DTK_REGISTER_TIMEOUT_S="5"))
    assert res.returncode != 0
    assert "DTensor client 0 of 2 could not join the cluster" in res.stderr
    assert time.monotonic() - start < 45


@pytest.mark.slow
def test_different_seeds_are_detected():
    code = textwrap.dedent("""
        import os, dtk
        mesh = dtk.build_mesh("batch=8", device_type="cpu")
        dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp,
                    config=dtk.TrainerConfig(seed=int(os.environ["DTENSOR_CLIENT_ID"]), verbose=0))
    """)
    for res in procs.run_clients(code, 2, timeout=150):
        assert res.returncode != 0
        assert "the initial weights' checksum differs between clients" in res.stderr
        assert "same seed" in res.stderr


@pytest.mark.slow
def test_tf_config_drives_a_two_client_mesh():
    ports = procs.free_ports(2)
    code = textwrap.dedent("""
        import dtk
        print("DESC", dtk.describe_mesh(dtk.build_mesh("batch=8", device_type="cpu")))
    """)
    clients = []
    import subprocess
    import sys
    for i in range(2):
        tf_config = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                "task": {"type": "worker", "index": i}})
        clients.append(subprocess.Popen([sys.executable, "-c", code], cwd=procs.REPO, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env=procs.base_env(TF_CONFIG=tf_config)))
    try:
        outs = [c.communicate(timeout=120) for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
    for i, (c, (out, err)) in enumerate(zip(clients, outs)):
        assert c.returncode == 0, err[-2000:]
        assert f"2 clients, 4 local devices (CPU:0-3), this is client {i}" in out
