"""Data into batch-sharded DTensors: the input pipeline (``input``), MNIST (with a bundled sample
in ``mnist_sample/``) and the text corpus for the language model (``text``).

Builds on ``dtk.parallel`` (the mesh and its batch axis).
"""

from dtk import _env

_env.import_tensorflow_quietly()  # its load-time C++ lines hidden (a level the user set shows them)
