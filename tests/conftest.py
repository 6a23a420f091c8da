"""Every test process gets 8 virtual CPUs, configured before TensorFlow initializes its devices.

dtk is imported first so its DTensor settings are in force before anything is traced.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dtk  # noqa: E402  (sets DTensor's parity-safe environment before TensorFlow loads)
import tensorflow as tf  # noqa: E402

NUM_VIRTUAL_CPUS = 8

dtk.configure_virtual_cpus(NUM_VIRTUAL_CPUS)
# Initialize now, so every test sees the same 8 devices whatever runs first.
assert len(tf.config.list_logical_devices("CPU")) == NUM_VIRTUAL_CPUS
