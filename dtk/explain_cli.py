"""``dtk-explain``: where every weight of a model lives on a mesh under a layout table, and its cost.

    dtk-explain --model mlp --mesh batch=4,model=2 --layout mlp_model_parallel
    python -m dtk.explain_cli --model cnn --mesh batch=8
    dtk-explain --factory my_models:build --mesh batch=4,model=2 --layout mlp_model_parallel

``--factory module:function`` explains the user's own model: a tf_keras factory is planned as
above; a Keras 3 (``keras``) factory is built under Keras's distribution API on the mesh
(``dtk.distribute``: its variables are made, on virtual CPUs) and each weight's layout read back.

Plans the layouts (no DTensor variable is created, nothing trains) and prints the explainer: one
row per weight (path, shape, the rule that matched, its sharding, bytes per device), the table's
warnings, and a one-line summary. Bad input is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dtk import usage


def main(argv: Sequence[str] | None = None) -> int:
    parser = usage.ArgumentParser(prog="dtk-explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", help="one of dtk's models: " + "; ".join(
        f"{name} ({what})" for name, (_, _, what) in _MODELS.items()))
    parser.add_argument("--mesh", default="batch=8", help="mesh spec, e.g. batch=4,model=2")
    parser.add_argument("--layout", default=None,
                        help="table name or .toml path (default: the model's own table)")
    parser.add_argument("--strict", action="store_true", help="a rule matching nothing is an error")
    parser.add_argument("--factory", default=None,
                        help="module:function returning your own model (tf_keras or Keras 3); "
                        "replaces --model")
    args = parser.parse_args(argv)
    from dtk import _env  # pylint: disable=g-import-not-at-top
    _env.import_tensorflow_quietly(always=True)
    from dtk.parallel import layouts, mesh  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    from dtk.keras_check import Keras3Model  # pylint: disable=g-import-not-at-top
    try:
        if args.factory:
            factory, table = _factory(args.factory), args.layout or "data_parallel"
        elif args.model not in _MODELS:
            raise ValueError(f"--model {args.model!r} is unknown; choose one of "
                             f"{', '.join(_MODELS)}, or pass --factory module:function")
        else:
            factory, table = _model_and_table(models, args.model)
            table = args.layout or table
        mesh_spec = mesh.parse_mesh_spec(args.mesh)
        built = mesh.build_mesh(mesh_spec, device_type="cpu",
                                virtual_devices=mesh_spec.num_devices)
        try:
            text = layouts.explain(layouts.plan_layouts(table, built, factory,
                                                        strict=args.strict,
                                                        allow_replicated=True))
        except Keras3Model:
            from dtk.train import keras3  # pylint: disable=g-import-not-at-top
            text = keras3.explain(keras3.distribute_model(factory, built, layout=table,
                                                          allow_replicated=True))
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print(text)
    return 0


# Every model of dtk's applications and what it is (``--help``, which must not load
# TensorFlow). MNIST's come with their table from ``dtk.models.MODEL_SPECS``; the others with the
# table their application starts from.
_MODELS = {
    "mlp": (None, None, "the MNIST MLP of dtk-train-mnist"),
    "cnn": (None, None, "dtk-train-mnist --model cnn"),
    "lm": ("transformer_lm", "transformer_lm", "the byte LM of dtk-train-lm, at its defaults"),
    "lm_moe": ("transformer_lm:moe", "transformer_lm_moe_batch",
               "dtk-train-lm --moe_experts 8: experts over batch"),
    "dlrm": ("dlrm", "recsys_batch_rows", "the click model of dtk-train-recsys, its default "
             "tables"),
}


def _model_and_table(models, name: str):
    """``(factory, layout table)`` of ``--model name``."""
    import functools  # pylint: disable=g-import-not-at-top
    if name in models.MODEL_SPECS:
        spec = models.MODEL_SPECS[name]
        return spec.factory, spec.layout
    factory, table, _ = _MODELS[name]
    if factory == "transformer_lm:moe":
        return functools.partial(models.transformer_lm, moe_experts=8, moe_group_size=32), table
    return getattr(models, factory), table


def _factory(text: str):
    """``module:function`` imported (the current directory first, as ``python -m`` does)."""
    import importlib  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    module, _, name = text.partition(":")
    if not module or not name:
        raise ValueError(f"--factory {text!r}: give module:function, e.g. my_models:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    found = getattr(importlib.import_module(module), name, None)
    if not callable(found):
        raise ValueError(f"--factory {text!r}: module {module!r} has no function {name!r}")
    return found


if __name__ == "__main__":
    sys.exit(main())
