"""Processes, clients and schedulers: the multi-client environment (``env``), the local launcher
(``launch``, also ``dtk-launch``) and the Ray Train backend (``ray``).

Nothing here imports TensorFlow at module level: the launcher starts in milliseconds.
"""
