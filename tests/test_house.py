"""The house rules of the production folders (issue 28; ``../shared/DESIGN.md``, "Size follows content"):

* every module declares its public surface (``__all__``);
* no file over :data:`MAX_FILE_LINES` lines: a longer one holds two things;
* no function over :data:`MAX_FUNCTION_LINES` lines (decorators and docstring included) other than
  a rule's update twin (``*_update_``), whose length is the maths;
* ``import strategies`` loads the library only: not the doctor (``strategies.doctor``), and no
  entry-point plugin (those load at the first ``available()``, ``get()`` or ``create()``).

The first three hold for every folder of :data:`FOLDERS`; add a folder there once it keeps them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("strategies",)
"""The folders the house rules hold for (experiments/ and analysis/ to follow)."""

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
EXEMPT_SUFFIX = "_update_"
"""A rule's update twin (``<rule>_update_``): its length is the maths, as in its C++ header."""


def sources() -> list[Path]:
    """Every ``.py`` file of :data:`FOLDERS` (notebooks are scripts, not modules)."""
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
            if "notebooks" not in p.relative_to(ROOT).parts]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def declares_all(tree: ast.Module) -> bool:
    """Whether the module assigns ``__all__`` at its top level."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def long_functions(tree: ast.Module) -> list[tuple[int, str, int]]:
    """(line, name, length) of every function (nested ones included) longer than the limit,
    a rule's update twin excepted; the length runs from the first decorator to the last line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.endswith(EXEMPT_SUFFIX):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                out.append((node.lineno, node.name, length))
    return out


def test_the_folders_hold_modules() -> None:
    names = {_rel(p) for p in sources()}
    assert "strategies/base.py" in names and "strategies/rules/native.py" in names


def test_every_module_declares_all() -> None:
    bad = [_rel(p) for p in sources() if not declares_all(ast.parse(p.read_text(), str(p)))]
    assert not bad, "modules without __all__ (declare their public names):\n" + "\n".join(bad)


def test_no_file_is_over_the_limit() -> None:
    sizes = {_rel(p): len(p.read_text().splitlines()) for p in sources()}
    bad = [f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_FILE_LINES]
    assert not bad, f"files over {MAX_FILE_LINES} lines (split them by content):\n" + "\n".join(bad)


def test_no_function_is_over_the_limit() -> None:
    bad = [f"{_rel(p)}:{line}: {name} ({n} lines)" for p in sources()
           for line, name, n in long_functions(ast.parse(p.read_text(), str(p)))]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (name their steps):\n" + "\n".join(bad)


def test_the_checks_see_what_they_refuse() -> None:
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def f():\n{long_body}\n\ndef rule_update_():\n{long_body}\n")
    assert [name for _, name, _ in long_functions(tree)] == ["f"]
    assert declares_all(ast.parse("__all__: list[str] = []")) and not declares_all(ast.parse("x = 1"))


_PLUGIN = textwrap.dedent("""
    import sys
    from strategies.rules.native import NativeStrategy
    from strategies.registry import register_strategy

    print("plugin loaded", file=sys.stderr)

    @register_strategy("house_plugin")
    class HousePlugin(NativeStrategy):
        pass
""")

_PROBE = textwrap.dedent("""
    import sys
    import strategies
    print(sorted(m for m in sys.modules if m.startswith("strategies.doctor")))
    print("scalelab_house_plugin" in sys.modules)
    print("house_plugin" in strategies.available(), "scalelab_house_plugin" in sys.modules)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="a dist-info folder on PYTHONPATH")
def test_import_strategies_loads_neither_the_doctor_nor_a_plugin(tmp_path: Path) -> None:
    """A real entry point (a ``.dist-info`` folder on the path): not loaded by ``import strategies``,
    loaded by the first lookup."""
    (tmp_path / "scalelab_house_plugin.py").write_text(_PLUGIN)
    info = tmp_path / "scalelab_house_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: scalelab-house-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[scalelab.strategies]\nhouse = scalelab_house_plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "SCALELAB_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doctor, loaded_at_import, after_lookup = proc.stdout.strip().splitlines()
    assert doctor == "[]", f"import strategies imported {doctor}"
    assert loaded_at_import == "False", "import strategies loaded an entry-point plugin"
    assert after_lookup == "True True", "the first available() did not load the plugin"
