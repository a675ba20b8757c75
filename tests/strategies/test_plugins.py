"""Entry-point strategies (``scalelab.strategies``): a plugin never replaces a registered name, and
a broken plugin is skipped with one warning while the others load (issue 20 §2)."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import strategies
from strategies import registry
from strategies.registry import PLUGIN_GROUP, PluginWarning, load_plugins

PLUGINS = {
    # name: module source
    "good": """
        from strategies.rules.native import NativeStrategy
        from strategies.registry import register_strategy

        @register_strategy("plugin_good")
        class PluginGood(NativeStrategy):
            pass
    """,
    "impostor": """
        from strategies.rules.native import NativeStrategy
        from strategies.registry import register_strategy

        @register_strategy("plugin_first")  # registered, then rolled back with the whole plugin
        class First(NativeStrategy):
            pass

        @register_strategy("native")
        class NativeStrategy(NativeStrategy):  # the built-in's very qualname, in another module
            pass
    """,
    "sneaky": """
        from strategies import registry
        from strategies.rules.native import NativeStrategy

        class Sneaky(NativeStrategy):
            pass

        registry._REGISTRY["static"] = Sneaky  # past the decorator
    """,
    "broken": """
        raise ImportError("No module named 'missing_dependency'")
    """,
    "exits": """
        raise SystemExit(3)
    """,
}


@pytest.fixture
def fake_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install the modules of ``PLUGINS`` on ``sys.path`` and make ``entry_points`` list the given
    ones; the registry is restored afterwards."""
    for name, source in PLUGINS.items():
        (tmp_path / f"scalelab_fake_{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(registry._REGISTRY)

    def install(*names: str) -> None:
        eps = [importlib.metadata.EntryPoint(n, f"scalelab_fake_{n}", PLUGIN_GROUP) for n in names]
        monkeypatch.setattr(importlib.metadata, "entry_points",
                            lambda group=None: [ep for ep in eps if ep.group == group])

    yield install
    for name in PLUGINS:
        sys.modules.pop(f"scalelab_fake_{name}", None)  # the next test imports (and registers) afresh
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def _load() -> tuple[list[str], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_plugins()
    return loaded, [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]


def test_a_good_plugin_registers_its_strategy(fake_plugins) -> None:
    fake_plugins("good")
    loaded, warned = _load()
    assert loaded == ["good"] and warned == []
    assert strategies.create("plugin_good").name == "plugin_good"


@pytest.mark.parametrize("bad,needle", [
    ("impostor", "strategy name 'native' is already registered by strategies.rules.native.NativeStrategy"),
    ("sneaky", "it replaces the registered strategy 'static'"),
    ("broken", "ImportError: No module named 'missing_dependency'"),
    ("exits", "SystemExit: 3"),
])
def test_a_bad_plugin_is_skipped_with_one_warning_and_the_others_load(fake_plugins, bad: str, needle: str) -> None:
    native, static = strategies.get("native"), strategies.get("static")
    fake_plugins(bad, "good")
    loaded, warned = _load()
    assert loaded == ["good"]
    assert len(warned) == 1 and f"strategy plugin {bad!r}" in warned[0] and needle in warned[0], warned
    assert "\n" not in warned[0]
    # The built-ins are untouched and nothing of the skipped plugin stays registered.
    assert strategies.get("native") is native and strategies.get("static") is static
    assert "plugin_first" not in strategies.available() and "plugin_good" in strategies.available()


def test_reregistering_the_same_class_is_allowed_another_class_of_that_name_is_not() -> None:
    cls = strategies.get("native")
    assert registry.register_strategy("native")(cls) is cls  # a module reloaded registers itself again
    impostor = type(cls.__name__, (cls,), {"__module__": "somewhere_else", "__qualname__": cls.__qualname__})
    with pytest.raises(ValueError, match="already registered by strategies.rules.native"):
        registry.register_strategy("native")(impostor)
    assert strategies.get("native") is cls
