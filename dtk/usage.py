"""The command line's conventions, for every dtk command (scripts, console scripts, launcher).

An unknown or malformed option is one ``error:`` line that names it, with the closest option
names, and exit status 2; ``--help`` (and absl's ``--helpfull``) print help and exit 0. absl's own
parser prints ``FATAL Flags parsing error`` and exits 1, and argparse prints its usage before
the error: neither is what README promises. Standard library only (the launcher loads no
TensorFlow); absl is imported where its flags are parsed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

_HELP_FLAGS = {"--help": True, "-h": True, "-?": True, "--helpshort": True, "--helpfull": False}


def closest(name: str, known: list[str]) -> str:
    """`` (did you mean --x, --y?)`` for the known flag names nearest ``name``, or ``""``."""
    import difflib  # pylint: disable=g-import-not-at-top
    bare = name.lstrip("-").split("=", 1)[0]
    candidates = {k.lstrip("-"): k for k in known}
    if bare.startswith("no") and bare[2:] in candidates:  # absl's --noflag of a boolean
        return ""
    near = difflib.get_close_matches(bare, list(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join('--' + n for n in near)}?)" if near else ""


def parse_flags(argv: list[str], *, module: str | None = None) -> list[str]:
    """Parses an absl script's command line with dtk's conventions; returns the arguments left.

    ``--help``, ``-h`` and ``--helpshort`` print the script's own flags (``module``: the module
    that defines them, when it is not the main module), ``--helpfull`` every flag; both exit 0.
    An unknown or malformed flag is one ``error:`` line that names it, with the closest flag
    names, and exit status 2 (absl's own parser prints ``FATAL Flags parsing error`` and exits 1).
    """
    from absl import flags  # pylint: disable=g-import-not-at-top
    values = flags.FLAGS
    options = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if "--version" in options:
        print(version_line(argv[0]))
        sys.exit(0)
    asked = [a for a in options if a in _HELP_FLAGS]
    if asked:
        doc = _examples_for(argv[0], (sys.modules.get(module) or sys.modules["__main__"]).__doc__
                            or "")
        if _HELP_FLAGS[asked[0]]:
            own = values.module_help(module) if module else values.main_module_help()
            text = f"{doc.rstrip()}\n\nflags:\n{own}\n\n(--helpfull lists every flag)"
        else:
            text = f"{doc.rstrip()}\n\nflags:\n{values.get_help()}"
        print(text.strip("\n"))
        sys.exit(0)
    try:
        return values(argv)
    except flags.UnrecognizedFlagError as e:
        name = f"--{e.flagname}" if e.flagname else str(e)
        known = [f"--{n}" for n in values]
        print(f"error: unknown flag {name}{closest(name, known)}; see --help",
              file=sys.stderr, flush=True)
    except flags.Error as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        print(f"error: {lines[0] if lines else type(e).__name__}; see --help", file=sys.stderr,
              flush=True)
    sys.exit(2)


def _examples_for(program: str, doc: str) -> str:
    """A script's help, its examples written for how it was run: a console script
    (``dtk-train-mnist``, from a wheel: no ``scripts/`` and no ``../shared`` beside it) reads
    its own name and a placeholder for the data directory."""
    import os  # pylint: disable=g-import-not-at-top
    import re  # pylint: disable=g-import-not-at-top
    name = os.path.basename(program)
    if not name or name.endswith(".py"):
        return doc
    doc = re.sub(r"python scripts/\w+\.py", name, doc)
    return re.sub(r"\.\./shared/data/(\w+)", r"/path/to/\1", doc)


def run_app(main: Callable[[list[str]], Any], *, module: str | None = None) -> None:
    """``absl.app.run(main)`` with ``parse_flags``'s conventions (the ``main`` of every script)."""
    from absl import app  # pylint: disable=g-import-not-at-top
    try:
        app.run(main, flags_parser=lambda argv: parse_flags(argv, module=module))
        _flush_stdout()
    except SystemExit:  # (--help, an error line, the run's own status)
        _flush_stdout()
        raise
    except BrokenPipeError:  # stdout closed early (`dtk-train-recsys -h | head -3`)
        _flush_stdout()
        sys.exit(1)


def _flush_stdout() -> None:
    """Flushes stdout; a reader that closed the pipe early (``| head``) is no error of the
    command: the rest of the output goes nowhere, with no traceback at exit (Python's own
    recipe, https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        import os  # pylint: disable=g-import-not-at-top
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def entry_point(main: Callable[[list[str]], Any], module: str) -> Callable[[], None]:
    """The console-script function of an application module (``dtk-train-mnist``, ...), also
    what ``python scripts/<name>.py`` calls: ``run_app(main)`` with the module's own flags in
    ``--help`` (``module``: the module's ``__name__``)."""
    return lambda: run_app(main, module=None if module == "__main__" else module)


def version_line(program: str) -> str:
    """What ``--version`` prints: the command and dtk's version (no TensorFlow loaded)."""
    import os  # pylint: disable=g-import-not-at-top
    from dtk._version import __version__  # pylint: disable=g-import-not-at-top
    return f"{os.path.basename(program) or 'dtk'} (dtk {__version__}); dtk-env reports the rest"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with dtk's conventions: a mistake is one ``error:`` line (an unknown option
    with the closest option names) and exit status 2; ``--help`` exits 0 as usual; ``--version``
    prints dtk's version."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=version_line(self.prog),
                          help="print dtk's version and exit")

    def error(self, message: str):  # type: ignore[override]
        hint = ""
        given = message.split(":", 1)[1].split() if ":" in message else []
        if message.startswith("unrecognized arguments:") and given:
            first = given[0]
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            hint = closest(first, known)
        print(f"error: {self.prog}: {message}{hint}; see --help", file=sys.stderr, flush=True)
        sys.exit(2)
