"""Mesh specs, mesh building on 8 virtual CPUs, descriptions, bad input, and the combine setting."""

import os
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import dtk
from dtk.parallel import mesh as mesh_lib
from tests import procs


@pytest.mark.parametrize("spec, axes", [
    ("batch=8", (("batch", 8),)),
    ("batch=4,model=2", (("batch", 4), ("model", 2))),
    (" model = 2 , batch = 4 ", (("model", 2), ("batch", 4))),
    ({"batch": 2, "model": 4}, (("batch", 2), ("model", 4))),
    ({"model": 4, "batch": 2}, (("model", 4), ("batch", 2))),
    ("x=1", (("x", 1),)),
])
def test_parse_keeps_axis_order(spec, axes):
    parsed = dtk.parse_mesh_spec(spec)
    assert parsed.axes == axes
    assert parsed.num_devices == int(np.prod([s for _, s in axes]))
    assert dtk.parse_mesh_spec(str(parsed)) == parsed


@pytest.mark.parametrize("spec, words", [
    ("", "empty"),
    ("   ", "empty"),
    ("batch8", "not of the form axis=size"),
    ("batch=", "not an integer"),
    ("batch=x", "not an integer"),
    ("batch=2.5", "not an integer"),
    ("=8", "not a valid name"),
    ("9x=8", "not a valid name"),
    ("batch=0", "has size 0"),
    ("batch=-2", "has size -2"),
    ("batch=4,batch=2", "appears twice"),
    ("batch=-1,model=-1", "more than one axis has size -1"),
    ("batch=4,,model=2", "not of the form"),
    ("batch==4", "not of the form"),
    ({}, "empty"),
    ({"batch": 0}, "has size 0"),
    ({"batch": True}, "not an integer"),
])
def test_parse_rejects_bad_specs(spec, words):
    with pytest.raises(ValueError, match=words) as err:
        dtk.parse_mesh_spec(spec)
    # Every message quotes the spec it was given.
    given = repr(spec if isinstance(spec, str) or not spec else
                 ",".join(f"{k}={v}" for k, v in spec.items()))
    assert given in str(err.value), str(err.value)


def test_parse_rejects_wrong_type():
    with pytest.raises(TypeError, match="mesh spec must be"):
        dtk.parse_mesh_spec(8)


@pytest.mark.parametrize("spec, shape", [
    ("batch=8", [8]),
    ("batch=4,model=2", [4, 2]),
    ("batch=2,model=4", [2, 4]),
    ("model=2,batch=4", [2, 4]),
    ("batch=1", [1]),
    ("batch=2,model=2", [2, 2]),
    ("batch=-1", [8]),
    ("batch=-1,model=2", [4, 2]),
    ("model=4,batch=-1", [4, 2]),
])
def test_build_mesh_shape_axes_devices(spec, shape):
    """Fixed specs; a flexible axis (-1) spans the devices that exist."""
    mesh = dtk.build_mesh(spec, device_type="cpu")
    parsed = dtk.parse_mesh_spec(spec).resolve(8)
    assert list(mesh.dim_names) == list(parsed.axis_names)
    assert [mesh.dim_size(n) for n in mesh.dim_names] == shape
    assert mesh.device_type() == "CPU"
    n = int(np.prod(shape))
    assert mesh.size == n
    indices = [tf.DeviceSpec.from_string(d).device_index for d in mesh.local_devices()]
    assert indices == list(range(n))  # the first n devices, in order
    assert mesh.local_device_ids() == list(range(n))


@pytest.mark.parametrize("spec, expected", [
    ("batch=8", "mesh batch=8: 8 CPU devices, 1 client, 8 local devices (CPU:0-7)"),
    ("batch=4,model=2", "mesh batch=4,model=2: 8 CPU devices, 1 client, 8 local devices (CPU:0-7)"),
    ("batch=2", "mesh batch=2: 2 CPU devices, 1 client, 2 local devices (CPU:0-1); "
                "uses 2 of 8 local CPU devices"),
    ("batch=1", "mesh batch=1: 1 CPU devices, 1 client, 1 local devices (CPU:0); "
                "uses 1 of 8 local CPU devices"),
])
def test_describe_mesh(spec, expected):
    assert dtk.describe_mesh(dtk.build_mesh(spec, device_type="cpu")) == expected


def test_auto_device_type_is_cpu_here():
    assert mesh_lib.resolve_device_type("auto") == "CPU"
    assert dtk.build_mesh("batch=8").device_type() == "CPU"


@pytest.mark.parametrize("spec, words", [
    ("batch=16", "needs 16 devices .* only 8 CPU device"),
    ("batch=4,model=4", "needs 16 devices"),
    ("batch=3,model=3", "needs 9 devices"),
    ("batch=-1,model=3", "8 device\\(s\\) exist, which the fixed axes \\(3 devices\\) do not divide"),
])
def test_too_many_devices(spec, words):
    with pytest.raises(ValueError, match=words) as err:
        dtk.build_mesh(spec, device_type="cpu")
    assert "virtual_devices" in str(err.value) or "-1" in spec


@pytest.mark.parametrize("device_type", ["cuda", "", "CPUS"])
def test_unknown_device_type(device_type):
    with pytest.raises(ValueError, match="is not one of auto, cpu, gpu, tpu"):
        dtk.build_mesh("batch=8", device_type=device_type)


def test_missing_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"only 0 GPU device\(s\) exist"):
        dtk.build_mesh("batch=2", device_type="gpu")


def test_virtual_devices_after_initialization():
    dtk.build_mesh("batch=8", device_type="cpu", virtual_devices=8)  # same count: fine
    with pytest.raises(ValueError, match="already initialized with 8 CPU device.*before any TensorFlow op"):
        dtk.build_mesh("batch=8", device_type="cpu", virtual_devices=16)
    with pytest.raises(ValueError, match="only applies to CPU"):
        dtk.build_mesh("batch=8", device_type="gpu", virtual_devices=8)
    with pytest.raises(ValueError, match="positive integer"):
        dtk.configure_virtual_cpus(0)


def test_combine_setting_in_force_in_this_process():
    # conftest imports dtk before TensorFlow; DTensor reads this variable at trace time.
    assert os.environ["DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"] == "0"
    assert os.environ["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] == "1"


def test_import_sets_combine_setting_and_respects_user():
    code = textwrap.dedent("""
        import os, warnings
        warnings.simplefilter("error" if os.environ.get("EXPECT_WARN") is None else "always")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import dtk
        print(os.environ["DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"])
        print(any("combine all-reduces" in str(w.message) for w in caught))
        print(os.environ.get("LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"))
    """)
    env = procs.base_env()
    env.pop("LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2", None)
    fresh = procs.run_python(code, env=env)
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.split() == ["0", "False", "1"]
    user = procs.run_python(code, env=procs.base_env(
        DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION="1", EXPECT_WARN="1",
        LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2="0"))
    assert user.returncode == 0, user.stderr
    # DTensor only checks that the gather variable exists: the user's "0" is honoured by removal.
    assert user.stdout.split() == ["1", "True", "None"]


def test_fresh_process_creates_virtual_cpus_on_demand():
    code = textwrap.dedent("""
        import dtk
        mesh = dtk.build_mesh("batch=2,model=2", device_type="cpu")
        print(dtk.describe_mesh(mesh))
        mesh6 = dtk.build_mesh("batch=6", device_type="cpu", virtual_devices=6)
    """)
    res = procs.run_python(code)
    assert res.returncode != 0
    assert "mesh batch=2,model=2: 4 CPU devices, 1 client, 4 local devices (CPU:0-3)" in res.stdout
    assert "virtual_devices=6 was requested, but TensorFlow is already initialized with 4" in res.stderr


@pytest.mark.slow
def test_two_clients_build_one_global_mesh():
    code = textwrap.dedent("""
        import dtk
        mesh = dtk.build_mesh("batch=4,model=2", device_type="cpu", virtual_devices=4)
        print("DESC", dtk.describe_mesh(mesh))
        print("IDS", mesh.local_device_ids())
    """)
    results = procs.run_clients(code, 2, timeout=120)
    for i, res in enumerate(results):
        assert res.returncode == 0, res.stderr[-3000:]
        assert (f"DESC mesh batch=4,model=2: 8 CPU devices, 2 clients, 4 local devices (CPU:0-3), "
                f"this is client {i}") in res.stdout
        assert f"IDS {list(range(4 * i, 4 * i + 4))}" in res.stdout


def test_multi_client_mesh_must_divide_over_clients(monkeypatch):
    monkeypatch.setenv("DTENSOR_JOBS", "localhost:1,localhost:2,localhost:3")
    with pytest.raises(ValueError, match="do not divide evenly over 3 clients"):
        dtk.build_mesh("batch=8", device_type="cpu")
