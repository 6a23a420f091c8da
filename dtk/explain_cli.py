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
        f"{name} ({what})" for name, what in _MODELS.items()))
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


# Every model of dtk's applications and what it is, for ``--help`` (which must not load
# TensorFlow). Each comes with its layout table from its spec (``dtk.models.MODEL_SPECS``).
_MODELS = {
    "mlp": "the MNIST MLP of dtk-train-mnist",
    "cnn": "dtk-train-mnist --model cnn",
    "lm": "the byte LM of dtk-train-lm, at its defaults",
    "lm_moe": "dtk-train-lm --moe_experts 8: experts over batch",
    "dlrm": "the click model of dtk-train-recsys, its default tables",
}


def _model_and_table(models, name: str):
    """``(factory, layout table)`` of ``--model name``: its spec's."""
    spec = models.MODEL_SPECS[name]
    return spec.factory, spec.layout


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
