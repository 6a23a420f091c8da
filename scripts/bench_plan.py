"""Benchmark of the planner (``dtk.plan``, ``--mesh auto``): predicted against measured.

    python scripts/bench_plan.py                         # LM dims 64, 128, 256; three budgets each
    python scripts/bench_plan.py --dims 128 --json_out plan.jsonl
    python scripts/bench_plan.py --dims "" --unfit lm1024,mlp65536   # models that cannot be replicated

For each LM size, in one process on 8 virtual CPUs: the planner calibrates (cached machine
figures are reused; ``--refresh`` measures again), then every candidate that can run is built
and timed alternating call by call with the plain ``batch=D`` plan, then dropped
(``dtk.planning.planner.paired_ms``): two models alive at a time, as in a real run (with many alive at
once every step ran 30-40% slower here), and a candidate's time is its median ratio to that
anchor times the anchor's median over the whole run, so drift between candidates cancels out. Three memory budgets per size: none (every
candidate fits), just below the fastest candidate's planned memory, and just above the smallest
candidate's. For each budget the table shows the chosen plan, its predicted and measured ms/step,
the best feasible candidate's measured ms/step, and the two checks of issue 27: chosen within
10% of the best feasible, and measured within 20% of predicted.
"""

from __future__ import annotations

import argparse
import json
import sys

from dtk import usage


def _lm_factory(models, dim: int, seq_len: int, layers: int):
    return lambda: models.transformer_lm(vocab=256, seq_len=seq_len, dim=dim, heads=8,
                                         layers=layers)


def run_size(dim: int, *, seq_len: int, layers: int, batch: int, refresh: bool,
             rounds: int) -> list[dict]:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.planning import planner  # pylint: disable=g-import-not-at-top
    from dtk.train import steps  # pylint: disable=g-import-not-at-top
    factory = _lm_factory(models, dim, seq_len, layers)
    remat = models.MODEL_SPECS["lm"].remat
    common = {"global_batch_size": batch, "table": "transformer_lm", "input_shape": (seq_len,),
              "input_dtype": "int32", "num_classes": 256, "remat_patterns": remat}
    base = planner.plan(factory, refresh=refresh, **common)
    runnable = [c for c in base.candidates if c.rejected is None]
    fastest = min(runnable, key=lambda c: c.predicted_ms)
    smallest = min(runnable, key=lambda c: c.memory["total"])
    budgets = [None, fastest.memory["total"] - 1, smallest.memory["total"] + 1]
    plans = [base] + [planner.plan(factory, device_memory_gb=b / 2 ** 30, machine=base.machine,
                                   step=base.step, **common) for b in budgets[1:]]
    union = {}
    for p in plans:  # a budget may need more microbatches: another candidate to time
        for c in p.candidates:
            if c.rejected is None and (p is base or c.fits):
                union.setdefault(c.label, c)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (batch, seq_len)).astype(np.int32)
    y = rng.integers(0, 256, (batch, seq_len)).astype(np.int64)
    def build(c):
        def make():
            mesh = dtk.build_mesh(c.mesh)
            model, _ = layouts.build_model(factory, mesh, "transformer_lm", seed=0,
                                           fsdp=c.update == "fsdp")
            step = steps.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adamw",
                               mesh=mesh, config=steps.StepConfig(
                                   remat=remat if c.remat else (),
                                   gradient_accumulation_steps=c.microbatches))
            packed = input_lib.pack(mesh, (x, y, np.ones(batch, np.float32)))
            return lambda: float(tf.reduce_sum(step.train(packed)))
        return make

    # Each candidate is timed alternating with the plain batch=D plan (the anchor), then dropped:
    # two models alive at a time, as in a real run, and drift between candidates cancels out.
    anchor_label = f"batch={base.machine.devices} zero"
    timed = planner.paired_ms(build(union[anchor_label])(),
                              {label: build(c) for label, c in union.items()
                               if label != anchor_label}, rounds=rounds)
    by_label = {anchor_label: timed.pop("anchor"), **timed}
    rows = []
    for budget, p in zip(budgets, plans):
        feasible = [c for c in p.candidates if c.fits]
        best = min(feasible, key=lambda c: by_label[c.label])
        chosen = p.chosen
        got = by_label[chosen.label]
        rows.append({
            "dim": dim, "budget_mib": None if budget is None else round(budget / 2 ** 20, 2),
            "feasible": len(feasible), "chosen": chosen.label,
            "predicted_ms": round(chosen.predicted_ms, 1), "measured_ms": round(got, 1),
            "best": best.label, "best_ms": round(by_label[best.label], 1),
            "within_10pct_of_best": got <= 1.10 * by_label[best.label],
            "within_20pct_of_prediction": abs(got - chosen.predicted_ms) <= 0.2 * got,
            "candidates": [{"label": c.label, "mib": round(c.memory["total"] / 2 ** 20, 2),
                            "fits": c.fits, "predicted_ms": round(c.predicted_ms, 1),
                            "measured_ms": round(by_label[c.label], 1)}
                           for c in p.candidates if c.label in by_label and
                           (c.fits or budget is None)]})
    print(base.explain(), file=sys.stderr, flush=True)
    return rows


# Models that cannot be replicated (issue 42): planned under a budget batch=D cannot meet, then
# every feasible candidate built and timed alone (no batch=D anchor: it does not fit).
UNFIT = {
    "lm1024": ("the LM, dim 1024 x 4 layers, seq_len 128, batch 32", 0.25),
    "mlp65536": ("the MNIST MLP with 65,536 hidden units, batch 64", 0.3),
}


def run_unfit(name: str, *, rounds: int) -> list[dict]:
    import gc  # pylint: disable=g-import-not-at-top
    import resource  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    dtk.configure_virtual_cpus(8)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, materialize  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.planning import planner  # pylint: disable=g-import-not-at-top
    from dtk.train import steps  # pylint: disable=g-import-not-at-top
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if name == "lm1024":
        factory = _lm_factory(models, 1024, 128, 4)
        table, batch, remat = "transformer_lm", 32, models.MODEL_SPECS["lm"].remat
        common = {"input_shape": (128,), "input_dtype": "int32", "num_classes": 256}
    else:
        factory = lambda: models.mnist_mlp(hidden=65536)  # noqa: E731
        table, batch, remat = "mlp_model_parallel", 64, models.MODEL_SPECS["mlp"].remat
        common = {"input_shape": (28, 28, 1), "input_dtype": "float32", "num_classes": 10}
    budget_gb = UNFIT[name][1]
    start = time.perf_counter()
    p = planner.plan(factory, global_batch_size=batch, device_memory_gb=budget_gb, table=table,
                     remat_patterns=remat, optimizer="adamw", refresh=True, **common)
    plan_s = time.perf_counter() - start
    plan_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    start = time.perf_counter()
    planner.plan(factory, global_batch_size=batch, device_memory_gb=budget_gb, table=table,
                 remat_patterns=remat, optimizer="adamw", **common)
    cached_s = time.perf_counter() - start
    print(p.explain(), file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    shape = [batch, *common["input_shape"]]
    if common["input_dtype"] == "int32":
        x = rng.integers(0, 256, shape).astype(np.int32)
        y = rng.integers(0, 256, shape).astype(np.int64)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
        y = rng.integers(0, 10, batch).astype(np.int64)
    measured = {}
    for c in [c for c in p.candidates if c.fits]:
        mesh = dtk.build_mesh(c.mesh)
        model, _ = layouts.build_model(factory, mesh, table, seed=0, fsdp=c.update == "fsdp",
                                       allow_replicated=True, input_shape=common["input_shape"],
                                       input_dtype=common["input_dtype"])
        step = steps.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adamw",
                           mesh=mesh, config=steps.StepConfig(
                               remat=remat if c.remat else (),
                               gradient_accumulation_steps=c.microbatches,
                               shard_optimizer_state=c.update == "zero" and
                               mesh.dim_size("batch") > 1))
        packed = input_lib.pack(mesh, (x, y, np.ones(batch, np.float32)))
        measured[c.label] = planner.alternating_ms(
            [lambda: float(tf.reduce_sum(step.train(packed)))], rounds=rounds, warmup=1)[0]  # pylint: disable=cell-var-from-loop
        print(f"{c.label}: predicted {c.predicted_ms:.1f} ms, measured {measured[c.label]:.1f} ms",
              file=sys.stderr, flush=True)
        del step, model, packed
        gc.collect()
        materialize.release_free_memory()
    best = min(measured, key=measured.get)
    got = measured[p.chosen.label]
    return [{"dim": name, "budget_mib": round(budget_gb * 1024, 2), "feasible": len(measured),
             "chosen": p.chosen.label, "predicted_ms": round(p.chosen.predicted_ms, 1),
             "measured_ms": round(got, 1), "best": best, "best_ms": round(measured[best], 1),
             "within_10pct_of_best": got <= 1.10 * measured[best],
             "within_20pct_of_prediction": abs(got - p.chosen.predicted_ms) <= 0.2 * got,
             "plan_seconds": round(plan_s, 1), "cached_plan_seconds": round(cached_s, 1),
             "plan_rss_growth_mib": round(plan_rss / 2 ** 20),
             "plan_all_devices_mib": round(8 * p.chosen.memory["total"] / 2 ** 20),
             "timed_on": p.step.measured_on,
             "candidates": [{"label": c.label, "mib": round(c.memory["total"] / 2 ** 20, 2),
                             "fits": c.fits, "predicted_ms": round(c.predicted_ms, 1),
                             "measured_ms": round(measured[c.label], 1)}
                            for c in p.candidates if c.label in measured]}]


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="64,128,256", help="LM model dims, comma-separated")
    parser.add_argument("--layers", type=int, default=2, help="LM transformer blocks")
    parser.add_argument("--seq_len", type=int, default=64, help="LM bytes per window")
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls per candidate")
    parser.add_argument("--refresh", action="store_true", help="calibrate again, ignoring the cache")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json_out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--unfit", default="", help=(
        "models that cannot be replicated, planned under a budget batch=D cannot meet and "
        f"every feasible candidate timed: comma-separated, of {', '.join(UNFIT)} (issue 42)"))
    parser.add_argument("--unfit_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.unfit_worker is not None:
        for row in run_unfit(args.unfit_worker, rounds=args.rounds):
            print("ROW " + json.dumps(row), flush=True)
        return 0
    if args.worker is not None:
        for row in run_size(args.worker, seq_len=args.seq_len, layers=args.layers,
                            batch=args.batch, refresh=args.refresh, rounds=args.rounds):
            print("ROW " + json.dumps(row), flush=True)
        return 0
    import subprocess  # pylint: disable=g-import-not-at-top
    rows = []
    unknown = [n for n in args.unfit.split(",") if n and n not in UNFIT]
    if unknown:
        print(f"error: --unfit {unknown[0]} is not one of {', '.join(UNFIT)}", file=sys.stderr)
        return 2
    jobs = [[sys.executable, __file__, "--worker", str(dim), "--layers", str(args.layers),
             "--seq_len", str(args.seq_len), "--batch", str(args.batch),
             "--rounds", str(args.rounds)] + (["--refresh"] if args.refresh else [])
            for dim in (int(d) for d in args.dims.split(",") if d)]
    jobs += [[sys.executable, __file__, "--unfit_worker", n, "--rounds", str(args.rounds)]
             for n in args.unfit.split(",") if n]
    for cmd in jobs:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        got = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
        if out.returncode or not got:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        explain = [line for line in out.stderr.splitlines() if not line.startswith(
            ("W0000", "I0000", "E0000", "WARNING", "INFO"))]
        print("\n".join(explain[-25:]))
        rows += got
    print("\n| dim | budget (MiB/device) | feasible | chosen | predicted ms | measured ms | best "
          "feasible (measured ms) | <=10% of best | <=20% of prediction |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['dim']} | {r['budget_mib'] or 'none'} | {r['feasible']} | {r['chosen']} | "
              f"{r['predicted_ms']} | {r['measured_ms']} | {r['best']} ({r['best_ms']}) | "
              f"{'yes' if r['within_10pct_of_best'] else 'NO'} | "
              f"{'yes' if r['within_20pct_of_prediction'] else 'NO'} |")
    for r in rows:
        if "plan_seconds" in r:
            print(f"{r['dim']}: planned in {r['plan_seconds']} s uncached, "
                  f"{r['cached_plan_seconds']} s cached; the step timed on {r['timed_on']}; the "
                  f"planning grew by {r['plan_rss_growth_mib']} MiB (the chosen plan: "
                  f"{r['plan_all_devices_mib']} MiB for all 8 devices)")
    print("\nevery candidate timed (predicted / measured ms, planned MiB per device):")
    for r in rows:
        print(f"dim {r['dim']}, budget {r['budget_mib'] or 'none'}: " + "; ".join(
            f"{c['label']} {c['predicted_ms']}/{c['measured_ms']} ({c['mib']})"
            for c in r["candidates"]))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
