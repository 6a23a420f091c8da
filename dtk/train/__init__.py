"""The inner and outer loops and their state: compiled steps, the fit-like trainer, mesh-aware
optimizers and metrics, checkpoints and resume.

Builds on ``dtk.data`` (batch-sharded inputs) and ``dtk.parallel`` (mesh and layouts).
"""

from dtk import _env

_env.import_tensorflow_quietly()  # its load-time C++ lines hidden (a level the user set shows them)
