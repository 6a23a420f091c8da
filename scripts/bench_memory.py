"""Memory per client, measured and planned, for the ways dtk can lay out the LM's training state.

Each variant runs ``scripts/train_lm.py`` for a few steps as ``--num_clients`` clients of
``--devices_per_client`` virtual CPUs each (``python -m dtk.cluster.launch``), and reports for every
client its peak resident memory (``ru_maxrss``, read when the client exits), the plan's bytes per
device (weights + AdamW state, and what FSDP gathers during a step), and the median step time
from the run's summary. The first row is the same run at ``--baseline_dim`` (the fixed cost of
TensorFlow, DTensor and the data): a variant's cost is its peak minus the baseline's.

Example (issue 24's model: 772.7 MiB of weights, 4 clients x 2 devices)::

    python scripts/bench_memory.py --dim 2048 --layers 4

``--workload recsys`` runs ``scripts/train_recsys.py`` instead (tables of ``--table_sizes`` rows,
variants ``rows8``, ``rows8_sparse``: rows over all 8 devices, dense or sparse updates;
``rows_model``, ``rows_model_sparse``: rows over ``model`` on ``batch=4,model=2``), e.g.
``python scripts/bench_memory.py --workload recsys --table_sizes 8388608,4096,256,16``.

``--workload moe`` runs the mixture-of-experts LM (``--moe_experts`` experts in every block,
issue 60), variants ``moe_replicated`` (``batch=8``, the experts on every device, the state
unsharded), ``moe_zero`` (``batch=8``, the sharded update), ``moe_expert2``, ``moe_expert4``,
``moe_expert8`` (``batch=8/n,expert=n``: the experts and their state divided by the expert
axis), ``moe_over_batch`` (``batch=8``, the experts over batch), e.g.
``python scripts/bench_memory.py --workload moe --dim 512 --layers 2``.

Variants (``--variants``, comma-separated):

* ``tp``: ``--mesh batch=1,model=8`` (Megatron table over all 8 devices)
* ``replicated``: ``--mesh batch=8 --noshard_optimizer_state``
* ``zero``: ``--mesh batch=8 --shard_optimizer_state``
* ``fsdp``: ``--mesh batch=8 --fsdp``
* ``fsdp_tp``: ``--mesh batch=4,model=2 --fsdp``
* ``fsdp_remat``: ``--mesh batch=8 --fsdp --remat blocks``
* ``seq``, ``seq_blockwise``: ``--mesh batch=2,seq=4`` (the sequence sharded over seq), with
  MultiHeadAttention or blockwise attention; ``replicated_blockwise``: ``batch=8`` blockwise;
  ``seq8_blockwise``: ``batch=1,seq=8`` blockwise. Long context, e.g.
  ``python scripts/bench_memory.py --dim 64 --layers 1 --seq_len 4096 --variants
  replicated,seq,replicated_blockwise,seq_blockwise``
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from dtk import usage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "tp": ["--mesh", "batch=1,model=8"],
    "replicated": ["--mesh", "batch=8", "--noshard_optimizer_state"],
    "zero": ["--mesh", "batch=8", "--shard_optimizer_state"],
    "fsdp": ["--mesh", "batch=8", "--fsdp"],
    "fsdp_tp": ["--mesh", "batch=4,model=2", "--fsdp"],
    "fsdp_remat": ["--mesh", "batch=8", "--fsdp", "--remat", "blocks"],
    # issue 44: the sequence sharded (context parallelism), and blockwise attention
    "seq": ["--mesh", "batch=2,seq=4", "--noshard_optimizer_state"],
    "replicated_blockwise": ["--mesh", "batch=8", "--noshard_optimizer_state", "--attention",
                             "blockwise"],
    "seq_blockwise": ["--mesh", "batch=2,seq=4", "--noshard_optimizer_state", "--attention",
                      "blockwise"],
    "seq8_blockwise": ["--mesh", "batch=1,seq=8", "--noshard_optimizer_state", "--attention",
                       "blockwise"],
    "seq8": ["--mesh", "batch=1,seq=8", "--noshard_optimizer_state"],
}
# issue 43: a recommender whose tables are larger than a device (--workload recsys,
# scripts/train_recsys.py): rows over every device, dense or sparse updates; rows over `model`.
RECSYS_VARIANTS = {
    "rows8": ["--mesh", "batch=8", "--layout", "recsys_batch_rows"],
    "rows8_sparse": ["--mesh", "batch=8", "--layout", "recsys_batch_rows", "--sparse_tables"],
    "rows_model": ["--mesh", "batch=4,model=2", "--layout", "recsys"],
    "rows_model_sparse": ["--mesh", "batch=4,model=2", "--layout", "recsys", "--sparse_tables"],
}
# issue 60: the mixture-of-experts LM (--workload moe): the experts replicated, or divided over
# an expert axis, or over batch.
MOE_VARIANTS = {
    "moe_replicated": ["--mesh", "batch=8", "--layout", "transformer_lm_moe",
                       "--noshard_optimizer_state"],
    "moe_zero": ["--mesh", "batch=8", "--layout", "transformer_lm_moe", "--shard_optimizer_state"],
    "moe_expert2": ["--mesh", "batch=4,expert=2", "--layout", "transformer_lm_moe",
                    "--noshard_optimizer_state"],
    "moe_expert4": ["--mesh", "batch=2,expert=4", "--layout", "transformer_lm_moe",
                    "--noshard_optimizer_state"],
    "moe_expert8": ["--mesh", "batch=1,expert=8", "--layout", "transformer_lm_moe"],
    "moe_over_batch": ["--mesh", "batch=8", "--layout", "transformer_lm_moe_batch",
                       "--noshard_optimizer_state"],
}
# Run inside each client: the script, then its peak RSS on the way out (atexit runs even when
# dtk ends the process early, see dtk.cluster.env.exit_process).
SHIM = ("import atexit, resource, runpy, sys; "
        "atexit.register(lambda: print('DTK_PEAK_RSS', resource.getrusage("
        "resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
PEAK = re.compile(r"\[client (\d+)\] DTK_PEAK_RSS (\d+)")


def _flag(flags: list[str], name: str, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


def planned_memory(args, names: list[str]) -> dict[str, dict]:
    """The planner's bytes per device for each variant, activations included
    (``dtk.planning.planner.candidate_memory``: one plain call of the model on one example, in a
    process of its own that ends before the clients start)."""
    code = f"""
import json, functools, sys
sys.path.insert(0, {REPO!r})
from dtk import models
from dtk.parallel import layouts
from dtk.planning import planner
from dtk.data import text
args, variants = json.loads(sys.argv[1])
out = {{}}
for name, flags in variants.items():
    get = lambda n, d=None: flags[flags.index(n) + 1] if n in flags else d
    moe = {{"moe_experts": args["moe_experts"], "moe_group_size": args["moe_group_size"]}} \
        if args["workload"] == "moe" else {{}}
    factory = functools.partial(models.transformer_lm, vocab=text.VOCAB, seq_len=args["seq_len"],
                                dim=args["dim"], heads=args["heads"], layers=args["layers"],
                                attention=get("--attention", "mha"), block_size=args["block_size"],
                                **moe)
    profile = planner.profile_model(factory, (args["seq_len"],), input_dtype="int32")
    sizes = dict(kv.split("=") for kv in get("--mesh").split(","))
    sizes = {{k: int(v) for k, v in sizes.items()}}
    table = layouts.load_table(get("--layout", "transformer_lm"))
    fsdp = "--fsdp" in flags
    plan = layouts.plan_weights(table, planner.Axes(sizes), profile.weights,
                                fsdp_paths=[p for p, _, _ in profile.weights] if fsdp else ())
    zero = "--shard_optimizer_state" in flags or (
        "--noshard_optimizer_state" not in flags and sizes["batch"] > 1)  # the default: auto
    update = "fsdp" if fsdp else ("zero" if zero else "replicated")
    remat = models.MODEL_SPECS["lm"].remat if "--remat" in flags else ()
    out[name] = planner.candidate_memory(profile, plan, update=update, remat=remat,
                                         rows_per_device=args["global_batch_size"] // sizes["batch"])
    experts = {{p for _, _, _, paths in profile.experts for p in paths}}
    if experts:  # the experts' own share of weights + optimizer state
        import dataclasses
        out[name]["experts"] = layouts.memory_per_device(
            dataclasses.replace(plan, weights=tuple(w for w in plan.weights if w.path in experts)),
            optimizer_slots=2, shard_optimizer_state=update == "zero")["total"]
print("DTK_PLANNED", json.dumps(out))
"""
    variants = {name: (MOE_VARIANTS if args.workload == "moe" else VARIANTS)[name]
                for name in names}
    res = subprocess.run([sys.executable, "-c", code, json.dumps([vars(args), variants])],
                         capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    for line in res.stdout.splitlines():
        if line.startswith("DTK_PLANNED "):
            return json.loads(line.split(" ", 1)[1])
    raise SystemExit(f"error: planning the variants failed: {res.stderr.strip()[-400:]}")


def _script_flags(flags: list[str], args, dim: int, summary: str) -> list[str]:
    """The script and its flags for a variant of ``args.workload``."""
    if args.workload == "recsys":
        tables = args.table_sizes if dim else args.baseline_table_sizes
        return [os.path.join(REPO, "scripts", "train_recsys.py"), *flags,
                "--table_sizes", tables, "--dim", str(args.table_dim),
                "--global_batch_size", str(args.global_batch_size),
                "--train_examples", str(args.steps * args.global_batch_size),
                "--heldout_examples", str(args.global_batch_size), "--summary_json", summary]
    return [os.path.join(REPO, "scripts", "train_lm.py"),
            *flags, "--dim", str(dim), "--layers", str(args.layers),
            "--seq_len", str(args.seq_len), "--global_batch_size", str(args.global_batch_size),
            "--heads", str(args.heads),
            *(["--block_size", str(args.block_size)] if args.block_size else []),
            *(["--moe_experts", str(args.moe_experts), "--moe_group_size",
               str(args.moe_group_size)] if args.workload == "moe" else []),
            "--steps", str(args.steps), "--eval_every", str(args.steps), "--eval_batches", "1",
            "--sample_bytes", "0", "--summary_json", summary]


def run_variant(name: str, flags: list[str], args, dim: int, timeout: float) -> dict:
    """One variant's clients, each reporting its peak RSS; ``dim`` 0 is the recommender's
    baseline (``--baseline_table_sizes``)."""
    with tempfile.TemporaryDirectory(prefix="dtk-bench-memory-") as tmp:
        summary = os.path.join(tmp, "summary.json")
        command = [sys.executable, "-m", "dtk.cluster.launch", "--num_clients", str(args.num_clients),
                   "--devices_per_client", str(args.devices_per_client), "--",
                   sys.executable, "-c", SHIM, *_script_flags(flags, args, dim, summary)]
        try:
            res = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"variant": name, "dim": dim, "error": f"timed out after {timeout:.0f} s"}
        peaks = {int(c): int(b) for c, b in PEAK.findall(res.stdout)}
        if res.returncode != 0 or not os.path.exists(summary):
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            return {"variant": name, "dim": dim, "error": f"exit {res.returncode}: {' | '.join(tail)}"}
        with open(summary) as f:
            data = json.load(f)
    planned = data.get("planned_bytes_per_device", {})
    return {"variant": name, "dim": dim, "peak_rss_per_client": [peaks[c] for c in sorted(peaks)],
            "planned_per_device": planned,
            "planned_per_client": planned.get("total", 0) * args.devices_per_client,
            "seq_len": args.seq_len, "global_batch_size": args.global_batch_size,
            "ms_per_step": data.get("ms_per_step_median"), "first_step_s": data.get("first_step_s")}


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def table(rows: list[dict], baseline: dict | None) -> str:
    """One line a variant: the plan's bytes per device (weights + optimizer state + gradients +
    FSDP's gathered weights + activations, the planner's estimate), per client, the measured peak
    RSS per client, its excess over the baseline, and that excess over the plan."""
    base = max(baseline["peak_rss_per_client"]) if baseline and "error" not in baseline else 0
    moe = any("experts" in row.get("planned_per_device", {}) for row in rows)
    lines = ["variant                 planned/device MiB (w+opt, grads, gathered, activations)"
             "  planned/client  peak RSS/client  over baseline  over/planned  ms/step"
             + ("  experts w+opt/device" if moe else "")]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['variant']:<23} {row['error']}")
            continue
        p = row["planned_per_device"]
        peak = max(row["peak_rss_per_client"])
        planned = row["planned_per_client"]
        ratio = f"{(peak - base) / planned:8.2f}x" if base and planned else "        -"
        ms = f"{row['ms_per_step']:8.1f}" if row["ms_per_step"] else "       -"
        lines.append(
            f"{row['variant']:<23} {_mib(p.get('weights', 0) + p.get('optimizer', 0))}, "
            f"{_mib(p.get('gradients', 0))}, {_mib(p.get('gathered', p.get('gathered_in_step', 0)))}"
            f", {_mib(p.get('activations', 0))}          {_mib(planned)}        {_mib(peak)}"
            f"       {_mib(peak - base) if base else '       -'}     {ratio}  {ms}"
            + (f"  {_mib(p['experts'])}" if "experts" in p else ""))
    return "\n".join(lines)


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=2048, help="LM model width")
    parser.add_argument("--layers", type=int, default=4, help="LM transformer blocks")
    parser.add_argument("--seq_len", type=int, default=32, help="LM bytes per window")
    parser.add_argument("--heads", type=int, default=8, help="LM attention heads")
    parser.add_argument("--global_batch_size", type=int, default=8,
                        help="windows (or recsys examples) per step, all clients together")
    parser.add_argument("--block_size", type=int, default=None,
                        help="keys per block of blockwise attention (train_lm.py's --block_size; "
                             "default: its default)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per variant")
    parser.add_argument("--num_clients", type=int, default=4,
                        help="client processes per run (python -m dtk.cluster.launch)")
    parser.add_argument("--devices_per_client", type=int, default=2,
                        help="virtual CPUs per client")
    parser.add_argument("--baseline_dim", type=int, default=128,
                        help="the baseline row's --dim (the fixed cost a variant's peak is "
                        "measured over)")
    parser.add_argument("--baseline_variant", default="tp", help="the baseline's variant (its "
                        "mesh must suit --heads: tp needs heads divisible by 8)")
    parser.add_argument("--baseline_seq_len", type=int, help="the baseline's --seq_len "
                        "(default --seq_len; long contexts: a short one, the fixed cost)")
    parser.add_argument("--variants", help="comma-separated (default: every variant of the "
                        "workload)")
    parser.add_argument("--workload", choices=("lm", "recsys", "moe"), default="lm",
                        help="lm: scripts/train_lm.py; recsys: scripts/train_recsys.py; moe: "
                        "train_lm.py --moe_experts")
    parser.add_argument("--moe_experts", type=int, default=8, help="moe: experts per block")
    parser.add_argument("--moe_group_size", type=int, default=32,
                        help="moe: positions routed together (train_lm.py's --moe_group_size)")
    parser.add_argument("--table_sizes", default="8388608,4096,256,16",
                        help="recsys: the tables' rows")
    parser.add_argument("--baseline_table_sizes", default="1024,256,64,16",
                        help="recsys: the baseline's tables (the fixed cost)")
    parser.add_argument("--table_dim", type=int, default=16, help="recsys: the tables' dim")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.workload == "recsys":
        return _recsys(args)
    variants = MOE_VARIANTS if args.workload == "moe" else VARIANTS
    if args.workload == "moe" and args.baseline_variant == "tp":
        args.baseline_variant = "moe_expert8"
    names = [v for v in (args.variants or ",".join(variants)).split(",") if v]
    unknown = [v for v in names if v not in variants]
    if unknown:
        print(f"error: unknown variants {unknown}; choose from {list(variants)}", file=sys.stderr)
        return 2
    planned = planned_memory(args, names)
    seq_len = args.seq_len
    args.seq_len = args.baseline_seq_len or seq_len
    baseline = run_variant(args.baseline_variant, variants[args.baseline_variant], args,
                           args.baseline_dim, args.timeout)
    args.seq_len = seq_len
    baseline["variant"] = f"baseline (dim {args.baseline_dim}, {args.baseline_variant})"
    return _measure(args, variants, names, baseline, args.dim, planned)


def _measure(args, variants: dict, names: list[str], baseline: dict, dim: int,
             planned: dict | None = None) -> int:
    """Runs each variant after the baseline, printing its row as it ends, then the table
    (the plan's figures: ``planned``, else the run's own summary)."""
    baseline["planned_per_client"] = 0
    print(table([baseline], None), flush=True)
    rows = []
    for name in names:
        rows.append(run_variant(name, variants[name], args, dim, args.timeout))
        if planned and "error" not in rows[-1]:
            rows[-1]["planned_per_device"] = planned[name]
            rows[-1]["planned_per_client"] = planned[name]["total"] * args.devices_per_client
        print(table([rows[-1]], baseline).splitlines()[-1], flush=True)
    print("\n" + table([baseline, *rows], baseline))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "baseline": baseline, "rows": rows}, f, indent=1)
    return 0


def _recsys(args) -> int:
    """The recommender: each variant's peak RSS per client against its tables' planned share
    (weights + optimizer state per device, from the run's own plan), over a baseline with small
    tables. The global batch defaults to 1,024 here."""
    if args.global_batch_size == 8:  # the LM's default
        args.global_batch_size = 1024
    names = [v for v in (args.variants or ",".join(RECSYS_VARIANTS)).split(",") if v]
    unknown = [v for v in names if v not in RECSYS_VARIANTS]
    if unknown:
        print(f"error: unknown variants {unknown}; choose from {list(RECSYS_VARIANTS)}",
              file=sys.stderr)
        return 2
    baseline = run_variant("baseline", RECSYS_VARIANTS[names[0]], args, 0, args.timeout)
    baseline["variant"] = f"baseline ({args.baseline_table_sizes})"
    return _measure(args, RECSYS_VARIANTS, names, baseline, args.table_dim)


if __name__ == "__main__":
    sys.exit(main())
