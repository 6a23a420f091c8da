"""Pipeline parallelism (issue 61): ms per step and the bubble, measured against the formula.

For each schedule (GPipe, 1F1B) and microbatch count M, the LM trains on ``--mesh`` (a stage
axis) through ``dtk.train.pipeline.PipelineSteps``, in one process:

- **ms/step**: the median of ``--steps`` steps after 2 warm-up steps (the driver issues every
  op asynchronously; TensorFlow runs each device's ops as they come).
- **measured bubble**: one more step with every op waited for (``record=True``) gives each
  stage's busy time (the sum of its ops); ``1 - busy / (S x step)``, with ``step`` the
  asynchronous step's median, is the share of stage-time spent idle. The formula's bubble is
  ``(S - 1) / (M + S - 1)`` (equal stages, no transfer time).
- **overlap**: ``sum of all ops / step``: 1.0 means the stages ran one at a time; S would be a
  perfect pipeline. On a 2-core machine at most 2 ops run at once, whatever S.

Also the same model without a stage axis on all the devices (``--baseline_mesh``) for reference.

    python scripts/bench_pipeline.py --mesh stage=4,batch=2 --microbatches 1,4,8
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

from dtk import usage


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="stage=4,batch=2", help="a mesh with a stage axis")
    parser.add_argument("--baseline_mesh", default="batch=8", help="the reference, no stages")
    parser.add_argument("--microbatches", default="1,4,8", help="comma-separated M values")
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b")
    parser.add_argument("--dim", type=int, default=128, help="LM model width")
    parser.add_argument("--layers", type=int, default=4, help="LM blocks (the stages' units)")
    parser.add_argument("--seq_len", type=int, default=64, help="LM bytes per window")
    parser.add_argument("--global_batch_size", type=int, default=32,
                        help="windows per step (divisible by M x the stage's batch axis)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    import numpy as np  # pylint: disable=g-import-not-at-top
    import dtk  # pylint: disable=g-import-not-at-top
    mesh = dtk.build_mesh(args.mesh)
    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, pipeline  # pylint: disable=g-import-not-at-top
    from dtk.train import pipeline as pipeline_steps  # pylint: disable=g-import-not-at-top

    factory = functools.partial(models.transformer_lm, vocab=256, seq_len=args.seq_len,
                                dim=args.dim, heads=4, layers=args.layers)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (args.global_batch_size, args.seq_len)).astype(np.int32)
    y = rng.integers(0, 256, (args.global_batch_size, args.seq_len)).astype(np.int64)

    def timed(step) -> float:
        for _ in range(2):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)

    base_mesh = dtk.build_mesh(args.baseline_mesh)
    model, _ = layouts.build_model(factory, base_mesh, "transformer_lm", seed=0)
    base = dtk.Steps(model, loss="sparse_categorical_crossentropy", mesh=base_mesh,
                     optimizer=tf_keras.optimizers.Adam(1e-3, mesh=base_mesh))
    batch = input_lib.pack(base_mesh, (x, y, np.ones(len(x), np.float32)))
    base_ms = timed(lambda: float(base.train(batch)))
    rows = [{"variant": args.baseline_mesh, "ms_per_step": base_ms}]
    print(f"{args.baseline_mesh:<34} {base_ms:8.1f} ms/step", flush=True)
    print(f"{'variant':<34} {'ms/step':>8} {'bubble':>8} {'formula':>8} {'overlap':>8}")
    for schedule in args.schedules.split(","):
        for m in (int(v) for v in args.microbatches.split(",")):
            config = pipeline.PipelineConfig(microbatches=m, schedule=schedule)
            pipe = pipeline.build(factory, mesh, "transformer_lm", seed=0, config=config)
            steps = pipeline_steps.PipelineSteps(
                pipe, loss="sparse_categorical_crossentropy", config=config,
                optimizer=lambda mesh: tf_keras.optimizers.Adam(1e-3, mesh=mesh))
            ms = timed(lambda: steps.train(x, y))  # pylint: disable=cell-var-from-loop
            steps.train(x, y, record=True)
            stages = len(pipe.models)
            busy = [0.0] * stages
            for _, s, _, start, end in steps.timeline:
                busy[s] += 1000 * (end - start)
            measured = 1 - sum(busy) / (stages * ms)
            row = {"variant": f"{args.mesh} {schedule} M={m}", "ms_per_step": ms,
                   "bubble_measured": measured, "bubble_formula": pipeline.bubble(stages, m),
                   "overlap": sum(busy) / ms, "busy_ms_by_stage": busy}
            rows.append(row)
            print(f"{row['variant']:<34} {ms:8.1f} {measured:8.1%} {row['bubble_formula']:8.1%} "
                  f"{row['overlap']:8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
