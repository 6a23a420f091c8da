"""Process-wide DTensor settings that must be in force before the first trace.

Why this exists: with DTensor's default "combine all-reduces" optimization, a data-parallel train
step on a batch-sharded mesh silently computes wrong updates (SGD and Adam losses 40-70% off within
5 steps; RMSprop and Adagrad diverge; see dtensor-notes.md, trap 1). Turning it off restores parity
with single-device training to float tolerance for a ~13% step-time cost. DTensor reads the variable
when a function is traced, so dtk sets it at import, before any trace, and never overrides a value
the user set on purpose (it warns instead, once, because the results will be wrong).

It also lowers DTensor all-gathers to ``CollectiveGatherV2``. By default DTensor lowers an
all-gather on CPU and GPU to an all-reduce of a zero-padded buffer of the full gathered size (see
``LowerCollectiveGatherToCollectiveGatherV2`` in DTensor's ``dtensor_utils.cc``): every device
adds eight full copies to get one. The ZeRO-style sharded update (``StepConfig(
shard_optimizer_state=True)``) all-gathers every weight after each step, so this decides whether
that option pays off. Measured in one process on 8 virtual CPUs: MNIST MLP step 19.8 ms without
the setting, 17.1 ms with it, 18.2 ms replicated; 784-1024-1024-10 at batch 1024: 341 ms without,
302 ms with, 371 ms replicated. A user's own value is respected (``0`` turns it off).
"""

import os
import warnings

COMBINE_ALL_REDUCES_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
_SAFE_VALUE = "0"
GATHER_V2_ENV = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"


def apply_safe_defaults() -> None:
    """Sets the parity-safe DTensor settings unless the user set them; warns on an unsafe value."""
    # DTensor checks only that the variable exists, so a user's "0" means off: remove it.
    if os.environ.setdefault(GATHER_V2_ENV, "1").strip().lower() in ("0", "false", ""):
        del os.environ[GATHER_V2_ENV]
    value = os.environ.setdefault(COMBINE_ALL_REDUCES_ENV, _SAFE_VALUE)
    if value.strip().lower() not in ("0", "false"):
        warnings.warn(
            f"{COMBINE_ALL_REDUCES_ENV}={value!r} is set in the environment: DTensor will combine "
            "all-reduces, which makes data-parallel optimizer updates differ from single-device "
            "training (silently wrong losses). Unset it or set it to 0 unless you are studying that "
            "bug.",
            RuntimeWarning,
            stacklevel=3,
        )


def combine_all_reduces_disabled() -> bool:
    """True when the all-reduce combining optimization is off in this process."""
    return os.environ.get(COMBINE_ALL_REDUCES_ENV, "1").strip().lower() in ("0", "false")
