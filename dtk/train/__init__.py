"""The inner and outer loops and their state: compiled steps, the fit-like trainer, mesh-aware
optimizers and metrics, checkpoints and resume.

Builds on ``dtk.data`` (batch-sharded inputs) and ``dtk.parallel`` (mesh and layouts).
"""
