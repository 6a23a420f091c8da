"""The Ray backend: 2 actors, each one DTensor client, reproduce the single-process losses."""

import json
import textwrap

import numpy as np
import pytest

from tests import procs

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="the Ray backend is optional: pip install 'dtk[ray]'")

TRAIN = textwrap.dedent("""
    def train():
        import numpy as np, tensorflow as tf, dtk
        from dtk import input as input_lib
        mesh = dtk.build_mesh("batch=8", device_type="cpu")
        rng = np.random.default_rng(0)
        data = tf.data.Dataset.from_tensor_slices(
            (rng.random((256, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 256).astype(np.int64)))
        train_data = input_lib.DistributedDataset(data, mesh, input_lib.InputConfig(
            global_batch_size=64, shuffle=True, seed=1))
        trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp,
                              optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3),
                              config=dtk.TrainerConfig(seed=0, verbose=0))
        return trainer.fit(train_data, epochs=2).history["loss"]
""")


def test_two_ray_actors_match_one_process():
    single = procs.run_python(TRAIN + "import json; print('LOSSES', json.dumps(train()))",
                              timeout=180)
    assert single.returncode == 0, single.stderr[-3000:]
    want = json.loads(single.stdout.split("LOSSES")[1])
    code = TRAIN + textwrap.dedent("""
        import json, ray
        from dtk import ray_backend
        try:
            results = ray_backend.run(train, num_clients=2, timeout_s=240)
        finally:
            ray.shutdown()
        print("LOSSES", json.dumps(results))
    """)
    res = procs.run_python(code, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(res.stdout.split("LOSSES")[1])
    assert len(got) == 2
    for losses in got:
        np.testing.assert_allclose(losses, want, rtol=1e-6)


def test_dead_actor_fails_the_run_fast():
    code = TRAIN + textwrap.dedent("""
        import os, signal, time, ray
        from dtk import ray_backend
        def dies():
            if os.environ["DTENSOR_CLIENT_ID"] == "1":
                time.sleep(2)
                os.kill(os.getpid(), signal.SIGKILL)
            return train()
        start = time.monotonic()
        try:
            ray_backend.run(dies, num_clients=2, timeout_s=120)
        except ray_backend.ClientFailedError as e:
            print("FAILED", e.client, round(time.monotonic() - start, 1))
        finally:
            ray.shutdown()
    """)
    res = procs.run_python(code, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    client, took = res.stdout.split("FAILED")[1].split()[:2]
    assert client == "1"
    assert float(took) < 60
