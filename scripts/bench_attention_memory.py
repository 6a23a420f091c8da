"""Memory of blockwise attention alone on one device: forward and backward, peak growth.

    python scripts/bench_attention_memory.py                      # blocks of 128 and 32
    python scripts/bench_attention_memory.py --block_sizes 128,256 --queries 4096 --skip

Each block size runs in a process of its own (peak resident memory is per process): one call of
``dtk.parallel.attention.blockwise_attention`` and its gradient in a ``tf.function`` (traced
first), ``--rows`` x ``--heads`` x ``--queries`` against ``--keys``, causal. Reported per block
size: the peak growth of the first call (what a training step's peak includes), what is still
resident after it once glibc has given freed memory back (``malloc_trim``: allocations that stay
with the function), and the peak of later calls over that. The numbers behind BUILD.md's "Long
sequences" (the backward pass's chaining, 2026-11-26).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dtk import usage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import ctypes, json, os, resource, sys, threading, time
import tensorflow as tf
from dtk.parallel import attention
block, rows, heads, dim, tq, tk, skip = json.loads(sys.argv[1])
q = tf.random.normal([rows, tq, heads, dim], seed=0)
k = tf.random.normal([rows, tk, heads, dim], seed=1)
v = tf.random.normal([rows, tk, heads, dim], seed=2)

@tf.function
def step(q, k, v):
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = attention.blockwise_attention(q, k, v, block_size=block, causal=True,
                                            skip_future=skip)
        loss = tf.reduce_sum(out * out)
    return tape.gradient(loss, [q, k, v])

page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
step.get_concrete_function(q, k, v)
before = rss()
[g.numpy() for g in step(q, k, v)]
first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
ctypes.CDLL("libc.so.6").malloc_trim(0)
held = rss()
peak, done = [held], []

def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)

watcher = threading.Thread(target=sample)
watcher.start()
for _ in range(2):
    [g.numpy() for g in step(q, k, v)]
done.append(True)
watcher.join()
print("DTK_PROBE", json.dumps({"first_call": first, "held_after": held - before,
                               "later_calls": peak[0] - held}))
"""


def main() -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block_sizes", default="128,32",
                        help="key blocks of blockwise attention to measure, comma-separated")
    parser.add_argument("--rows", type=int, default=8, help="batch rows")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--dim", type=int, default=16, help="per head")
    parser.add_argument("--queries", type=int, default=512, help="query positions")
    parser.add_argument("--keys", type=int, default=4096, help="key positions")
    parser.add_argument("--skip", action="store_true",
                        help="causal skipping (needs --queries equal to --keys)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON line a block size (bytes) instead of the table")
    args = parser.parse_args()
    try:
        blocks = [int(b) for b in args.block_sizes.split(",") if b]
    except ValueError:
        blocks = []
    problem = None
    if not blocks or any(b < 1 or args.keys % b for b in blocks):
        problem = (f"--block_sizes {args.block_sizes!r}: give positive integers that divide "
                   f"--keys {args.keys}, comma-separated (e.g. 128,32)")
    elif args.skip and args.queries != args.keys:
        problem = (f"--skip needs --queries equal to --keys; got {args.queries} and "
                   f"{args.keys}")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"blockwise attention, {args.rows} rows x {args.heads} heads of {args.dim}, "
              f"{args.queries} queries against {args.keys} keys, causal"
              f"{' (skipping)' if args.skip else ''}: MiB")
        print("block  block tensor  first call  held after it  later calls")
    for block in blocks:
        spec = [block, args.rows, args.heads, args.dim, args.queries, args.keys, args.skip]
        res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(spec)], cwd=REPO,
                             capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=REPO))
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("DTK_PROBE ")), None)
        if res.returncode or line is None:
            print(f"{block:5d}  failed: {res.stderr.strip().splitlines()[-1:]}")
            return 1
        measured = json.loads(line.split(" ", 1)[1])
        if args.json:
            print(json.dumps({"block_size": block, **measured}))
            continue
        got = {k: v / 2**20 for k, v in measured.items()}
        tensor = args.rows * args.heads * args.queries * block * 4 / 2**20
        print(f"{block:5d}  {tensor:12.2f}  {got['first_call']:10.1f}  {got['held_after']:13.1f}"
              f"  {got['later_calls']:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
