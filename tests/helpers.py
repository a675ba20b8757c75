"""Shared test helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import strategies

SYNC_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")


class HostSyncError(AssertionError):
    """A tensor was read on the host where the contract forbids it."""


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Make every Python-level host read of a tensor raise :class:`HostSyncError`.

    On the CPU nothing truly synchronises, so this is how the suite shows that ``scale``,
    ``unscale_`` and ``update`` would not synchronise on a GPU: they never ask for a value.
    """
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def make(name: str):
        def raiser(self, *args, **kwargs):
            raise HostSyncError(f"host sync: Tensor.{name}() called")

        return raiser

    try:
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, make(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def linear_output_grads(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Hooks on ``model``'s Linear layers (in order): the returned dict receives, after a
    backward, the gradient of each one's output by its index."""
    grads: dict[int, torch.Tensor] = {}

    def keep(k: int) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: grads.__setitem__(k, g))
        return hook

    for k, m in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        m.register_forward_hook(keep(k))
    return grads


def mlp(seed: int = 0, width: int = 16, depth: int = 3, d_in: int = 8, d_out: int = 4) -> torch.nn.Sequential:
    """A small deterministic MLP."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    d = d_in
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(d, width), torch.nn.Tanh()]
        d = width
    layers.append(torch.nn.Linear(d, d_out))
    return torch.nn.Sequential(*layers)


def batch(step: int, n: int = 16, d_in: int = 8, d_out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def optimizer_state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        if sa[k].keys() != sb[k].keys():
            return False
        for name in sa[k]:
            x, y = sa[k][name], sb[k][name]
            if isinstance(x, torch.Tensor):
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------- every strategy, presets included
CONF = Path(__file__).resolve().parents[1] / "conf"
PRESETS = sorted((CONF / "strategy").glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def preset_keywords(path: Path) -> tuple[str, dict]:
    """A ``conf/strategy`` YAML's rule name and the keywords it changes: its node composed and
    resolved as in the app (its rule's schema, every ``Params`` field at its default, with the
    YAML's values on top; the precision group a strategy may read: fp16), less the fields left at
    their defaults (so ``device`` may still be given, as ``make_strategy`` does)."""
    with initialize_config_dir(config_dir=str(path.parent.parent), version_base="1.3"):
        root = compose("config", overrides=[f"strategy={path.stem}", "precision=fp16"])
    cfg = OmegaConf.to_container(root.strategy, resolve=True)
    assert cfg["_target_"] == "strategies.create"
    defaults = {f.name: f.default for f in dataclasses.fields(strategies.get(cfg["name"]).Params)}
    return cfg["name"], {k: v for k, v in cfg.items() if k not in ("_target_", "name") and v != defaults.get(k)}


def strategy_cases() -> list[Any]:
    """``pytest.param(name, kwargs)`` for every registered rule (its defaults) and every preset
    YAML that is not just those defaults: the industry presets (deepspeed, megatron, none,
    te_delayed, ...) and a rule's own YAML where it resolves to other values (``<rule>_yaml``)."""
    cases = [pytest.param(n, {}, id=n) for n in strategies.available()]
    for path in PRESETS:
        name, kw = preset_keywords(path)
        if path.stem not in strategies.available():
            cases.append(pytest.param(name, kw, id=path.stem))
        elif strategies.create(name, **kw).params != strategies.create(name).params:
            cases.append(pytest.param(name, kw, id=f"{path.stem}_yaml"))
    return cases


def fp16_safe(kw: dict) -> dict:
    """``kw`` with ``init_scale`` capped at torch's default 2^16: Megatron's 2^32 overflows fp16
    activation gradients for its first ~30 steps (with hysteresis 2 each halving takes two), which
    a few-step loop that injects one overflow of its own must not confuse with it."""
    return {**kw, "init_scale": min(kw.get("init_scale", 2.0**16), 2.0**16)}


def make_strategy(name: str, kw: dict, model: torch.nn.Module | None, reference: Callable[[], torch.Tensor],
                  **overrides: Any) -> strategies.Strategy:
    """``strategies.create(name, "cpu", ...)`` set up as a training loop must: attached to
    ``model`` (per-layer rules install their hooks, probing rules take its parameters; None: not
    attached) and given the fp32 reference loss closure (``norm_ratio``, ``hybrid``); a no-op for
    the other rules."""
    s = strategies.create(name, "cpu", **{**kw, **overrides})
    if model is not None:
        s.attach(model)
    s.set_reference(reference)
    return s


# Rules that unscale in their own pass before a fused optimizer steps (per-group scales; an
# on_unscale hook that does not take still-scaled gradients): such an optimizer gets grad_scale None
# and unscaled gradients, as from GradScaler after unscale_(). The others (probes included) only read.
UNSCALES_ITSELF = {n for n in strategies.available() if strategies.get(n).per_group or (
    strategies.get(n).on_unscale is not strategies.Strategy.on_unscale and not strategies.get(n).reads_scaled)}

# Rules whose scale is fixed by definition (issue 11: "a non-finite step is skipped and S does not
# change"): where every other rule must back off, these must keep S exactly.
FIXED_SCALE = {"static"}


def assert_backed_off(name: str, after: float, before: float) -> None:
    assert after == before if name in FIXED_SCALE else after < before


def assert_overflow_reaction(s: strategies.Strategy, after: float, before: float) -> None:
    """One overflow's documented effect on S, from a full hysteresis budget: with
    ``hysteresis > 1`` (the DeepSpeed / Megatron presets) the first overflow only spends budget
    and S stays; otherwise :func:`assert_backed_off`."""
    if getattr(s.params, "hysteresis", 1) > 1:
        assert after == before
    else:
        assert_backed_off(s.name, after, before)
