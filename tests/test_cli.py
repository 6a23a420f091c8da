"""What the scripts share (dtk/cli.py): flags, output-path checks, the summary's fallback, quiet logs."""

from __future__ import annotations

import ast
import errno
import json
import re
import os
import subprocess
import sys
import tempfile

import pytest

import dtk
from dtk import cli
from dtk.cluster import launch as launch_lib
from tests import procs

SCRIPTS = ("train_mnist", "train_lm", "tune_mnist")


# -- one spelling, one meaning, one help text -----------------------------------------------------
def _flags_of(script: str) -> dict:
    """The flags a script defines (its own module's), as {name: [parser, help]}."""
    code = (f"import json, runpy, sys; sys.argv = ['{script}.py']; "
            f"runpy.run_path('scripts/{script}.py', run_name='loaded'); "
            "from absl import flags; print('FLAGS', json.dumps({n: [type(f.parser).__name__, f.help]"
            " for n, f in flags.FLAGS._flags().items()}))")  # pylint: disable=protected-access
    res = procs.run_python(code, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.split("FLAGS", 1)[1])


@pytest.fixture(scope="module")
def script_flags():
    return {s: _flags_of(s) for s in SCRIPTS}


def test_training_scripts_share_their_common_flags(script_flags):
    for name in cli.TRAINING_FLAGS:
        for script in ("train_mnist", "train_lm"):
            assert name in script_flags[script], f"{script}.py has no --{name}"
        assert script_flags["train_mnist"][name] == script_flags["train_lm"][name], name


def test_a_flag_in_several_scripts_means_one_thing(script_flags):
    seen: dict[str, tuple[str, list]] = {}
    for script, defined in script_flags.items():
        for name, spec in defined.items():
            if name in seen:
                assert spec == seen[name][1], (f"--{name}: {script}.py says {spec}, "
                                               f"{seen[name][0]}.py says {seen[name][1]}")
            else:
                seen[name] = (script, spec)
    assert "virtual_devices" in script_flags["train_lm"]


# -- output paths: checked before training --------------------------------------------------------
def _file_in_the_way(tmp_path):
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "sub")


def _a_file(path):
    path.write_text("x")
    return str(path)


def _link_loop(tmp_path, *below):
    """``tmp_path/a`` -> ``b`` -> ``a``: a symbolic link loop (and a path under it)."""
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    return str(tmp_path.joinpath("a", *below))


BAD_OUTPUTS = [  # (kind, path maker, phrase)
    ("file", lambda t: "/proc/nope/s.json", "not writable"),
    ("dir", lambda t: "/proc/nope/ckpt", "not writable"),
    ("dir", lambda t: "/proc/self", "not writable"),          # exists, read-only
    ("dir", _file_in_the_way, "is a file, where a directory should be"),
    ("file", lambda t: str(t), "is a directory"),
    ("dir", lambda t: _a_file(t / "f.txt"), "is a file; give a directory"),
    # Issue 41: a link loop, and a path under one (it was accepted, then failed with ELOOP).
    ("dir", _link_loop, "is a symbolic link to 'b', which does not exist \\(or is a link loop\\)"),
    ("dir", lambda t: _link_loop(t, "ckpt", "run1"), "cannot be created: .*/a' is a symbolic link"),
    ("file", lambda t: _link_loop(t, "s.json"), "cannot be created: .*/a' is a symbolic link"),
]


@pytest.mark.parametrize("kind, make, phrase", BAD_OUTPUTS)
def test_bad_output_paths_are_refused(tmp_path, kind, make, phrase):
    path = make(tmp_path)
    with pytest.raises(cli.UsageError, match=phrase) as err:
        cli.check_output_path("out", path, kind=kind)
    assert "--out" in str(err.value)


def test_read_only_parent_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    if os.geteuid() == 0:
        # Root writes through permission bits; a read-only mount refuses it with EACCES/EROFS,
        # which is what the probe then sees.
        real = tempfile.mkdtemp

        def refused(*args, **kwargs):
            if str(kwargs.get("dir", "")).startswith(str(ro)):
                raise PermissionError(13, "Permission denied", kwargs["dir"])
            return real(*args, **kwargs)

        monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(cli.UsageError, match="not writable"):
        cli.check_output_path("checkpoint_dir", str(ro / "a" / "b"), kind="dir")


def test_good_output_paths_leave_nothing_behind(tmp_path):
    cli.check_output_path("checkpoint_dir", str(tmp_path / "a" / "b"), kind="dir")
    cli.check_output_path("summary_json", str(tmp_path / "c" / "s.json"), kind="file")
    assert os.listdir(tmp_path) == []


def test_summary_written_elsewhere_when_the_disk_fills(tmp_path, monkeypatch, capsys):
    target = str(tmp_path / "s.json")
    real = cli.write_json

    def full_disk(path, value):
        if path == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, value)
    monkeypatch.setattr(cli, "write_json", full_disk)
    assert cli.write_summary(target, {"test_loss": 0.5}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    fallback = err.split("written to ")[1].split(" instead")[0]
    assert json.loads(open(fallback).read()) == {"test_loss": 0.5}
    os.remove(fallback)


@pytest.mark.parametrize("script, flags", [
    ("train_mnist", ["--summary_json", "/proc/nope/s.json"]),
    ("train_mnist", ["--tensorboard_dir", "/proc/nope/tb"]),
    ("train_lm", ["--export_dir", "/proc/nope/export"]),
    ("train_lm", ["--checkpoint_dir", "/proc/nope/ckpt"]),
    ("tune_mnist", ["--summary_json", "/proc/nope/t.json"]),
])
def test_scripts_refuse_bad_outputs_in_one_line(script, flags):
    res = procs.run_python(
        f"import runpy, sys; sys.argv = ['{script}.py', *sys.argv[1:]]; "
        f"runpy.run_path('scripts/{script}.py', run_name='__main__')", args=flags, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error: --"), res.stderr
    assert "Epoch" not in res.stdout


# -- quiet logs -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_lm_on_a_model_parallel_mesh_writes_nothing_to_stderr(tmp_path):
    """The README's LM command (shortened): no TensorFlow C++ lines, no Python warnings."""
    env = procs.base_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user's shell has it
    res = procs.run_python(
        "import runpy, sys; sys.argv = ['train_lm.py', *sys.argv[1:]]; "
        "runpy.run_path('scripts/train_lm.py', run_name='__main__')",
        args=("--mesh", "batch=2,model=4", "--steps", "4", "--eval_every", "2",
              "--eval_batches", "1", "--seq_len", "32", "--dim", "32", "--layers", "1",
              "--sample_bytes", "4"), timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stderr == "", res.stderr[-3000:]
    assert "held-out" in res.stdout


def test_launched_clients_start_quietly(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    config = launch_lib.LaunchConfig(num_clients=2)
    envs = launch_lib.client_envs(config, [5000, 5001], "/tmp")
    assert all(e["TF_CPP_MIN_LOG_LEVEL"] == "3" for e in envs)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")  # a user's own level is kept
    assert launch_lib.client_envs(config, [5000, 5001], "/tmp")[0]["TF_CPP_MIN_LOG_LEVEL"] == "1"
    verbose = launch_lib.LaunchConfig(num_clients=2, verbose=True)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    assert "TF_CPP_MIN_LOG_LEVEL" not in launch_lib.client_envs(verbose, [5000, 5001], "/tmp")[0]


def test_ray_workers_start_quietly_with_one_line(monkeypatch, capsys):
    dtk_ray = pytest.importorskip(
        "dtk.cluster.ray", reason="the Ray backend is optional (needs ray): pip install 'ray[train,tune]' (dtk's ray extra)")
    import logging  # pylint: disable=g-import-not-at-top
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    envs = dtk_ray.worker_envs(
        [{"host": "127.0.0.1", "port": p, "pid": 1, "gpus": 0, "tf_initialized": False}
         for p in (5000, 5001)], dtk_ray.DTensorConfig(devices_per_worker=4))
    assert all(e["TF_CPP_MIN_LOG_LEVEL"] == "3" for e in envs)
    monkeypatch.setattr(dtk_ray, "_tensorflow_initialized", lambda: False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    logger = logging.getLogger("tensorflow")
    monkeypatch.setattr(logger, "level", logger.level)
    dtk_ray._set_env(envs[1])  # pylint: disable=protected-access
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "DTensor client 1 of 2, with 4 virtual CPU devices" in out
    assert logger.level == logging.WARNING


def test_bad_launch_timeouts_are_refused():
    for value in (float("nan"), float("inf"), 0.0, -5.0):
        with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive, finite"):
            launch_lib.LaunchConfig(num_clients=2, heartbeat_timeout_s=value)



def test_a_client_whose_peer_died_says_one_line(monkeypatch, capsys):
    """The survivor of a killed peer: one error line naming the peer, exit 1, no traceback."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(cluster, "num_clients", lambda: 2)
    monkeypatch.setattr(cluster, "client_id", lambda: 0)

    def lost():
        raise tf.errors.UnavailableError(
            None, None, "2 root error(s) found.\n  (0) UNAVAILABLE: failed to connect to all "
            "addresses; last error: Connection refused /job:worker/replica:0/task:1\n  (1) ...")
    status, _ = cli.run_reporting_errors(lost)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1, err
    assert err[0].startswith("error: client 0 lost contact with client 1 (UnavailableError: "
                             "UNAVAILABLE: failed to connect"), err

    def other():
        raise tf.errors.InvalidArgumentError(None, None, "a bug, not a peer")
    with pytest.raises(tf.errors.InvalidArgumentError):  # anything else keeps its traceback
        cli.run_reporting_errors(other)


def test_failed_save_names_its_cause():
    from dtk.errors import first_line  # pylint: disable=g-import-not-at-top
    e = RuntimeError("RESOURCE_EXHAUSTED: 2 root error(s) found.\n  (0) RESOURCE_EXHAUSTED: "
                     "{{function_node __inference_save_fn_3}} /ckpt/ckpt-47_temp/part-0.data; No "
                     "space left on device\n  (1) RESOURCE_EXHAUSTED: ...")
    assert first_line(e) == "RESOURCE_EXHAUSTED: /ckpt/ckpt-47_temp/part-0.data; No space left on device"


_SCRIPT_START = (
    "import os, sys\n"
    "from dtk import cli\n"
    "cli.setup_output(verbose=False)\n"
    "print(os.environ.get('TF_USE_LEGACY_KERAS'), 'keras' in sys.modules, "
    "'tensorflow' in sys.modules)\n")


@pytest.mark.parametrize("given, want", [(None, "1 False True"), ("0", "0 True True")])
def test_scripts_start_tensorflow_without_keras_3_unless_the_user_says(given, want):
    """dtk.cli.setup_output (every script's start) sets TF_USE_LEGACY_KERAS=1 when it is unset,
    so TensorFlow does not import Keras 3 (the ``keras`` package), which dtk's tf_keras models
    never use; a value the user set is kept (then TensorFlow imports Keras 3 as usual)."""
    env = {k: v for k, v in procs.base_env().items() if k != "TF_USE_LEGACY_KERAS"}
    if given is not None:
        env["TF_USE_LEGACY_KERAS"] = given
    res = subprocess.run([sys.executable, "-c", _SCRIPT_START], capture_output=True, text=True,
                         timeout=120, cwd=procs.REPO, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[-2] == want, res.stdout


def test_accelerator_check_says_cpu_only_in_one_line_and_exits_0():
    """The accelerator lane (scripts/accelerator_check.py) on a CPU-only machine: one line, 0."""
    res = subprocess.run([sys.executable, str(procs.REPO / "scripts" / "accelerator_check.py")],
                         capture_output=True, text=True, timeout=180, cwd=procs.REPO,
                         env=procs.base_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().count("\n") == 0 and "no GPU or TPU" in res.stdout, res.stdout


def test_accelerator_check_without_tensorflow_says_so_in_one_line(tmp_path):
    """A machine whose Python has no TensorFlow (the GPU machine lent on 2026-11-26): one error
    line naming the install, exit 1, no traceback."""
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'tensorflow'\")\n")
    res = subprocess.run([sys.executable, str(procs.REPO / "scripts" / "accelerator_check.py")],
                         capture_output=True, text=True, timeout=60, cwd=procs.REPO,
                         env=procs.base_env(PYTHONPATH=str(tmp_path)))
    assert res.returncode == 1, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no TensorFlow; install dtk with it first" in lines[0], lines
    assert "Traceback" not in res.stderr


def test_accelerator_check_meshes():
    import importlib.util  # pylint: disable=g-import-not-at-top
    spec = importlib.util.spec_from_file_location(
        "accelerator_check", procs.REPO / "scripts" / "accelerator_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._meshes(1) == ["batch=1"]  # pylint: disable=protected-access
    assert module._meshes(2) == ["batch=1", "batch=2", "batch=1,model=2"]  # pylint: disable=protected-access
    assert module._meshes(8) == ["batch=1", "batch=8", "batch=4,model=2"]  # pylint: disable=protected-access


# -- every command's command line (issue 57) ------------------------------------------------------
_BIN = os.path.dirname(sys.executable)
COMMANDS = [
    *[[sys.executable, os.path.join("scripts", name)]
      for name in sorted(os.listdir(os.path.join(procs.REPO, "scripts"))) if name.endswith(".py")],
    *[[os.path.join(_BIN, tool)] for tool in ("dtk-train-mnist", "dtk-train-lm",
                                             "dtk-train-recsys", "dtk-tune-mnist",
                                             "dtk-explain", "dtk-env")],
    [sys.executable, "-m", "dtk.cluster.launch"], [os.path.join(_BIN, "dtk-launch")],
]
ABSL = {"bench_checkpoint.py", "bench_input.py", "keras_io_pages.py", "keras_io_zoo.py",
        "show_mesh.py", "zoo.py",
        "train_lm.py", "train_mnist.py", "train_recsys.py", "tune_mnist.py", "dtk-train-mnist",
        "dtk-train-lm", "dtk-train-recsys", "dtk-tune-mnist"}


def _name(command):
    return os.path.basename(command[-1])


def _run(command, *args):
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120,
                          cwd=procs.REPO, env=procs.base_env())


@pytest.mark.parametrize("command", COMMANDS, ids=_name)
def test_every_command_refuses_an_unknown_flag_in_one_line(command):
    """A misspelled flag: one ``error:`` line naming it and the closest flag names, exit 2,
    before anything runs (absl's parser said ``FATAL Flags parsing error``, exit 1)."""
    required = ["--num_clients", "2"] if "launch" in _name(command) else []
    res = _run(command, *required, "--bogus_flag")
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert "--bogus_flag" in lines[0] and "Traceback" not in res.stderr
    if _name(command) in ("train_mnist.py", "dtk-train-mnist"):
        res = _run(command, "--epochz", "2")
        assert res.returncode == 2 and res.stderr.startswith(
            "error: unknown flag --epochz (did you mean --epochs?)"), res.stderr[-2000:]


@pytest.mark.parametrize("command", COMMANDS, ids=_name)
def test_every_command_helps_and_exits_0(command):
    for flag in ("--help", "--helpfull") if _name(command) in ABSL else ("--help",):
        res = _run(command, flag)
        assert res.returncode == 0, (flag, res.stderr[-2000:])
        assert "--" in res.stdout and res.stderr.strip() == "", (flag, res.stderr[-2000:])


def test_every_flag_of_every_command_has_a_help_line():
    """No flag without a description (absl shows "(no help available)"; argparse a bare name)."""
    missing = {}
    for command in COMMANDS:
        text = _run(command, "--helpfull" if _name(command) in ABSL else "--help").stdout
        if _name(command) in ABSL:
            lines = text.splitlines()
            bad = [line.strip() for i, line in enumerate(lines)
                   if line.lstrip().startswith("--") and (
                       "(no help available)" in line or line.rstrip().endswith(":") and (
                           i + 1 >= len(lines) or not lines[i + 1].startswith("    ")))]
        else:
            options = [line for line in text.split("options:", 1)[-1].splitlines()]
            bad = [line.strip() for i, line in enumerate(options)
                   if line.startswith("  --") and len(line.split()) <= 2
                   and (i + 1 >= len(options) or not options[i + 1].startswith(" " * 8))]
        if bad:
            missing[_name(command)] = bad
    assert not missing, missing


# The module paths from before dtk/ had folders (635eba8), documented or used then: each imports,
# with a DeprecationWarning naming the new path, as the module it became.
OLD_PATHS = [
    ("dtk.launch", "dtk.cluster.launch", "main"), ("dtk.ray", "dtk.cluster.ray", "DTensorTrainer"),
    ("dtk.layouts", "dtk.parallel.layouts", "explain"), ("dtk.input", "dtk.data.input", "pack"),
    ("dtk.planner", "dtk.planning.planner", "plan"),
    ("dtk.mnist", "dtk.data.mnist", "read_mnist_idx"), ("dtk.text", "dtk.data.text", "windows"),
    ("dtk.mesh", "dtk.parallel.mesh", "build_mesh"), ("dtk.fsdp", "dtk.parallel.fsdp", "schedule"),
    ("dtk.materialize", "dtk.parallel.materialize", "write_drawn"),
    ("dtk.op_support", "dtk.parallel.ops", "row_sharded_lookup"),
    ("dtk.randomness", "dtk.parallel.randomness", "adapt_layers"),
    ("dtk.remat", "dtk.parallel.remat", "__name__"),
    ("dtk.checkpoint", "dtk.train.checkpoint", "Checkpointer"),
    ("dtk.optimizers", "dtk.train.optimizers", "make_optimizer"),
    ("dtk.resume", "dtk.train.resume", "__name__"), ("dtk.steps", "dtk.train.steps", "Steps"),
    ("dtk.trainer", "dtk.train.trainer", "Trainer"),
]


def test_old_module_paths_import_with_a_deprecation_warning():
    """Every old path is listed (dtk._moved.MOVED), and each works."""
    from dtk import _moved  # pylint: disable=import-outside-toplevel
    assert sorted(old for old, _, _ in OLD_PATHS) == sorted(_moved.MOVED)
    code = ("import importlib, sys, warnings, json\n"
            "warnings.simplefilter('always')\nout = []\n"
            f"for old, new, name in {OLD_PATHS!r}:\n"
            "    with warnings.catch_warnings(record=True) as caught:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module(old)\n"
            "    out.append([old, module.__name__, hasattr(module, name),\n"
            "                [str(w.message) for w in caught if w.category is DeprecationWarning]])\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import dtk.cluster\n"
            "    f = dtk.cluster.is_lead_client\n"
            "out.append(['dtk.cluster.is_lead_client', f.__module__, True,\n"
            "            [str(w.message) for w in caught]])\n"
            "print('OUT', json.dumps(out))\n")
    res = procs.run_python(code, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.split("OUT", 1)[1])
    want = {old: new for old, new, _ in OLD_PATHS}
    want["dtk.cluster.is_lead_client"] = "dtk.cluster.env"
    for old, module, found, warned in out:
        assert module == want[old] and found, (old, module)
        assert len(warned) == 1 and f"{old} moved to {want[old]}" in warned[0], (old, warned)


def test_python_m_dtk_launch_still_runs_and_names_the_new_path():
    res = subprocess.run([sys.executable, "-m", "dtk.launch", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=procs.REPO, env=procs.base_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "python -m dtk.cluster.launch" in res.stdout
    assert "python -m dtk.launch moved to python -m dtk.cluster.launch" in res.stderr


@pytest.mark.parametrize("app", ["train_mnist", "train_lm", "train_recsys", "tune_mnist"])
def test_every_flag_a_script_defines_is_used_or_refused(app):
    """Issue 59's rule: a flag is read by the script (its own code, or dtk.cli's shared checks
    it calls) or listed in its UNUSED_FLAGS, which refuse it where given; none is dropped."""
    import re  # pylint: disable=import-outside-toplevel
    code = (f"import importlib, json; m = importlib.import_module('dtk.apps.{app}'); "
            "from absl import flags; "
            f"print('FLAGS', json.dumps([f.name for f in flags.FLAGS.get_flags_for_module("
            f"'dtk.apps.{app}')]), json.dumps(sorted(getattr(m, 'UNUSED_FLAGS', {{}}))))")
    res = procs.run_python(code, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    names, unused = _two_lists(res.stdout)
    own = (procs.REPO / "dtk" / "apps" / f"{app}.py").read_text()
    shared = (procs.REPO / "dtk" / "cli.py").read_text()
    aliases = {a for group in cli.FLAG_ALIASES.values() for a in group}
    dropped = [n for n in names if n not in unused and n not in aliases
               and not re.search(rf"FLAGS\.{n}\b|FLAGS\[\"{n}\"\]|\"{n}\"", own)
               and not re.search(rf"values\(\"{n}\"\)|flags\.{n}\b", shared)]
    assert not dropped, f"{app} defines flags it neither reads nor refuses: {dropped}"
    values = {"plot": "=plan.png", "remat": "=blocks"}  # the non-boolean ones
    for name in unused:
        res = _run([sys.executable, os.path.join("scripts", f"{app}.py")],
                   f"--{name}{values.get(name, '')}")
        assert res.returncode == 2 and f"--{name} is not used by {app}.py" in res.stderr, \
            res.stderr[-1000:]


def _two_lists(stdout: str):
    text = stdout.split("FLAGS", 1)[1].strip()
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(text)
    second, _ = decoder.raw_decode(text[end:].strip())
    return first, second


def test_help_into_a_closed_pipe_is_no_traceback_and_dtk_ray_is_an_attribute():
    """``dtk-train-recsys -h | head -3``: the reader closes the pipe early; the command's output
    goes nowhere, with no BrokenPipeError traceback (issue 70). ``import dtk;
    dtk.ray.DTensorTrainer`` works as ``import dtk.cluster.ray`` does, with no warning."""
    child = subprocess.Popen([sys.executable, str(procs.REPO / "scripts" / "train_recsys.py"),
                              "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=procs.REPO, env=procs.base_env())
    child.stdout.close()  # (before it writes: every write meets a closed pipe)
    _, err = child.communicate(timeout=120)
    assert "Traceback" not in err.decode() and "BrokenPipe" not in err.decode(), err.decode()
    done = procs.run_python("import warnings\nwarnings.simplefilter('error')\nimport dtk\n"
                            "print(dtk.ray.DTensorTrainer.__name__)\n", timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "DTensorTrainer", \
        done.stderr[-2000:]


@pytest.mark.parametrize("app", ["train_mnist", "train_lm", "train_recsys", "tune_mnist"])
def test_console_script_help_shows_its_own_name_and_no_checkout_paths(app):
    """Issue 70: ``dtk-train-mnist --help`` showed ``python scripts/train_mnist.py`` and
    ``../shared`` examples, which a wheel user does not have; ``python scripts/...`` keeps them."""
    from dtk import usage  # pylint: disable=import-outside-toplevel
    doc = ast.get_docstring(ast.parse((procs.REPO / "dtk" / "apps" / f"{app}.py").read_text()),
                            clean=False)  # (importing two apps would define their flags twice)
    program = "dtk-" + app.replace("_", "-")
    text = usage._examples_for(f"/venv/bin/{program}", doc)  # pylint: disable=protected-access
    assert f"    {program} " in text, text
    assert "python scripts/" not in text and "../shared" not in text, text
    assert usage._examples_for(f"scripts/{app}.py", doc) == doc  # pylint: disable=protected-access


_DTK_COMMANDS = [c for c in COMMANDS if _name(c) in ABSL | {"dtk-explain", "dtk-env", "dtk-launch",
                                                          "dtk.cluster.launch"}
                 and ("scripts" not in c[-1] or _name(c) in {"train_mnist.py", "train_lm.py",
                                                              "train_recsys.py", "tune_mnist.py"})]


@pytest.mark.parametrize("command", _DTK_COMMANDS, ids=_name)
def test_every_dtk_command_prints_its_version(command):
    """Issue 70: ``--version`` (as Keras's, Lightning's and Accelerate's tools answer it)."""
    res = _run(command, "--version")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"(dtk {dtk.__version__})" in res.stdout, res.stdout


def test_dtk_env_reports_versions_devices_and_the_settings_dtk_makes():
    """Issue 70: an environment report, as ``accelerate env`` / ``ray --version`` give: the
    versions, the devices, and which DTensor settings are dtk's defaults and which the user's."""
    env = procs.base_env(DTK_OFFLINE="1")
    env["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] = "1"
    env.pop("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", None)
    res = subprocess.run([os.path.join(_BIN, "dtk-env")], capture_output=True, text=True,
                         timeout=120, cwd=procs.REPO, env=env)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr[-2000:]
    out = res.stdout
    assert out.startswith(f"dtk {dtk.__version__} (")
    assert re.search(r"packages: tensorflow 2\.\d+\.\d+, tf_keras 2\.\d+", out), out
    assert "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2: you set '1'" in out
    assert "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION: dtk's 0" in out
    assert "DTK_OFFLINE=1" in out
    assert re.search(r"devices: \d+ CPU cores; TensorFlow sees 1 CPU, 0 GPU, 0 TPU", out), out
    assert "layout tables: " in out and "data_parallel" in out


def test_the_api_reference_is_what_the_code_says():
    """Issue 70: an API reference, generated from the code (``dtk.__all__``'s names, their
    signatures and docstrings): API.md must be regenerated when they change."""
    res = subprocess.run([sys.executable, "scripts/api_reference.py", "--check"],
                         capture_output=True, text=True, timeout=300, cwd=procs.REPO,
                         env=procs.base_env())
    assert res.returncode == 0, res.stderr[-2000:]
    text = (procs.REPO / "API.md").read_text()
    assert all(f"## dtk.{name}\n" in text for name in dtk.__all__ if name != "__version__")


def test_a_missing_text_file_is_named_before_tensorflow_loads():
    """Issue 70: ``--text_file`` naming no file was reported after TensorFlow's start (14 s on
    a newcomer's machine)."""
    code = ("import sys\nsys.argv = ['train_lm.py', '--text_file', '/no/such/corpus.txt']\n"
            "from dtk.apps import train_lm\ntry:\n    train_lm.entry()\n"
            "except SystemExit as e:\n    print('loaded', 'tensorflow' in sys.modules, e.code)\n")
    res = procs.run_python(code, timeout=120)
    assert res.stdout.split()[-2:] == ["False", "2"], (res.stdout, res.stderr[-2000:])
    assert "error: --text_file '/no/such/corpus.txt' is not a file" in res.stderr
