"""Choosing a plan: the planner behind ``dtk.plan`` and ``--mesh auto`` (candidates, their memory,
the calibrated cost model, the cache and ``--explain_plan``), and where a recommender's embedding
tables go (``tables``: replicated, rows or columns, by the bytes each moves).

The folder is ``planning``, not ``plan``: ``dtk.plan`` is the public function.
"""

from dtk import _env

_env.import_tensorflow_quietly()  # its load-time C++ lines hidden (a level the user set shows them)
