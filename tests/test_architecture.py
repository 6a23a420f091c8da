"""dtk's folders import only downward (ARCHITECTURE.md), read from the code's own imports.

planning -> train -> data -> parallel -> cluster -> the top-level helpers. The front ends at the top
(``__init__``, ``cli``, ``explain_cli``) and the reference models (``models/``: they mark their
sequence dim with ``dtk.parallel.sequence`` layers) may import anything; nothing may import them back.
"""

import ast
from pathlib import Path

import pytest

DTK = Path(__file__).resolve().parent.parent / "dtk"
RANK = {"helpers": 0, "cluster": 1, "parallel": 2, "data": 3, "train": 4, "planning": 5, "front": 6}
FRONT = {"dtk", "dtk.cli", "dtk.explain_cli", "dtk.env_cli", "dtk.models"}
_MOVED = {"dtk." + p.stem for p in DTK.glob("*.py")
          if "_moved.redirect(" in p.read_text()}


def _module_name(path: Path) -> str:
    parts = path.relative_to(DTK.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    if module in FRONT or module.startswith(("dtk.apps.", "dtk.models.")) or \
            module in _MOVED:  # the applications, and the old module paths (dtk._moved)
        return "front"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else "helpers"


def _dtk_imports(path: Path) -> set[str]:
    """Every dtk module the file imports, at any depth (lazy imports inside functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "dtk"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dtk":
            # `from dtk.parallel import mesh` imports dtk.parallel.mesh; `from dtk.x import name` dtk.x.
            for a in node.names:
                candidate = f"{node.module}.{a.name}"
                exists = (DTK.parent / Path(*candidate.split("."))).with_suffix(".py").exists()
                out.add(candidate if exists else node.module)
    return out


MODULES = sorted(DTK.rglob("*.py"))


def test_every_module_lives_in_a_known_layer():
    layers = {_layer(_module_name(p)) for p in MODULES}
    assert layers == set(RANK), layers


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(DTK.parent)))
def test_imports_run_only_downward(path):
    me = _module_name(path)
    mine = RANK[_layer(me)]
    upward = sorted(dep for dep in _dtk_imports(path)
                    if _layer(dep) != _layer(me) and RANK[_layer(dep)] >= mine)
    assert not upward, f"{me} ({_layer(me)}) imports upward or sideways: {upward}"


def test_the_front_ends_are_imported_by_no_library_module():
    importers = sorted(_module_name(p) for p in MODULES
                       if _layer(_module_name(p)) != "front"
                       and {_layer(d) for d in _dtk_imports(p) if d != "dtk"} & {"front"})
    assert not importers, importers


def test_architecture_md_names_every_module():
    """Issue 70/71: ARCHITECTURE.md has one line per module; a new module must get its line."""
    text = (DTK.parent / "ARCHITECTURE.md").read_text()
    missing = []
    table = text.split("## One line per module")[1].split("\n## ")[0]
    for path in MODULES:
        short = _module_name(path).removeprefix("dtk.").replace(".", "/")
        if path.name == "__init__.py" and short != "dtk":
            continue  # a folder: the folders' table
        if f"`{'__init__' if short == 'dtk' else short}`" not in table:
            missing.append(short)
    assert not missing, f"modules without a line in ARCHITECTURE.md: {missing}"


def test_every_package_folder_ships_in_the_wheel():
    """Issue 71: a new folder (``dtk/models/``) must be in setup.cfg's ``packages``, or the
    installed wheel lacks it while the editable checkout works."""
    import configparser  # pylint: disable=g-import-not-at-top
    cfg = configparser.ConfigParser()
    cfg.read(DTK.parent / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].split(",")}
    folders = {_module_name(p) for p in DTK.rglob("__init__.py")}
    assert folders <= listed, f"package folders missing from setup.cfg: {sorted(folders - listed)}"
