"""Import hygiene of the library, the app and the analysis (issue 23): no import circles, no
function-local imports but optional dependencies, no test module importing another.

* Every module of ``strategies/``, ``experiments/`` and ``analysis/`` imports on its own, first,
  in a fresh interpreter: a circle between two modules breaks the import of whichever comes
  first, so each is imported in isolation (a forked child of one interpreter that has loaded the
  third-party libraries and no project module; the child's ``sys.modules`` is that clean state).
* No function-level import in those folders except the optional dependencies of :data:`OPTIONAL`
  (a function-local import is how a circle hides: the module imports, and breaks on first call).
* No test module imports from another test module (``tests.<folder>.test_*``): shared fixtures
  live in the folder's ``conftest.py``, shared helpers in plain modules (``tests/helpers.py``,
  ``tests/cuda/trajectories.py``, ...).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("strategies", "experiments", "analysis")

OPTIONAL = {
    "wandb": "W&B logger and run reader: importing wandb costs about a second; runs without W&B never pay it",
    "submitit": "the submitit launcher extra (pip install .[launchers]); imported only inside a submitit job",
    "ninja": "a build tool, needed only when the kernels are compiled; its absence falls back to PATH",
    "torch.utils.cpp_extension": "imports setuptools (not a runtime dependency); needed only to build the "
                                 "kernels, whose absence falls back to plain torch",
    "lightning.pytorch": "the early warning's Lightning callback (strategies/watch/lightning.py): only its users have Lightning",
    "transformers": "the early warning's Hugging Face callback (strategies/watch/hf.py): only its users have transformers",
}
"""Imported module -> why it is imported inside a function (an optional dependency)."""

PENDING: dict[tuple[str, str], str] = {}
"""Function-level imports in files other branches own, to be fixed at their merge (then removed here:
:func:`test_pending_entries_are_still_there` fails once one is fixed)."""


def modules() -> list[str]:
    """Dotted names of every module of the three folders (notebooks are scripts, not modules)."""
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if "notebooks" in rel.parts:
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append(".".join(parts))
    return out


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement inside a function or lambda of ``path``."""
    found: list[tuple[int, str]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                base = "." * child.level + (child.module or "")
                found.extend((child.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in OPTIONAL else base)
                             for a in child.names)
            walk(child, inside)

    walk(ast.parse(path.read_text(), str(path)), False)
    return found


def test_function_level_imports_are_optional_dependencies_only() -> None:
    bad = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}:{line}: import {name}" for line, name in sorted(set(function_level_imports(path)))
                    if name not in OPTIONAL and (rel, name) not in PENDING]
    assert not bad, "function-level imports (move them to the top, or a shared helper to a lower module):\n" + \
        "\n".join(bad)


def test_pending_entries_are_still_there() -> None:
    for (rel, name), why in PENDING.items():
        assert name in [n for _, n in function_level_imports(ROOT / rel)], f"{rel} no longer imports {name} " \
            f"in a function: remove its PENDING entry ({why})"


_DRIVER = textwrap.dedent("""
    import importlib, json, os, sys, warnings
    warnings.simplefilter("ignore")
    for lib in ("numpy", "torch", "pandas", "scipy.stats", "matplotlib.pyplot", "seaborn", "omegaconf", "hydra",
                "tqdm", "torch.utils.cpp_extension"):  # the costly third-party imports, once
        importlib.import_module(lib)
    names = json.loads(sys.argv[1])
    own = [m for m in sys.modules if m.split(".")[0] in ("strategies", "experiments", "analysis")]
    assert not own, own
    failed = {}
    for name in names:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                importlib.import_module(name)
                msg = ""
            except BaseException as exc:
                msg = f"{type(exc).__name__}: {exc}"
            os.write(w, msg.encode()[:4000])
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            msg = f.read()
        os.waitpid(pid, 0)
        if msg:
            failed[name] = msg
    print(json.dumps(failed))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="needs os.fork")
def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    names = modules()
    assert "strategies.base" in names and "experiments.app.train" in names and "analysis.report" in names
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(names)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "SCALELAB_KERNELS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


def test_no_test_module_imports_another_test_module() -> None:
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""] \
                if isinstance(node, ast.ImportFrom) else []
            hits = [n for n in names if any(p.startswith("test_") for p in n.split(".")[1:])]
            if hits:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hits[0]}")
    assert not bad, "test modules importing test modules (use conftest.py or a helper module):\n" + "\n".join(bad)
