"""Where tensors live and how they move: the mesh, the layout tables, FSDP, remat, materialization,
mesh-invariant randomness, and dtk's equivalents of ops DTensor cannot lay out (``ops``).

Imports only ``dtk.cluster`` and the top-level helpers, never the training loop above it.
"""

from dtk import _env

_env.import_tensorflow_quietly()  # its load-time C++ lines hidden (a level the user set shows them)
