"""Writes API.md, dtk's API reference, from the code: every name of ``dtk.__all__``, with its
signature, where it is defined and its docstring.

    python scripts/api_reference.py           # rewrite API.md
    python scripts/api_reference.py --check   # exit 1 when API.md is not what the code says

The test suite runs ``--check`` (``tests/test_cli.py``), so the reference cannot drift from the
code: change a public docstring or signature, then run this script.
"""

from __future__ import annotations

import inspect
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "API.md")


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    text = re.sub(r" at 0x[0-9a-f]+", "", text)  # default objects' addresses change per run
    return re.sub(r"ForwardRef\('([^']*)'\)", r"\1", text)  # postponed annotations


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.isroutine(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    return f"constant ({type(obj).__name__})"


def render() -> str:
    """API.md's text."""
    sys.path.insert(0, REPO)
    import dtk  # pylint: disable=import-outside-toplevel
    lines = ["# dtk API reference", "",
             "Generated from the code by `python scripts/api_reference.py` (the tests check that "
             "it is current). The public API is `dtk.__all__`; everything else is internal. "
             "Architecture and decisions: BUILD.md.", ""]
    names = [n for n in dtk.__all__ if n != "__version__"]
    lines.append("| name | kind | defined in |")
    lines.append("| --- | --- | --- |")
    anchors: dict[str, int] = {}
    for name in names:
        obj = getattr(dtk, name)
        where = dtk._EXPORTS.get(name) or obj.__name__  # pylint: disable=protected-access
        anchor = f"dtk{name.lower()}"
        seen = anchors.get(anchor, 0)
        anchors[anchor] = seen + 1
        anchor += f"-{seen}" if seen else ""  # (GitHub's anchors: dtk.Plan, then dtk.plan)
        lines.append(f"| [`dtk.{name}`](#{anchor}) | {_kind(obj).split(' ')[0]} | `{where}` |")
    lines.append("")
    for name in names:
        obj = getattr(dtk, name)
        lines.append(f"## dtk.{name}")
        lines.append("")
        if inspect.ismodule(obj):
            lines.append(f"module `{obj.__name__}`")
        elif inspect.isclass(obj) or inspect.isroutine(obj):
            lines.append("```python")
            lines.append(f"{'class ' if inspect.isclass(obj) else ''}dtk.{name}{_signature(obj)}")
            lines.append("```")
        else:
            lines.append(f"`dtk.{name} = {obj!r}`")
        doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isroutine(obj)
                                      or inspect.ismodule(obj)) else None
        if doc:
            lines += ["", doc.strip()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    sys.path.insert(0, REPO)
    from dtk import usage  # pylint: disable=import-outside-toplevel
    parser = usage.ArgumentParser(prog="api_reference.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when API.md is not what the code says")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                print("error: API.md is not what the code says; run python "
                      "scripts/api_reference.py", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUT}: {text.count(chr(10) + '## ')} names")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
