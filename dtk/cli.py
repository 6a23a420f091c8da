"""What dtk's command-line tools share: quiet start-up, one ``error:`` line, atomic JSON output.

Used by ``scripts/train_mnist.py`` and ``scripts/train_lm.py`` (and ``dtk-explain``); library code
never calls it. Flags stay in the scripts: these functions take plain values.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from dtk import _env


class UsageError(ValueError):
    """A user error found by a script's own checks: printed as one line, exit status 2."""


def setup_output(*, verbose: bool) -> None:
    """dtk's status lines to stdout; TensorFlow's start-up lines and absl INFO hidden unless
    ``verbose`` (the user passed ``--verbosity``)."""
    if not verbose:
        from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
        absl_logging.set_verbosity(absl_logging.ERROR)
        _env.import_tensorflow_quietly()
    log = logging.getLogger("dtk")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def run_reporting_errors(run: Callable[[], Any]) -> tuple[int, Any]:
    """Calls ``run``; a ``ValueError``/``TypeError`` (dtk's user errors) becomes one ``error:``
    line on stderr and exit status 2, with no traceback. Returns ``(status, run's result)``."""
    try:
        return 0, run()
    except (ValueError, TypeError) as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        print(f"error: {lines[0] if lines else type(e).__name__}", file=sys.stderr, flush=True)
        return 2, None


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` atomically (a temp file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str], run: Callable[[], Any], *, verbose: bool,
         summary_json: str | None) -> int:
    """The ``main`` of a training script: checks argv, sets up output, runs, writes the summary.

    ``run`` returns the summary (a dict, empty when there is nothing to write); only the lead
    client writes it.
    """
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; all options are --flags (see --helpfull)",
              file=sys.stderr)
        return 2
    setup_output(verbose=verbose)
    status, summary = run_reporting_errors(run)
    if status == 0 and summary_json and summary:
        from dtk import cluster  # pylint: disable=g-import-not-at-top
        if cluster.is_lead_client():
            write_json(summary_json, summary)
    return status
