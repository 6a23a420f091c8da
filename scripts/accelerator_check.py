"""The accelerator lane: dtk's parity and collectives on real GPUs or TPUs, and its speed there.

    python scripts/accelerator_check.py                  # everything; one table at the end
    python scripts/accelerator_check.py --json_out acc.json --skip_bench

On a machine with GPUs (or TPUs) it runs, each in a process of its own with a timeout:

1. **Parity on the devices.** The MNIST MLP (and the transformer LM) trained for a few Adam steps
   on one device (``batch=1``), on all N devices (``batch=N``), and on ``batch=N/2,model=2``
   where N >= 4 (or ``batch=1,model=2`` with 2 devices): the losses must equal one device's to
   the tolerance below. GPUs' TF32 matmuls are turned off for this check (TensorFlow enables
   them on Ampere and later), since they change every result at the 1e-3 level.
2. **Collectives across processes.** The same MLP on 2 DTensor clients (``python -m dtk.cluster.launch
   --num_clients 2``, N/2 devices each, NCCL on GPUs) against one process on all N devices.
3. **Speed.** ``scripts/bench.py --device gpu`` (or ``tpu``): dtk against a plain single-device
   loop, ``Model.fit`` and ``MirroredStrategy`` on the same devices.

It writes one table (and ``--json_out`` as JSON). On a CPU-only machine it says so in one line and
exits 0: CPU parity and the 2-client path run in the ordinary suite (``pytest``) on 8 virtual
CPUs. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from dtk import usage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5
STEPS = 6
TIMEOUT_S = 600


def _run(args: list[str], timeout: float = TIMEOUT_S, env: dict | None = None
         ) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})


def _accelerators() -> tuple[str, int]:
    """('gpu' | 'tpu' | 'cpu', count), probed in a subprocess (TensorFlow stays out of this one)."""
    probe = ("import tensorflow as tf; g = len(tf.config.list_physical_devices('GPU')); "
             "t = len(tf.config.list_physical_devices('TPU')); print('gpu' if g else 'tpu' if t "
             "else 'cpu', g or t)")
    res = _run([sys.executable, "-c", probe], timeout=120)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines() or ["no output"]
        if "No module named 'tensorflow'" in lines[-1]:
            raise SystemExit(f"error: {sys.executable} has no TensorFlow; install dtk with it "
                             "first: pip install -e . \"tensorflow[and-cuda]>=2.21,<2.22\" "
                             "(BUILD.md, Install)")
        raise SystemExit(f"error: could not probe the devices: {lines[-1][-300:]}")
    kind, count = res.stdout.split()[-2:]
    return kind, int(count)


def _meshes(n: int) -> list[str]:
    meshes = ["batch=1"]
    if n > 1:
        meshes.append(f"batch={n}")
    if n >= 4 and n % 2 == 0:
        meshes.append(f"batch={n // 2},model=2")
    elif n == 2:
        meshes.append("batch=1,model=2")
    return meshes


# -- worker: one mesh, one process ----------------------------------------------------------------
def _worker(model_name: str, mesh_spec: str, device: str) -> dict:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    tf.config.experimental.enable_tensor_float_32_execution(False)
    mesh = dtk.build_mesh(mesh_spec, device_type=device)
    rng = np.random.default_rng(0)
    batch = 16
    if model_name == "lm":
        factory = lambda: models.transformer_lm(vocab=64, seq_len=16, dim=32, heads=8, layers=1,
                                                dropout=0.1)
        table = "transformer_lm"
        x = rng.integers(0, 64, (STEPS, batch, 16)).astype(np.int32)
        y = rng.integers(0, 64, (STEPS, batch, 16)).astype(np.int64)
    else:
        factory, table = models.mnist_mlp, "mlp_model_parallel"
        x = rng.random((STEPS, batch, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, (STEPS, batch)).astype(np.int64)
    model, _ = layouts.build_model(factory, mesh, table, seed=0)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3), mesh=mesh)
    losses = [float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(batch, np.float32)))))
              for i in range(STEPS)]
    return {"losses": losses, "devices": mesh.num_local_devices()}


def _run_worker(model_name: str, mesh: str, device: str) -> dict:
    res = _run([sys.executable, __file__, "--worker", model_name, mesh, device])
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _compare(got: dict, want: dict) -> tuple[str, float | None]:
    if "error" in got:
        return "FAIL: " + got["error"], None
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], want["losses"]))
    return ("ok" if diff <= RTOL else "FAIL"), diff


def _parity(device: str, n: int) -> list[dict]:
    rows = []
    for model_name in ("mlp", "lm"):
        reference = _run_worker(model_name, "batch=1", device)
        for mesh in _meshes(n)[1:]:
            status, diff = (_compare(_run_worker(model_name, mesh, device), reference)
                            if "error" not in reference else ("FAIL: " + reference["error"], None))
            rows.append({"check": f"parity {model_name}", "config": f"{mesh} vs batch=1",
                         "result": status, "max_rel_diff": diff})
    return rows


def _two_clients(device: str, n: int) -> list[dict]:
    if n < 2 or device != "gpu":
        return [{"check": "2 clients", "config": "needs 2+ GPUs", "result": "skipped",
                 "max_rel_diff": None}]
    common = ["--mesh", f"batch={n}", "--dataset", "sample", "--epochs", "1",
              "--device", device]
    one, two = (os.path.join(REPO, f".accelerator_check_{k}.json") for k in ("one", "two"))
    script = os.path.join(REPO, "scripts", "train_mnist.py")
    first = _run([sys.executable, script, *common, "--summary_json", one])
    # Each client sees its own half of the GPUs (the launcher numbers the clients).
    half = n // 2
    client = ("first=$((DTENSOR_CLIENT_ID * {h})); export CUDA_VISIBLE_DEVICES=$(seq -s, $first "
              "$((first + {h} - 1))); exec \"$@\"").format(h=half)
    second = _run([sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2", "--", "bash", "-c",
                   client, "client", sys.executable, script, *common[:1], f"batch={n}",
                   *common[2:], "--summary_json", two])
    for res in (first, second):
        if res.returncode != 0:
            return [{"check": "2 clients", "config": f"2 x {n // 2} vs 1 x {n}",
                     "result": "FAIL: " + (res.stderr.strip().splitlines() or ["?"])[-1][:300],
                     "max_rel_diff": None}]
    want, got = (json.load(open(p)) for p in (one, two))
    for p in (one, two):
        os.remove(p)
    status, diff = _compare({"losses": got["train_loss"]}, {"losses": want["train_loss"]})
    return [{"check": "2 clients", "config": f"2 x {n // 2} vs 1 x {n} (train_mnist.py)",
             "result": status, "max_rel_diff": diff}]


def _bench(device: str) -> list[dict]:
    out = os.path.join(REPO, ".accelerator_check_bench.json")
    res = _run([sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--device", device,
                "--workloads", "mlp,lm", "--repeats", "1", "--json_out", out], timeout=1800)
    if res.returncode != 0:
        return [{"check": "bench", "config": "scripts/bench.py", "result":
                 "FAIL: " + (res.stderr.strip().splitlines() or ["?"])[-1][:300],
                 "max_rel_diff": None}]
    rows = []
    with open(out) as f:
        for line in f:
            r = json.loads(line)
            rows.append({"check": f"bench {r['workload']}", "config": r["variant"],
                         "result": f"{r['ms_per_step']:.2f} ms/step", "max_rel_diff": None})
    os.remove(out)
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| check | configuration | result | max relative difference |", "|---|---|---|---|"]
    for r in rows:
        diff = "" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}"
        lines.append(f"| {r['check']} | {r['config']} | {r['result']} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json_out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--skip_bench", action="store_true", help="parity and collectives only")
    parser.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return 0
    start = time.perf_counter()
    kind, n = _accelerators()
    if kind == "cpu":
        print("accelerator_check: no GPU or TPU on this machine; nothing to check here (CPU parity "
              "and 2 clients run in the ordinary suite: pytest)")
        return 0
    print(f"accelerator_check: {n} {kind.upper()}(s); meshes {', '.join(_meshes(n))}", flush=True)
    rows = _parity(kind, n) + _two_clients(kind, n) + ([] if args.skip_bench else _bench(kind))
    print(_table(rows))
    print(f"accelerator_check: {time.perf_counter() - start:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"devices": f"{n} {kind}", "rows": rows}, f, indent=1)
    return 1 if any(r["result"].startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
