"""Stress runs for two failures seen once and never again (issue 39): run them long enough to say.

* ``prefetch``: the input prefetch thread stalled about 60 s once, under load. Many short epochs
  of a shuffled ``DistributedDataset`` (prefetch 2), each closed after a random number of batches
  (the early close joins the producer), while ``--load`` processes keep the CPUs busy. Every wait
  for a batch and every close is timed.
* ``restore``: a restore of optimizer slots sharded across 2 clients failed once ("Does not have
  sufficient slices for partitioned tensor"). Many 2-client runs of ``tests/mc_client.py`` (the
  sharded update on), client 1 SIGKILLed at a random step or inside a random save (synchronous or
  asynchronous), the group restarted by the launcher: each must end with the losses of one
  uninterrupted process.

Usage (from the repository root; each run has a timeout)::

    python tests/stress.py prefetch --runs 200 --load 2
    python tests/stress.py restore --runs 30

Prints one line per run and a summary (counts by outcome, the longest waits) as JSON last.
``tests/test_stress.py`` runs a few of each in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests import procs  # noqa: E402  pylint: disable=wrong-import-position

CLIENT = str(REPO / "tests" / "mc_client.py")
RUN_TIMEOUT_S = 240
STEPS = 24  # mc_client: 3 epochs of 8 steps, a checkpoint each epoch (ckpt-8, ckpt-16, ckpt-24)


def _burners(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` processes that spin for ``seconds`` (a loaded machine), ended by their own clock."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stress_prefetch(runs: int, load: int, seed: int) -> dict:
    """Short epochs closed at random points, under load; every wait timed."""
    import dtk  # pylint: disable=import-outside-toplevel
    dtk.configure_virtual_cpus(8)
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from dtk.data import input as input_lib  # pylint: disable=import-outside-toplevel

    mesh = dtk.build_mesh("batch=8", device_type="cpu")
    rng = np.random.default_rng(seed)
    data = tf.data.Dataset.from_tensor_slices((rng.random((2048, 28, 28, 1), dtype=np.float32),
                                               rng.integers(0, 10, 2048).astype(np.int64)))
    stream = input_lib.DistributedDataset(data, mesh, input_lib.InputConfig(
        global_batch_size=64, shuffle=True, seed=seed, prefetch=2))
    # The step runs on the main thread while the producer packs the next batches, as in fit.
    from dtk.parallel import layouts  # pylint: disable=import-outside-toplevel
    model, _ = layouts.build_model(dtk.models.mnist_mlp, mesh, "data_parallel", seed=seed)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=mesh,
                      optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3))
    pick = random.Random(seed)
    burners = _burners(load, 3600)
    waits, closes, batches = [], [], 0
    try:
        for run in range(runs):
            take = pick.randint(1, stream.num_batches)
            items = stream.epoch(run)
            start = time.monotonic()
            for _ in range(take):
                t = time.monotonic()
                batch = next(items)
                waits.append(time.monotonic() - t)
                steps.train(batch)
            t = time.monotonic()
            items.close()  # the early close: the producer is stopped and joined
            closes.append(time.monotonic() - t)
            batches += take
            print(json.dumps({"run": run, "batches": take, "max_wait_s": round(max(
                waits[-take:]), 4), "close_s": round(closes[-1], 4),
                "epoch_s": round(time.monotonic() - start, 3)}), flush=True)
    finally:
        for b in burners:
            b.kill()
    return {"what": "prefetch", "runs": runs, "load_processes": load, "batches": batches,
            "max_wait_s": round(max(waits), 3), "max_close_s": round(max(closes), 3),
            "waits_over_1s": sum(w > 1 for w in waits),
            "waits_over_10s": sum(w > 10 for w in waits),
            "closes_over_1s": sum(c > 1 for c in closes)}


def _one_process(out: Path) -> list[float]:
    res = subprocess.run([sys.executable, CLIENT], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, env=procs.base_env(MC_OUT=str(out)), cwd=REPO)
    if res.returncode:
        raise SystemExit(f"error: the uninterrupted one-process run failed: {res.stderr[-500:]}")
    return json.loads(out.read_text())["loss"]


def stress_restore(runs: int, seed: int) -> dict:
    """2-client runs killed at random points and restarted; each must match one process."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    pick = random.Random(seed)
    outcomes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dtk-stress-") as tmp:
        want = _one_process(Path(tmp) / "one.json")
        for run in range(runs):
            where = Path(tmp) / f"run{run}"
            where.mkdir()
            mode = pick.choice(["step", "save"])
            at = pick.randint(1, STEPS - 1) if mode == "step" else pick.choice([8, 16])
            saves = pick.choice(["1", "0"])
            kill = {"MC_KILL_AT": str(at)} if mode == "step" else {"MC_KILL_IN_SAVE": str(at)}
            env = procs.base_env(MC_MARKER=str(where / "killed"), MC_CKPT=str(where / "ckpt"),
                                 MC_OUT=str(where / "losses.json"), MC_ASYNC=saves,
                                 MC_SHARD="1", **kill)
            start = time.monotonic()
            try:
                res = subprocess.run(
                    [sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2",
                     "--max_restarts", "1", "--", sys.executable, CLIENT],
                    capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=REPO)
                output = res.stdout + res.stderr
                if res.returncode:
                    lines = [ln for ln in output.splitlines() if "rror" in ln]
                    outcome = ("restore failed: sufficient slices" if "sufficient slices" in output
                               else f"failed (exit {res.returncode}): "
                                    f"{(lines or ['?'])[-1][:160]}")
                elif not (where / "killed").exists():
                    outcome = "passed, not killed (the kill point was never reached)"
                else:
                    got = json.loads((where / "losses.json").read_text())["loss"]
                    outcome = ("passed" if np.allclose(got, want, rtol=1e-6)
                               else f"losses differ: {got} against {want}")
            except subprocess.TimeoutExpired:
                outcome = f"timed out after {RUN_TIMEOUT_S} s"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            print(json.dumps({"run": run, "kill": f"{mode} {at}", "async_save": saves == "1",
                              "outcome": outcome, "s": round(time.monotonic() - start, 1)}),
                  flush=True)
    return {"what": "restore", "runs": runs, "outcomes": outcomes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["prefetch", "restore"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside (prefetch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        parser.error(f"--runs must be >= 1 and --load >= 0; got {args.runs}, {args.load}")
    summary = (stress_prefetch(args.runs, args.load, args.seed) if args.what == "prefetch"
               else stress_restore(args.runs, args.seed))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
