"""Assertions about DTensors shared by the tests: layout, global value, replicated shards agree."""

from __future__ import annotations

import numpy as np
from tensorflow.experimental import dtensor

import dtk


def assert_dtensor(tensor, *, layout: dtensor.Layout | None = None, value=None, rtol=0.0,
                   atol=0.0) -> None:
    """Checks a DTensor's layout, its global value, and that shards meant to be equal are equal."""
    got = dtensor.fetch_layout(tensor)
    if layout is not None:
        assert got == layout, f"layout {got.sharding_specs} != {layout.sharding_specs}"
    if value is not None:
        np.testing.assert_allclose(dtk.global_value(tensor), np.asarray(value), rtol=rtol, atol=atol)
    # Devices that differ only along axes the tensor is not sharded on must hold equal shards.
    shards = [s.numpy() for s in dtensor.unpack(tensor)]
    mesh = got.mesh
    sharded_axes = [a for a in got.sharding_specs if a != dtensor.UNSHARDED]
    groups: dict[tuple, np.ndarray] = {}
    for shard, loc in zip(shards, mesh.local_device_locations()):
        key = tuple(loc[a] for a in sharded_axes)
        if key in groups:
            np.testing.assert_array_equal(shard, groups[key], err_msg=f"replicas differ at {loc}")
        else:
            groups[key] = shard
