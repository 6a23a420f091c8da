"""tests/stress.py, the stress runs of issue 39's two once-seen failures, runs and reports: a few
runs of each here (the long runs and their counts: BUILD.md, "Stress runs")."""

import json
import subprocess
import sys

import pytest

from tests import procs

STRESS = str(procs.REPO / "tests" / "stress.py")


def _summary(*args, timeout):
    res = subprocess.run([sys.executable, STRESS, *args], capture_output=True, text=True,
                         timeout=timeout, env=procs.base_env(), cwd=procs.REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    return lines[:-1], lines[-1]


def test_prefetch_stress_times_every_wait_and_close():
    """Epochs closed at random points under load: every batch arrives and every close returns
    (timings are reported, never asserted: a busy machine is not a defect)."""
    runs, summary = _summary("prefetch", "--runs", "4", "--load", "1", timeout=300)
    assert len(runs) == 4 and summary["runs"] == 4
    assert summary["batches"] == sum(r["batches"] for r in runs) > 0
    assert {"max_wait_s", "max_close_s", "waits_over_10s", "closes_over_1s"} <= set(summary)


@pytest.mark.slow  # a 2-client run, killed and restarted: about 27 s
def test_restore_stress_run_resumes_like_one_process():
    """One 2-client run with the sharded update, client 1 killed at step 19 (seed 3) and the group
    restarted: the losses of one uninterrupted process."""
    runs, summary = _summary("restore", "--runs", "1", "--seed", "3", timeout=600)
    assert summary["outcomes"] == {"passed": 1}, runs
