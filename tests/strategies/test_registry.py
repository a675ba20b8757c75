"""The registry: create/available, unknown names, discovery of a strategy added as one file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import strategies
from strategies.registry import UnknownStrategyError, register_strategy

ROOT = Path(__file__).resolve().parents[2]


def test_create_and_available() -> None:
    names = strategies.available()
    assert "native" in names and names == sorted(names)
    s = strategies.create("native", init_scale=8.0)
    assert s.name == "native" and s.get_scale() == 8.0


def test_unknown_name_lists_available() -> None:
    with pytest.raises(UnknownStrategyError) as e:
        strategies.create("no_such_rule")
    msg = str(e.value)
    assert "no_such_rule" in msg and all(n in msg for n in strategies.available())
    assert isinstance(e.value, ValueError)


def test_duplicate_or_bad_names_rejected() -> None:
    with pytest.raises(ValueError, match="already registered"):
        @register_strategy("native")
        class Impostor(strategies.Strategy):
            pass
    with pytest.raises(ValueError, match="must match"):
        register_strategy("Bad Name")


def test_a_new_file_is_discovered_with_no_other_edit(tmp_path: Path) -> None:
    pkg = tmp_path / "strategies"
    shutil.copytree(ROOT / "strategies", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "rules" / "fixed.py").write_text(textwrap.dedent('''
        from strategies.base import Strategy
        from strategies.registry import register_strategy

        @register_strategy("fixed")
        class Fixed(Strategy):
            """A constant scale: its update never changes it."""
            def update_(self, found_inf, stats):
                pass
    '''))
    code = "import strategies; print(','.join(strategies.available())); print(strategies.create('fixed').name)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert "fixed" in lines[0].split(",") and lines[1] == "fixed"


def test_a_new_rule_gets_the_constructor_signature_of_its_own_params() -> None:
    """Declaring ``Params`` is all a rule does: its ``__init__`` shows GradScaler's parameters
    and its own fields (no hand-written list), and binds arguments against them."""
    import dataclasses
    import inspect

    from strategies.params import ScalerParams, hp
    from strategies.validation import finite_positive

    @dataclasses.dataclass
    class FixedParams(ScalerParams):
        level: float = hp(3.0, finite_positive, "test", "a rule's own field")

    class Fixed(strategies.Strategy):
        Params = FixedParams

    sig = inspect.signature(Fixed.__init__)
    assert list(sig.parameters)[:7] == ["self", "device", "init_scale", "growth_factor", "backoff_factor",
                                        "growth_interval", "enabled"]
    assert sig.parameters["level"].default == 3.0 and sig.parameters["level"].kind is inspect.Parameter.KEYWORD_ONLY
    assert Fixed(level=5.0).params.level == 5.0
    with pytest.raises(TypeError, match="unexpected keyword argument 'levle'"):
        Fixed(levle=5.0)
    # the parent's signature is its own, not the child's
    assert "level" not in inspect.signature(strategies.Strategy.__init__).parameters
