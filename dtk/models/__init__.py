"""dtk's reference models, each with the spec that travels with it (``MODEL_SPECS``).

One module per model family: ``mnist`` (the MLP and the CNN, and the small transformer classifier
the layer tests use), ``lm`` (the byte-level transformer LM, dense or with experts), ``recsys``
(the DLRM-style click model). ``spec`` defines ``ModelSpec``: a factory with its layout table,
optimizer and tuned rates, input and remat blocks, as torchtitan's ``ModelSpec`` bundles a model
with its plan. ``MODEL_SPECS[name]`` is every spec by its ``--model`` name; ``MODELS[name]`` its
factory.
"""

from __future__ import annotations

from dtk.models.lm import PositionEmbedding, transformer_lm
from dtk.models.lm import SPECS as _LM
from dtk.models.mnist import IMAGE_SHAPE, NUM_CLASSES, mnist_cnn, mnist_mlp, tiny_transformer
from dtk.models.mnist import SPECS as _MNIST
from dtk.models.recsys import DotInteraction, IdColumns, dlrm
from dtk.models.recsys import SPECS as _RECSYS
from dtk.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {**_MNIST, **_LM, **_RECSYS}
MODELS = {name: spec.factory for name, spec in MODEL_SPECS.items()}

__all__ = ["DotInteraction", "IMAGE_SHAPE", "IdColumns", "MODELS", "MODEL_SPECS", "ModelSpec",
           "NUM_CLASSES", "PositionEmbedding", "dlrm", "mnist_cnn", "mnist_mlp", "tiny_transformer",
           "transformer_lm"]
