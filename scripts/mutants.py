"""The one-line changes that make training wrong (issue 72), each applied alone with the test
that must catch it: `python scripts/mutants.py [--names NAME,...]` prints CAUGHT or SURVIVED for each
and restores the file. Run it from a checkout with the test extra installed."""
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from dtk.usage import ArgumentParser  # noqa: E402  (the one-line error convention)

R = pathlib.Path(__file__).resolve().parent.parent
M = [
 ("top2_first_choice_only", "dtk/parallel/experts.py", "for mask, gate in zip(masks, gates):", "for mask, gate in zip(masks[:1], gates[:1]):",
  "tests/test_references.py::test_moe_routing_equals_switch_and_gshard_written_out_in_numpy"),
 ("balance_loss_without_E", "dtk/parallel/experts.py", "self.balance_loss * e * tf.reduce_sum", "self.balance_loss * tf.reduce_sum",
  "tests/test_references.py::test_moe_routing_equals_switch_and_gshard_written_out_in_numpy"),
 ("slots_in_reverse_order", "dtk/parallel/experts.py", "tf.math.cumsum(mask, axis=2, exclusive=True)", "tf.math.cumsum(mask, axis=2, exclusive=True, reverse=True)",
  "tests/test_references.py::test_moe_routing_equals_switch_and_gshard_written_out_in_numpy"),
 ("pipeline_penalty_divided_twice", "dtk/train/pipeline.py", "for l in model.losses]) / self.config.microbatches", "for l in model.losses]) / self.config.microbatches / self.config.microbatches",
  "tests/test_references.py::test_pipelined_extra_losses_equal_plain_tf_keras"),
 ("batch_left_unsharded", "dtk/data/input.py", "    layout = dtensor.Layout([dtensor.UNSHARDED] * dim + specs, mesh)\n    per = array.shape[dim] // size",
  "    layout = dtensor.Layout([dtensor.UNSHARDED] * dim + specs, mesh)\n    layout = dtensor.Layout.replicated(mesh, array.ndim); size = 1\n    per = array.shape[dim] // size",
  "tests/test_references.py::test_a_packed_batch_is_split_over_the_batch_axis_device_by_device"),
 ("optimizer_unbound", "dtk/train/mesh_optimizer.py", "    return type(optimizer)(**config, mesh=mesh)\n", "    return type(optimizer)(**config)\n",
  "tests/test_references.py::test_distributed_adamw_with_ema_equals_plain_tf_keras"),
]
parser = ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--names", default="",
                    help="comma-separated mutants to run (default: all): " +
                    ", ".join(m[0] for m in M))
only = [n for n in parser.parse_args().names.split(",") if n]
unknown = [n for n in only if n not in {m[0] for m in M}]
if unknown:
    parser.error(f"unknown mutant(s) {unknown}")
for name, path, old, new, test in M:
    if only and name not in only:
        continue
    f = R / path; src = f.read_text()
    assert src.count(old) == 1, (name, src.count(old))
    f.write_text(src.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", test],
                           cwd=R, capture_output=True, text=True, timeout=600)
        last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l or "error" in l.lower()][-1:]
        print(f"{name}: {'CAUGHT' if r.returncode else 'SURVIVED'} ({test.split('::')[1]}) {last}", flush=True)
    finally:
        f.write_text(src)
