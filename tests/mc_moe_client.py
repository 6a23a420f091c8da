"""A client of issue 60's multi-client run: the MoE LM of ``tests/test_experts.py`` (8 experts,
dropout 0.1, capacity factor 1.0) for 10 steps on MC_MESH with top-k routing for each k of
MC_TOP_K (e.g. "1,2"); client 0 writes each run's losses and routing statistics to MC_OUT. Started by ``python -m
dtk.cluster.launch``, which sets the DTensor cluster variables."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtk.cluster import env as cluster  # noqa: E402
from dtk.parallel import experts  # noqa: E402
from tests import test_experts  # noqa: E402

out = {}
for k in os.environ["MC_TOP_K"].split(","):  # one process start for several runs
    model, _, losses = test_experts._run(os.environ["MC_MESH"], int(k))  # pylint: disable=protected-access
    out[k] = {"loss": losses.tolist(), "routing": experts.routing_stats(model)}
    print("DONE", k, losses.tolist(), flush=True)
if cluster.client_id() == 0:
    with open(os.environ["MC_OUT"], "w") as f:
        json.dump(out, f)
cluster.exit_process(0)
