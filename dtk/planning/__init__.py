"""Choosing a plan: the planner behind ``dtk.plan`` and ``--mesh auto`` (candidates, their memory,
the calibrated cost model, the cache and ``--explain_plan``).

The folder is ``planning``, not ``plan``: ``dtk.plan`` is the public function.
"""
