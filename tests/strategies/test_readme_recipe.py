"""The README's "Add a strategy" recipe works exactly as written.

Its Python block is registered in a fresh process, then the contract suite and the hypothesis
properties (which run over the registry) are run on it; its YAML joins a copy of the config tree,
is composed and built the way the Hydra app does (its keys and defaults from the rule's parameter
dataclass: a key the YAML does not state is overridable without ``+``). The same recipe with its
``needs_stats`` line deleted must fail the contract suite. The recipe runs under the name
:data:`NAME`, so a checkout where a user followed the README (and has an ``ema_max``) passes too.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "readme_ema_max"
"""The README's ``ema_max``, renamed here: a user's own ``strategies/rules/ema_max.py`` keeps its name."""


def recipe() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Add a strategy"):]
    section = section[: section.index("\n## ", 3)]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    yaml = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert python and yaml, "the README's 'Add a strategy' section needs a python and a yaml block"
    return python.group(1).replace("ema_max", NAME), yaml.group(1).replace("ema_max", NAME)


def run_suite(tmp_path: Path, code: str, yaml: str) -> subprocess.CompletedProcess:
    (tmp_path / "rule.py").write_text(code)
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "strategy" / f"{NAME}.yaml").write_text(yaml)
    driver = textwrap.dedent(f"""
        import runpy, sys
        import pytest
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf
        import strategies
        from experiments.app.build import build_strategy

        module = runpy.run_path({str(tmp_path / "rule.py")!r})
        name = {NAME!r}
        with initialize_config_dir(config_dir={str(conf)!r}, version_base="1.3"):  # as the app composes
            cfg = compose("config", overrides=["strategy=" + name, "strategy.growth_interval=7"])  # no +
        params = {{k: v for k, v in cfg.strategy.items() if k not in ("_target_", "name")}}
        OmegaConf.merge(OmegaConf.structured(strategies.get(name).Params), params)  # the YAML fits the schema
        s = build_strategy(cfg)
        assert s.name == name and strategies.available().count(name) == 1 and s.params.growth_interval == 7
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", "-k", name,
                              "tests/strategies/test_contract.py", "tests/strategies/test_properties.py"]))
    """)
    return subprocess.run([sys.executable, "-c", driver], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_recipe_is_short() -> None:
    code, _ = recipe()
    assert len([line for line in code.splitlines() if line.strip()]) <= 30


def test_recipe_keeps_the_house_rules_of_a_rule_module() -> None:
    """Written to strategies/rules/ as the README says, the file is checked by tests/test_house.py
    with every other module (a user following the README then runs make test): __all__ naming
    what it defines, no function over 80 lines but the update twin."""
    code, _ = recipe()
    tree = ast.parse(code)
    names = [n.value for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
             for n in node.value.elts]
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert names and set(names) <= defined, names
    assert all(node.end_lineno - node.lineno < 80 for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))


def test_recipe_passes_the_contract_suite_and_properties(tmp_path: Path) -> None:
    code, yaml = recipe()
    out = run_suite(tmp_path, code, yaml)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"\b(\d+) passed", out.stdout) and " failed" not in out.stdout


def test_recipe_without_needs_stats_fails_the_contract(tmp_path: Path) -> None:
    code, yaml = recipe()
    assert "needs_stats = True" in code
    out = run_suite(tmp_path, code.replace("needs_stats = True", "pass"), yaml)
    assert out.returncode != 0 and "failed" in out.stdout, out.stdout[-3000:]
    assert "test_trains_with_statistics_tracking_on_and_off" in out.stdout


@pytest.mark.parametrize("bad,message", [("decay=1.5", "decay must be in [0, 1), got 1.5"),
                                         ("target_max=-1.0", "target_max must be finite and > 0, got -1.0")])
def test_recipe_validates_its_parameters(tmp_path: Path, bad: str, message: str) -> None:
    code, _ = recipe()
    key, value = bad.split("=")
    check = f"""
import strategies
try:
    strategies.create({NAME!r}, {key}={value})
except ValueError as e:
    print(e)
"""
    (tmp_path / "rule.py").write_text(code + check)
    out = subprocess.run([sys.executable, str(tmp_path / "rule.py")], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == message, out.stderr[-2000:]
