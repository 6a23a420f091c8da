"""Bad inputs beyond train_mnist.py: the LM and Tune scripts, the launcher, DTK_* variables, the
library API. Each case's outcome class is asserted: a clear one-line error naming the input
("clear", with a phrase), or accepted and correct ("accepted").

The scripts' checks run in one subprocess per script (their absl flags would collide in one
process), every case through the script's own pre-training checks; no case trains.
"""

from __future__ import annotations

import json
import os
import math
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk import _env
from dtk.cluster import launch as launch_lib
from dtk.data import input as input_lib
from tests import procs

ACCEPTED = None  # the phrase of an accepted case

LM_CASES = [  # (flags, phrase of the one-line error, or ACCEPTED)
    (["--mesh", "batch=2,tensor=4"], "mesh axis 'tensor' of size 4 shards no weight"),
    (["--mesh", "batch=2,tensor=4", "--allow_replicated"], ACCEPTED),
    (["--mesh", "model=8"], "has no 'batch' axis"),
    (["--mesh", "batch=8"], ACCEPTED),
    (["--mesh", "batch=1,model=8"], ACCEPTED),
    (["--mesh", "batch=2,model=4", "--layout", "data_parallel"], "mesh axis 'model' of size 4"),
    (["--mesh", "batch=2,model=4", "--layout", "nope"], "--layout: layout table 'nope' is unknown"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--temperature", "0"], ACCEPTED),
    (["--sample_bytes", "-1"], "--sample_bytes must be >= 0"),
    (["--sample_bytes", "0"], ACCEPTED),
    (["--dropout", "1"], "--dropout must be in [0, 1)"),
    (["--dim", "100", "--heads", "8"], "--dim 100 is not divisible by --heads 8"),
    (["--learning_rate", "0"], "--learning_rate must be a positive, finite number"),
    (["--learning_rate", "inf"], "--learning_rate must be a positive, finite number"),
    (["--virtual_devices", "0"], "--virtual_devices must be a positive integer"),
    (["--device_memory_gb", "-1"], "--device_memory_gb must be a positive, finite number"),
    (["--device_memory_gb", "0.000001"], "does not fit the device memory budget"),
    (["--summary_json", "/proc/nope/s.json"], "is not writable"),
    (["--export_dir", "{file}/x"], "is a file, where a directory should be"),
    (["--tensorboard_dir", "{file}"], "is a file; give a directory"),
    (["--text_file", "/no/such/file"], "--text_file '/no/such/file' is not a file"),
    (["--prompt", ""], "--prompt is empty"),
    (["--seq_len", "0"], "--seq_len must be a positive integer"),
    (["--microbatches", "2", "--mesh", "batch=8", "--steps", "2"], ACCEPTED),
    (["--explain_plan", "--fsdp", "--grad_accum", "4"],
     "--explain_plan compares the planner's candidates, which choose --fsdp, --grad_accum"),
    (["--explain_plan", "--explain_layouts"], "give one of them"),
    (["--explain_plan", "--mesh", "batch=8"], "so it would ignore --mesh batch=8; drop --mesh"),
    (["--mesh", "auto", "--device", "tpu"], "--device tpu: this machine has no TPU"),
    (["--mesh", "auto", "--noshard_optimizer_state"],
     "--mesh auto chooses --noshard_optimizer_state itself"),
    # Issue 42: the plan's picture, checked before planning.
    (["--plot", "{dir}/plan.png", "--mesh", "batch=8"],
     "plan.png draws the planner's candidates: give --explain_plan or --mesh auto"),
    (["--plot", "/proc/nope/plan.png", "--explain_plan"], "is not writable"),
    (["--plot", "{dir}/plan.txt", "--explain_plan"],  # issue 70: was refused after planning
     "plan.txt: the chart is an image; name a file ending in .png, .svg or .pdf"),
    # Issue 44: sequence meshes, attention over them, blockwise attention.
    (["--mesh", "batch=2,seq=4", "--seq_len", "18"],
     "--mesh batch=2,seq=4: --seq_len 18 is not divisible by mesh axis 'seq' of size 4"),
    (["--mesh", "batch=2,seq=4", "--seq_len", "64"], ACCEPTED),
    (["--mesh", "batch=1,seq=8", "--seq_len", "64", "--global_batch_size", "1"], ACCEPTED),
    (["--mesh", "batch=2,seq=4", "--fsdp"],
     "--fsdp with the sequence sharded over mesh axis 'seq' (size 4) fails inside DTensor"),
    (["--mesh", "batch=2,seq=4", "--sequence_attention", "all_to_all", "--heads", "2",
      "--dim", "32"], "splits the heads over mesh axis 'seq' of size 4, but --heads is 2"),
    (["--mesh", "batch=2,seq=4", "--sequence_attention", "all_gather", "--heads", "2",
      "--dim", "32"], ACCEPTED),
    (["--mesh", "batch=2,seq=4", "--layout", "data_parallel"],
     "mesh axis 'seq' of size 4 shards no weight"),
    (["--mesh", "batch=2,model=4", "--seq_len", "18"],
     "--seq_len 18 is not divisible by mesh axis 'model' of size 4"),  # Megatron SP
    (["--attention", "blockwise", "--block_size", "100", "--seq_len", "128"],
     "--block_size 100 does not divide --seq_len 128"),
    (["--attention", "blockwise", "--block_size", "0"], "--block_size 0 does not divide"),
    (["--attention", "blockwise", "--block_size", "256", "--seq_len", "128"], ACCEPTED),
    # issue 59: a flag that does nothing here is refused, not ignored
    (["--attention", "mha", "--block_size", "7", "--seq_len", "32"],
     "--block_size 7 sets blockwise attention's key blocks, but --attention is 'mha'; add "
     "--attention blockwise, or drop --block_size"),
    # issue 61: pipeline stages
    (["--mesh", "stage=2,batch=4", "--microbatches", "4"], ACCEPTED),
    (["--mesh", "stage=4,batch=2", "--microbatches", "4", "--pipeline_schedule", "gpipe"],
     ACCEPTED),
    (["--mesh", "stage=2,batch=2,model=2", "--pipeline_boundaries", "block1_ln1"], ACCEPTED),
    (["--mesh", "stage=8,batch=1", "--layers", "1"],
     "--mesh stage=8,batch=1: 8 pipeline stages for model 'transformer_lm', which can be cut in "
     "7 parts at most"),
    (["--mesh", "stage=2,batch=4", "--microbatches", "3"],
     "--microbatches 3 does not divide --global_batch_size 32"),
    (["--mesh", "stage=2,batch=4", "--microbatches", "16"],
     "--global_batch_size 32 does not split into --microbatches 16 x mesh axis 'batch' of size 4"),
    (["--mesh", "stage=2,batch=4", "--pipeline_boundaries", "block1_attn"],
     "--pipeline_boundaries: pipeline boundary 'block1_attn': more than one tensor crosses"),
    (["--mesh", "stage=2,batch=4", "--pipeline_boundaries", "nope"],
     "pipeline boundary 'nope' is no layer of model 'transformer_lm'"),
    (["--mesh", "batch=8", "--pipeline_schedule", "gpipe"],
     "--pipeline_schedule set(s) a pipeline, but --mesh batch=8 has no stage axis"),
    (["--mesh", "stage=2,batch=4", "--fsdp"],
     "--fsdp with a stage axis in --mesh stage=2,batch=4: FSDP inside a stage is not supported"),
    (["--mesh", "stage=2,batch=4", "--checkpoint_dir", "{dir}/ckpt"], ACCEPTED),
    (["--mesh", "stage=2,batch=4", "--tensorboard_dir", "{dir}/tb"], ACCEPTED),
    (["--mesh", "stage=2,batch=4", "--remat", "blocks"],
     "--remat with a stage axis in --mesh stage=2,batch=4: remat inside a stage (each stage's "
     "backward already recomputes its forward) is not supported yet"),
    (["--mesh", "stage=2,model=4"], "has no 'batch' axis"),
    # issue 60: mixture of experts
    (["--mesh", "batch=2,expert=4", "--layout", "transformer_lm_moe", "--moe_experts", "8",
      "--moe_top_k", "2"], ACCEPTED),
    (["--mesh", "batch=8", "--layout", "transformer_lm_moe_batch", "--moe_experts", "8"],
     ACCEPTED),  # experts over batch
    (["--mesh", "batch=2,expert=2,model=2", "--layout", "transformer_lm_moe", "--moe_experts",
      "4", "--moe_every", "2"], ACCEPTED),
    (["--mesh", "batch=2,expert=4", "--layout", "transformer_lm_moe", "--moe_experts", "6"],
     "--moe_experts 6 is not divisible by mesh axis 'expert' (size 4), over which --layout "
     "transformer_lm_moe shards the experts; use a multiple of 4"),
    (["--mesh", "batch=8", "--layout", "transformer_lm_moe_batch", "--moe_experts", "4"],
     "--moe_experts 4 is not divisible by mesh axis 'batch' (size 8)"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "2", "--moe_top_k", "3"],
     "--moe_top_k must be 1 (Switch) or 2 (GShard); got 3"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "1", "--moe_top_k", "2"],
     "--moe_top_k 2 is more than the 1 expert(s)"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "8", "--moe_capacity_factor", "0"],
     "--moe_capacity_factor must be a finite number > 0"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "8", "--moe_capacity_factor", "-1"],
     "--moe_capacity_factor must be a finite number > 0"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "8", "--moe_capacity_factor", "inf"],
     "--moe_capacity_factor must be a finite number > 0"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "-2"], "--moe_experts must be >= 0"),
    (["--mesh", "batch=2,expert=4", "--layout", "transformer_lm_moe"],
     "mesh axis 'expert' (size 4) shards the experts of a mixture-of-experts LM, but "
     "--moe_experts is 0; add --moe_experts E"),
    (["--moe_experts", "8"], "--moe_experts 8 with --layout transformer_lm: the table has no rules "
     "for the experts (block{i}_moe.*); use --layout transformer_lm_moe"),
    (["--moe_top_k", "2"], "--moe_top_k set(s) the mixture of experts, but --moe_experts is 0"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "8", "--moe_every", "3"],
     "--moe_every 3 is more than --layers 2"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "8", "--moe_group_size", "0"],
     "--moe_group_size must be a positive integer"),
    (["--layout", "transformer_lm_moe", "--moe_experts", "8", "--moe_group_size", "48"],
     "--moe_group_size 48 does not divide --seq_len 128"),
]

TUNE_CASES = [
    (["--validation_examples", "100000"], "--validation_examples 100000 is more than half"),
    (["--validation_examples", "-5"], "--validation_examples must be a positive integer"),
    (["--validation_examples", "1000"], ACCEPTED),
    (["--num_cpus", "0"], "--num_cpus must be a positive integer"),
    (["--mesh", "batch=3"], "searched global batch sizes [64, 128, 256] are not divisible"),
    (["--mesh", "model=4"], "has no 'batch' axis"),
    (["--mesh", "stage=2,batch=4"], "which train_lm.py runs (its blocks are the stages); "
     "tune_mnist.py trains one model on every device: drop the stage axis"),
    (["--mesh", "auto"], "--mesh auto plans one training run"),
    (["--mesh", "batch=8", "--workers", "3"], "not divisible by --workers 3"),
    (["--mesh", "batch=8", "--workers", "2"], ACCEPTED),
    (["--summary_json", "{dir}"], "is a directory; give a file path"),
    (["--trials", "0"], "--trials must be a positive integer"),
    (["--dataset", "idx"], "--dataset idx needs --data_dir DIR"),
    # Issue 41: refused before Ray starts (it waited 156 s for CPUs that never came).
    (["--workers", "4", "--num_cpus", "2", "--mesh", "batch=8"],
     "--num_cpus 2 cannot hold one trial: --workers 4 takes 5 CPUs"),
    (["--storage_path", "/proc/x"], "--storage_path '/proc/x' is not writable"),
]

RECSYS_CASES = [  # train_recsys.py: every check before training (_setup), in one process
    (["--table_sizes", "100,x"], "--table_sizes must be integers"),
    (["--table_sizes", "100,1"], "--table_sizes needs one or more tables of at least 2 rows"),
    (["--table_sizes", ""], "--table_sizes needs one or more tables of at least 2 rows; got (none)"),
    (["--table_sizes", "100,-5"], "got 100,-5"),
    # the two largest tables are sharded on their rows, whatever their order (issue 59): a
    # 101-row table among larger ones stays replicated; a large one of 1001 rows cannot split
    (["--table_sizes", "101,4096,256,16"], ACCEPTED),
    (["--mesh", "stage=2,batch=4"], "train_recsys.py trains one model on every device: drop "
     "the stage axis"),
    (["--table_sizes", "4096,1001,256,16"], "table1.embeddings"),
    (["--dim", "0"], "--dim must be a positive integer; got 0"),
    (["--heldout_examples", "0"], "--heldout_examples must be a positive integer; got 0"),
    (["--max_steps", "0"], "--max_steps must be a positive integer; got 0"),  # issue 70
    (["--max_steps", "20"], ACCEPTED),
    (["--heldout_examples", "1"], "--heldout_examples 1: the held-out set has 1 click(s) and "
                                  "0 non-click(s), and its AUC needs both; hold out more"),
    (["--epochs", "0"], "--epochs must be a positive integer; got 0"),
    (["--global_batch_size", "0"], "--global_batch_size must be a positive integer; got 0"),
    (["--train_examples", "0"], "--train_examples must be a positive integer; got 0"),
    (["--data_seed", "-1"], "--data_seed: seed must be an integer in [0, 2^63); got -1"),
    (["--learning_rate", "0"], "--learning_rate must be a positive, finite number; got 0.0"),
    (["--device_memory_gb", "-1"], "--device_memory_gb must be a positive, finite number"),
    (["--summary_json", "/proc/nope/s.json"], "is not writable"),
    (["--export_dir", "{file}"], "is a file; give a directory"),
    (["--checkpoint_dir", "{file}/x"], "is a file, where a directory should be"),
    (["--mesh", "model=8"], "--mesh model=8: it has no 'batch' axis"),
    (["--mesh", "batch=3"], "dim 0 (65536) is not divisible by mesh axis 'batch' (size 3)"),
    (["--mesh", "batch=8", "--table_sizes", "1001,64"],
     "weight table0.embeddings [1001, 16]: dim 0 (1001) is not divisible by mesh axis 'batch'"),
    (["--mesh", "batch=2,seq=4"],
     "Use a table whose rules name 'seq' (shipped: transformer_lm, transformer_lm_moe_batch)"),
    (["--mesh", "batch=4,model=2", "--layout", "recsys_batch_rows"],
     "Use a table whose rules name 'model' (shipped: mlp_model_parallel, recsys,"),
    (["--mesh", "batch=1", "--virtual_devices", "8", "--table_sizes", "4194304,4096,256,16",
      "--device_memory_gb", "0.1875"],
     "does not fit the device memory budget on mesh batch=1: weights 256.3 MiB + optimizer state "
     "512.6 MiB = 768.9 MiB per device > budget 192.0 MiB"),
    # Issue 43's planner (--mesh auto, --explain_plan): flags it would not show are refused.
    (["--mesh", "auto", "--layout", "recsys"],
     "--mesh auto and --explain_plan place the tables themselves; drop --layout"),
    (["--explain_plan", "--fsdp"], "place the tables themselves; drop --fsdp"),
    (["--explain_plan", "--grad_accum", "2"], "drop --grad_accum"),
    (["--explain_plan", "--mesh", "batch=8"],
     "--explain_plan compares the planner's candidate meshes over every device, so it would "
     "ignore --mesh batch=8"),
    (["--explain_plan", "--explain_layouts"], "give one of them"),
    (["--mesh", "auto", "--device", "tpu"], "--device tpu: this machine has no TPU"),
    (["--mesh", "auto", "--table_sizes", "4194304,4096,256,16", "--device_memory_gb", "0.01"],
     "--mesh auto: no mesh of 8 devices holds the tables"),
    (["--mesh", "auto", "--global_batch_size", "1000"], ACCEPTED),
    (["--explain_plan"], ACCEPTED),
    # The mesh picks the default table: rows over `model` where the mesh has one.
    (["--mesh", "batch=4,model=2"], ACCEPTED),
    (["--mesh", "batch=4,model=2", "--sparse_tables", "--optimizer", "adagrad"], ACCEPTED),
    (["--mesh", "batch=8", "--sparse_tables"], ACCEPTED),
    (["--mesh", "batch=8", "--fsdp"], ACCEPTED),
    # issue 59: shared flags the recommender does not use are refused where given
    (["--mixed_precision"], "--mixed_precision is not used by train_recsys.py: the recommender "
     "trains in float32"),
    (["--remat", "blocks"], "--remat is not used by train_recsys.py"),
    (["--shard_optimizer_state"], "--shard_optimizer_state is not used by train_recsys.py"),
    (["--noshard_optimizer_state"], "--shard_optimizer_state is not used by train_recsys.py"),
    (["--plot", "{dir}/plan.png", "--explain_plan"],
     "--plot is not used by train_recsys.py: the tables' planner prints its candidates"),
]

_RUNNER = textwrap.dedent("""
    import importlib, json, sys, traceback
    import dtk
    dtk.configure_virtual_cpus(8)
    script, cases = sys.argv[1], json.loads(sys.argv[2])
    module = vars(importlib.import_module(f"dtk.apps.{script}"))
    FLAGS = module["FLAGS"]
    out = []
    for argv in cases:
        FLAGS.unparse_flags()
        try:
            FLAGS([f"{script}.py", *argv])
            if "_setup" in module:  # train_lm, train_recsys: every check before training
                module["_setup"]()
            else:
                module["_check_flags"](dtk)
            out.append(["accepted", ""])
        except (ValueError, TypeError) as e:
            out.append(["clear" if "\\n" not in str(e).strip() else "multi-line", str(e)])
        except Exception as e:  # noqa
            out.append(["other", traceback.format_exc()[-600:]])
    print("RESULTS", json.dumps(out))
""")


def _run_cases(script, cases, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir(exist_ok=True)
    argvs = [[a.replace("{file}", str(tmp_path / "file")).replace("{dir}", str(tmp_path / "dir"))
              for a in argv] for argv, _ in cases]
    res = procs.run_python(_RUNNER, args=(script, json.dumps(argvs)), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.split("RESULTS", 1)[1])


@pytest.mark.parametrize("script, cases", [
    pytest.param("train_lm", LM_CASES, marks=pytest.mark.slow), ("tune_mnist", TUNE_CASES),
    pytest.param("train_recsys", RECSYS_CASES, marks=pytest.mark.slow)])
def test_script_inputs(script, cases, tmp_path):
    results = _run_cases(script, cases, tmp_path)
    problems = []
    for (argv, phrase), (outcome, message) in zip(cases, results):
        want = "accepted" if phrase is ACCEPTED else "clear"
        if outcome != want or (phrase and phrase not in message):
            problems.append(f"{argv}: {outcome}: {message[:300]}")
    assert not problems, "\n".join(problems)


# -- the launcher ---------------------------------------------------------------------------------
LAUNCH_CASES = [  # argv, phrase on stderr
    (["--num_clients", "0", "--", "true"], "num_clients must be at least 1"),
    (["--num_clients", "abc", "--", "true"], "invalid int value: 'abc'"),
    (["--num_clients", "2", "--devices_per_client", "0", "--", "true"],
     "devices_per_client must be positive"),
    (["--num_clients", "2", "--max_restarts", "-1", "--", "true"], "max_restarts must be >= 0"),
    (["--num_clients", "2", "--min_clients", "3", "--", "true"],
     "min_clients must be between 1 and num_clients (2); got 3"),
    (["--num_clients", "2", "--min_clients", "0", "--", "true"],
     "min_clients must be between 1 and num_clients (2); got 0"),
    (["--num_clients", "2", "--heartbeat_timeout", "nan", "--", "true"],
     "heartbeat_timeout_s must be a positive, finite number"),
    (["--num_clients", "2", "--heartbeat_timeout", "inf", "--", "true"],
     "heartbeat_timeout_s must be a positive, finite number"),
    (["--num_clients", "2", "--heartbeat_timeout", "0", "--", "true"],
     "heartbeat_timeout_s must be a positive, finite number"),
    (["--num_clients", "2", "--start_timeout", "-5", "--", "true"],
     "start_timeout_s must be a positive, finite number"),
    (["--num_clients", "2"], "no command to launch"),
    (["--num_clients", "2", "--", "/nonexistent/cmd"], "'/nonexistent/cmd' is not an executable"),
    (["--num_clients", "2", "--network", "bogus", "--", "true"], "invalid choice: 'bogus'"),
    (["--num_clients", "2", "--colour", "red", "--", "true"], "unrecognized arguments: --colour"),
    # Issue 41: the command without '--', and an elastic floor that no restart would use.
    (["--num_clients", "2", "true"], "the command to launch goes after '--'"),
    (["--num_clients", "2", "--min_clients", "1", "--", "true"], "no restart would come"),
]


@pytest.mark.parametrize("argv, phrase", LAUNCH_CASES, ids=[" ".join(c[0][:4]) for c in LAUNCH_CASES])
def test_launcher_inputs(argv, phrase, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_lib.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err, err


# -- DTK_* variables ------------------------------------------------------------------------------
ENV_CASES = [  # variable, value, phrase (None: accepted)
    ("DTK_REGISTER_TIMEOUT_S", "abc", "is not a number of seconds"),
    ("DTK_REGISTER_TIMEOUT_S", "0", "must be a positive, finite number"),
    ("DTK_REGISTER_TIMEOUT_S", "30", None),
    ("DTK_HEARTBEAT_TIMEOUT_S", "-1", "must be a positive, finite number"),
    ("DTK_HEARTBEAT_TIMEOUT_S", "nan", "must be a positive, finite number"),
    ("DTK_HEARTBEAT_TIMEOUT_S", "inf", "must be a positive, finite number"),
    ("DTK_PORT_BASE", "abc", "is not an integer"),
    ("DTK_PORT_BASE", "70000", "is not a TCP port"),
    ("DTK_PORT_BASE", "23456", None),
    ("DTK_LAYOUTS_DIR", "/nonexistent", "is not a directory"),
    ("DTK_LAYOUTS_DIR", "{tmp}", None),
    ("DTK_OFFLINE", "maybe", "is not a boolean"),
    ("DTK_OFFLINE", "yes", None),
    ("DTK_GRAPPLER", "sometimes", "is not a boolean"),
    ("DTK_GRAPPLER", "1", None),
    ("DTK_VIRTUAL_DEVICES", "0", "must be >= 1"),
    ("DTK_VIRTUAL_DEVICES", "four", "is not an integer"),
    # Files dtk writes: checked up front; a user's file is never overwritten (issue 41).
    ("DTK_PLAN_CACHE", "{file}", "is an existing file that is not dtk's plan cache"),
    ("DTK_PLAN_CACHE", "{tmp}", "is a directory"),
    ("DTK_PLAN_CACHE", "{link}", "is a symbolic link"),
    ("DTK_PLAN_CACHE", "/proc/nope/plan.json", "is not writable"),
    ("DTK_PLAN_CACHE", "{tmp}/new/plan.json", None),
    ("DTK_PLAN_CACHE", "{cache}", None),
    ("DTK_BLAME_FILE", "/proc/nope/blame", "is not writable"),
    ("DTK_BLAME_FILE", "{tmp}/blame", None),
    ("DTK_READY_FILE", "/proc/nope/ready", "is not writable"),
    ("DTK_READY_FILE", "{tmp}", "is a directory"),
]


@pytest.mark.parametrize("name, want", [
    ("DTK_PLAN_CACH", "DTK_PLAN_CACH is set but dtk reads no such variable (did you mean "
                      "DTK_PLAN_CACHE?)"),
    ("DTK_VIRTUAL_DEVICE", "(did you mean DTK_VIRTUAL_DEVICES?)"),
    ("DTK_NONSENSE", "DTK_NONSENSE is set but dtk reads no such variable (dtk reads "
                     "DTK_VIRTUAL_DEVICES,"),
    ("DTK_REQUIRE_FULL_MNIST", None)])  # the test suite's own: known
def test_an_unknown_dtk_variable_is_named_with_the_closest(name, want, monkeypatch):
    """Issue 59: a misspelled variable was ignored without a word."""
    monkeypatch.setenv(name, "1")
    lines = [line for line in _env.unknown_names() if line.startswith(name + " ")]
    if want is None:
        assert not lines
    else:
        assert len(lines) == 1 and want in lines[0], lines
        with pytest.warns(RuntimeWarning, match=re.escape(want)):
            _env.check_all()


def test_a_script_warns_of_an_unknown_dtk_variable_in_one_line():
    res = subprocess.run([sys.executable, "scripts/train_mnist.py", "--explain_layouts"],
                         capture_output=True, text=True, timeout=120, cwd=procs.REPO,
                         env=procs.base_env(DTK_PLAN_CACH="/tmp/x"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.strip() == ("warning: DTK_PLAN_CACH is set but dtk reads no such variable "
                                  "(did you mean DTK_PLAN_CACHE?)"), res.stderr[-2000:]


def test_dtk_virtual_devices_too_few_names_the_variable():
    """Issue 59: DTK_VIRTUAL_DEVICES=4 with a mesh of 8 was told to pass --virtual_devices."""
    res = subprocess.run([sys.executable, "scripts/train_mnist.py", "--mesh", "batch=8",
                          "--explain_layouts"], capture_output=True, text=True, timeout=120,
                         cwd=procs.REPO, env=procs.base_env(DTK_VIRTUAL_DEVICES="4"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "DTK_VIRTUAL_DEVICES=4 is set in the environment (a launcher sets it per client); set " \
           "it to 8 or unset it" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("name, value, phrase", ENV_CASES)
def test_environment_variables_are_checked_whatever_the_run_reads(name, value, phrase, monkeypatch,
                                                                  tmp_path):
    (tmp_path / "notes.txt").write_text("a user's own file\n")
    (tmp_path / "plan.json").write_text('{"machine/CPU:8": {"gather_ms": 1.0}}')
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    monkeypatch.setenv(name, value.replace("{file}", str(tmp_path / "notes.txt")).replace(
        "{link}", str(tmp_path / "dangling")).replace("{cache}", str(tmp_path / "plan.json"))
        .replace("{tmp}", str(tmp_path)))
    if phrase is None:
        _env.check_all()
    else:
        with pytest.raises(ValueError, match=name) as err:
            _env.check_all()
        assert phrase in str(err.value)


def test_scripts_check_the_environment_first():
    res = procs.run_python(
        "import runpy, sys; sys.argv = ['train_mnist.py', '--explain_layouts']; "
        "runpy.run_path('scripts/train_mnist.py', run_name='__main__')",
        timeout=120, env=procs.base_env(DTK_OFFLINE="maybe"))
    assert res.returncode == 2 and res.stderr.startswith("error: DTK_OFFLINE='maybe'"), res.stderr


# -- the library API ------------------------------------------------------------------------------
def _mlp():
    return tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(8, name="h"),
                                tf_keras.layers.Dense(3, name="out")])


def _data(mesh, labels="int", n=32):
    rng = np.random.default_rng(0)
    x = rng.random((n, 4)).astype(np.float32)
    y = rng.integers(0, 3, n).astype(np.int64) if labels == "int" else (
        rng.random(n) * 3).astype(np.float32)
    if labels == "float column":  # regression targets shaped like the model's output
        y = rng.random((n, 1)).astype(np.float32)
    return input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                        input_lib.InputConfig(global_batch_size=16))


def _trainer(mesh, **kwargs):
    kwargs.setdefault("config", dtk.TrainerConfig(verbose=0, steps_per_execution=1))
    kwargs.setdefault("model", _mlp)
    return dtk.Trainer(mesh=mesh, **kwargs)


@pytest.fixture(scope="module")
def mesh():
    return dtk.build_mesh("batch=8")


@pytest.mark.parametrize("value, error", [
    ("batch=8", None), (dtk.parse_mesh_spec("batch=8"), None),
    ([0], TypeError), (None, TypeError), ({"batch": 8}, TypeError)])
def test_trainer_mesh_argument(value, error):
    if error is None:
        assert _trainer(value).mesh.dim_size("batch") == 8
    else:
        with pytest.raises(error, match="mesh must be a dtensor.Mesh"):
            _trainer(value)


def test_every_mesh_argument_takes_a_spec():
    assert dtk.make_optimizer("sgd", "batch=8")._mesh.dim_size("batch") == 8  # pylint: disable=protected-access
    model, _ = dtk.build_model(_mlp, "batch=8", "data_parallel", seed=0)
    assert dtk.global_value(model.weights[0]).shape == (4, 8)
    with pytest.raises(TypeError, match="mesh must be a dtensor.Mesh"):
        dtk.build_model(_mlp, ["batch=8"], "data_parallel", seed=0)
    with pytest.raises(TypeError, match="mesh must be a dtensor.Mesh"):
        dtk.make_optimizer("adam", None)


def test_dataset_mesh_argument():
    assert _data("batch=8").mesh.dim_size("batch") == 8
    with pytest.raises(TypeError, match="mesh must be a dtensor.Mesh"):
        _data([1])


@pytest.mark.parametrize("metrics, names", [
    ("accuracy", ["accuracy"]), (["accuracy", "top5"], ["accuracy", "top5"]), (None, ["accuracy"]),
    ([], [])])
def test_metrics_take_a_name_or_a_list(mesh, metrics, names):
    assert [m.name for m in _trainer(mesh, metrics=metrics).metrics] == names


def test_unknown_metric_names_the_metric(mesh):
    with pytest.raises(ValueError, match="metric 'nope' is unknown"):
        _trainer(mesh, metrics="nope")


def test_loss_reduction_none_is_refused(mesh):
    with pytest.raises(ValueError, match="reduction='none'"):
        _trainer(mesh, loss=tf_keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"))


def test_loss_reduction_sum_is_the_sum_over_the_global_batch(mesh):
    data = _data(mesh)
    mean = _trainer(mesh, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    summed = _trainer(mesh, loss=tf_keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum"), optimizer=dtk.make_optimizer("sgd", mesh,
                                                                         learning_rate=1e-9))
    np.testing.assert_allclose(summed.evaluate(data)["loss"], 16 * mean.evaluate(data)["loss"],
                               rtol=1e-5)


def _compiled_mlp():
    model = _mlp()
    model.compile(loss="mse", optimizer=tf_keras.optimizers.SGD(0.07), metrics=["mae"])
    return model


def test_compiled_factory_trains_with_its_compiled_settings(mesh):
    trainer = _trainer(mesh, model=_compiled_mlp)
    assert type(trainer.optimizer).__name__ == "SGD"
    np.testing.assert_allclose(dtk.global_value(trainer.optimizer.learning_rate), 0.07, rtol=1e-6)
    assert trainer.model.compiled_metrics._user_metrics == ["mae"]  # pylint: disable=protected-access
    assert trainer.loss == "mse"  # compiled as given: Keras's meaning of "mse"


def test_given_settings_win_over_compiled_ones_with_one_line(mesh, caplog):
    with caplog.at_level("INFO", logger="dtk"):
        trainer = _trainer(mesh, model=_compiled_mlp, optimizer="adam",
                           config=dtk.TrainerConfig(verbose=1, steps_per_execution=1))
    assert type(trainer.optimizer).__name__ == "Adam"
    lines = [r.getMessage() for r in caplog.records if "compiled optimizer" in r.getMessage()]
    assert len(lines) == 1 and "SGD" in lines[0], lines


def test_float_labels_with_a_sparse_loss_are_refused_before_a_step(mesh):
    trainer = _trainer(mesh)
    with pytest.raises(ValueError, match="labels are float32, but the loss is sparse"):
        trainer.fit(_data(mesh, labels="float"), epochs=1)
    assert trainer.global_step == 0


def test_float_labels_with_a_float_loss_are_accepted(mesh):
    model = lambda: tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])  # noqa
    trainer = _trainer(mesh, model=model, loss="mse", metrics=[])
    assert math.isfinite(trainer.fit(_data(mesh, labels="float column"), epochs=1
                                     ).history["loss"][0])


def test_validation_data_is_checked_before_the_first_step(mesh):
    trainer = _trainer(mesh)
    with pytest.raises(TypeError, match="data must be a dtk.DistributedDataset"):
        trainer.fit(_data(mesh), epochs=1, validation_data=tf.data.Dataset.range(3))
    assert trainer.global_step == 0


@pytest.mark.parametrize("spec, layout, allow, error", [
    ("batch=4,model=2", "data_parallel", False, "mesh axis 'model' of size 2 shards no weight"),
    ("batch=4,model=2", "data_parallel", True, None),
    ("batch=4,model=2", "mlp_model_parallel", False, "shards none"),  # rules match no weight
    ("batch=8", "data_parallel", False, None),
])
def test_idle_mesh_axes(spec, layout, allow, error):
    if error is None:
        _trainer(spec, layout=layout, allow_replicated=allow)
    else:
        with pytest.raises(ValueError, match=error):
            _trainer(spec, layout=layout, allow_replicated=allow)


def test_config_types_are_checked(mesh):
    with pytest.raises(TypeError, match="config must be a dtk.InputConfig"):
        input_lib.DistributedDataset(tf.data.Dataset.range(4), mesh, {"global_batch_size": 8})
    with pytest.raises(TypeError, match="metrics must be a name, a metric, or a list"):
        _trainer(mesh, metrics={"out": "accuracy"})


@pytest.mark.parametrize("argv, phrase", [
    (["--block_sizes", "abc"], "--block_sizes 'abc': give positive integers that divide --keys"),
    (["--block_sizes", "0"], "--block_sizes '0': give positive integers"),
    (["--block_sizes", "100", "--keys", "4096"], "that divide --keys 4096"),
    (["--skip", "--queries", "512"], "--skip needs --queries equal to --keys; got 512 and 4096"),
])
def test_attention_memory_bench_inputs(argv, phrase):
    """scripts/bench_attention_memory.py: one error line, exit status 2, before any TensorFlow."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    res = subprocess.run([sys.executable, str(procs.REPO / "scripts" / "bench_attention_memory.py"),
                          *argv], capture_output=True, text=True, timeout=60, cwd=procs.REPO)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: ") and phrase in res.stderr, res.stderr
