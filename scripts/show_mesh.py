"""Builds a mesh from --mesh and prints its one-line description (a smoke test of the install).

Example: python scripts/show_mesh.py --mesh batch=4,model=2 --device cpu --virtual_devices 8
"""

from absl import app, flags

from dtk import usage

import dtk

_MESH = flags.DEFINE_string("mesh", "batch=8", "Mesh spec: axis=size pairs, e.g. batch=4,model=2.")
_DEVICE = flags.DEFINE_enum("device", "auto", ["auto", "cpu", "gpu", "tpu"], "Device type.")
_VIRTUAL = flags.DEFINE_integer("virtual_devices", None,
                                "CPU only: logical CPUs to create (default: as many as the mesh needs).")


def main(argv):
    del argv
    try:
        mesh = dtk.build_mesh(_MESH.value, device_type=_DEVICE.value,
                              virtual_devices=_VIRTUAL.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    print(dtk.describe_mesh(mesh))


if __name__ == "__main__":
    usage.run_app(main)
