"""The house rules of the production folders (issue 28; ``../shared/DESIGN.md``, "Size follows content"):

* every module declares its public surface (``__all__``);
* no file over :data:`MAX_FILE_LINES` lines: a longer one holds two things;
* no function over :data:`MAX_FUNCTION_LINES` lines (decorators and docstring included) other than
  a rule's update twin (``*_update_``), whose length is the maths;
* ``import strategies`` loads the library only: not the doctor (``strategies.doctor``), and no
  entry-point plugin (those load at the first ``available()``, ``get()`` or ``create()``);
* data flows one way (``../shared/DESIGN.md``, "Layout"): ``strategies/`` imports neither the app,
  the analysis, Hydra nor W&B; ``experiments/`` never imports ``analysis/``; ``analysis/`` reads the
  app only through its run-record schema (``experiments.schema``) and never imports torch.

The first three hold for every folder of :data:`FOLDERS`; add a folder there once it keeps them.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("strategies", "experiments", "analysis", "hydra_plugins")
"""The production folders the house rules hold for."""

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


FORBIDDEN = {
    "strategies": ("experiments", "analysis", "hydra", "omegaconf", "wandb", "hydra_plugins"),
    "experiments": ("analysis",),
    "analysis": ("torch", "strategies", "experiments", "hydra_plugins"),
}
"""Folder -> the top-level packages its modules may not import (the arrows that would run back up)."""
ALLOWED = {"analysis": ("experiments.schema",)}
"""Folder -> the modules of a forbidden package it may import all the same."""


def imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``tree``, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def back_arrows(folder: str, tree: ast.Module) -> list[tuple[int, str]]:
    """The imports of a module of ``folder`` that run against the one-way flow."""
    allowed = ALLOWED.get(folder, ())
    return [(line, name) for line, name in imported_modules(tree)
            if name.split(".")[0] in FORBIDDEN.get(folder, ())
            and not any(name == a or name.startswith(a + ".") for a in allowed)]


def test_data_flows_one_way() -> None:
    bad = []
    for folder in FORBIDDEN:
        for p in sorted((ROOT / folder).rglob("*.py")):
            if "notebooks" in p.relative_to(ROOT).parts:
                continue
            bad += [f"{_rel(p)}:{line}: imports {name}" for line, name in back_arrows(folder, ast.parse(p.read_text()))]
    assert not bad, "imports against the one-way flow of DESIGN.md:\n" + "\n".join(bad)


def test_the_flow_check_sees_a_back_arrow() -> None:
    tree = ast.parse("import torch\nfrom experiments.schema import SUMMARY_NAME\nfrom experiments.app import loop\n")
    assert back_arrows("analysis", tree) == [(1, "torch"), (3, "experiments.app.loop")]
    assert back_arrows("strategies", ast.parse("def f():\n    from analysis import report\n")) == \
        [(2, "analysis.report")]


def test_the_folders_hold_modules() -> None:
    names = {_rel(p) for p in sources()}
    assert "strategies/base.py" in names and "strategies/rules/native.py" in names


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_every_module_declares_all() -> None:
    bad = [_rel(p) for p in sources() if not declares_all(ast.parse(p.read_text(), str(p)))]
    assert not bad, "modules without __all__ (declare their public names):\n" + "\n".join(bad)


def test_all_names_only_what_the_module_defines() -> None:
    bad = []
    for path in sources():
        module = importlib.import_module(module_name(path))
        missing = [name for name in getattr(module, "__all__", []) if not hasattr(module, name)]
        if missing:
            bad.append(f"{_rel(path)}: {missing}")
    assert not bad, "__all__ names what the module lacks:\n" + "\n".join(bad)


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
