"""``dtk-explain``: where every weight of a model lives on a mesh under a layout table, and its cost.

    dtk-explain --model mlp --mesh batch=4,model=2 --layout mlp_model_parallel
    python -m dtk.explain_cli --model cnn --mesh batch=8

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
    parser.add_argument("--model", default="mlp", help="a model of dtk.models.MODEL_SPECS")
    parser.add_argument("--mesh", default="batch=8", help="mesh spec, e.g. batch=4,model=2")
    parser.add_argument("--layout", default=None,
                        help="table name or .toml path (default: the model's own table)")
    parser.add_argument("--strict", action="store_true", help="a rule matching nothing is an error")
    args = parser.parse_args(argv)
    from dtk import _env  # pylint: disable=g-import-not-at-top
    _env.import_tensorflow_quietly(always=True)
    from dtk.parallel import layouts, mesh  # pylint: disable=g-import-not-at-top
    from dtk import models  # pylint: disable=g-import-not-at-top
    try:
        if args.model not in models.MODEL_SPECS:
            raise ValueError(f"--model {args.model!r} is unknown; choose one of "
                             f"{', '.join(models.MODEL_SPECS)}")
        spec = models.MODEL_SPECS[args.model]
        mesh_spec = mesh.parse_mesh_spec(args.mesh)
        built = mesh.build_mesh(mesh_spec, device_type="cpu",
                                virtual_devices=mesh_spec.num_devices)
        plan = layouts.plan_layouts(args.layout or spec.layout, built, spec.factory,
                                    strict=args.strict, allow_replicated=True)
    except (ValueError, TypeError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print(layouts.explain(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
