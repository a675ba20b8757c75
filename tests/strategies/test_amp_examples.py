"""Every pattern of PyTorch's "Automatic Mixed Precision examples" page
(``docs/source/notes/amp_examples.rst``; re-stated in seeds 001 and 002), with every registered
rule and every preset of ``conf/strategy/``, next to ``torch.amp.GradScaler``.

Each test runs the page's code twice, on two identical models fed the same batches: once with the
strategy, once with a GradScaler holding the strategy's loss-side scale of that iteration (a fresh
``GradScaler("cpu", init_scale=S)`` per iteration, so the two scale the loss by the same number
whatever the rule does with S between iterations). Both then do the same arithmetic — ``loss * S``,
backward, and the same in-place unscale (``1/S`` as ``S.double().reciprocal().float()``) — so the
unscaled gradients the optimizer sees and the parameters after it must be **bit-identical**. For
per-group rules (``layerwise`` and its presets) the gradients of group l are computed at S_l and
converted at the group boundaries by S_a/S_b: with power-of-two scales and nothing under- or
overflowing (tiny MLPs, fp32 or CPU autocast fp16 at moderate scales), every such product is exact,
so bit-identical too. A step is skipped by both or by neither.

Where a per-group rule cannot be exact (the gradient penalty divides by the one ``get_scale()``;
two models feeding two losses; a backward the strategy did not scale), the alternative is **one
clear error** — one line, ``RuntimeError``/``ValueError``, naming the strategy, raised by the
pattern's own calls. Those cases are :data:`MAY_REFUSE`; every other (rule, pattern) pair must be
exact. Each pattern runs in fp32 and under CPU autocast fp16 (the page's setting).

Patterns: typical loop; clipping after ``unscale_``; gradient
accumulation (an Inf in one micro-batch skips the whole accumulated step); gradient penalty;
several models, losses and optimizers with one scaler; custom autograd functions
(``torch.amp.custom_fwd``/``custom_bwd``); ``state_dict()`` loaded into a new scaler mid-run (which
must also continue exactly as the uninterrupted strategy); a backward the strategy did not scale.
"""

from __future__ import annotations

import io
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import strategies
from tests.helpers import assert_overflow_reaction, batch, make_strategy, mlp, strategy_cases

CASES = strategy_cases()
STEPS = 4


def per_group(name: str) -> bool:
    return strategies.get(name).per_group


def may_refuse(name: str, pattern: str) -> bool:
    """Patterns a per-group rule may refuse (one clear error) instead of running exactly."""
    return per_group(name) and pattern in MAY_REFUSE


MAY_REFUSE = {"penalty", "multiple_called_order", "multiple_other_order", "unscaled_backward"}


# ---------------------------------------------------------------------------------------- models
class _MM(torch.autograd.Function):
    """The page's custom autograd function: ``a @ b`` with ``custom_fwd``/``custom_bwd`` (backward
    runs under the forward's autocast state)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class _MM32(_MM):
    """The page's "functions that need a particular dtype": ``custom_fwd(cast_inputs=float32)``
    runs the forward in float32 with autocast off inside it."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        assert a.dtype == b.dtype == torch.float32
        ctx.save_for_backward(a, b)
        return a.mm(b)


class CustomLinear(torch.nn.Module):
    def __init__(self, d_in: int, d_out: int, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_in, d_out) / math.sqrt(d_in))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x, self.weight)


def custom_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), CustomLinear(16, 16, _MM),
                               torch.nn.Tanh(), CustomLinear(16, 4, _MM32))


class Run:
    """One side of the twin: models and their SGD-with-momentum optimizers (identical on both sides)."""

    def __init__(self, n_models: int = 1, custom: bool = False) -> None:
        self.models = [custom_model(7 + i) if custom else mlp(seed=7 + i) for i in range(n_models)]
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in self.models]

    @property
    def model(self) -> torch.nn.Module:
        return self.models[0]

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.opts[0]

    def params(self) -> list[torch.Tensor]:
        return [p for m in self.models for p in m.parameters()]

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params()]


def bit_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same values bit for bit, NaN equal to NaN (a disabled scaler steps on an Inf loss, as torch's)."""
    return x.shape == y.shape and bool((x.view(torch.int32) == y.view(torch.int32)).all())


def assert_same(a: Run, b: Run, what: str) -> None:
    """Bit-identical unscaled gradients (as the optimizer saw them), parameters and momenta."""
    for i, (p, q) in enumerate(zip(a.params(), b.params())):
        assert (p.grad is None) == (q.grad is None), f"{what}: param {i} grad presence"
        if p.grad is not None:
            assert bit_equal(p.grad, q.grad), f"{what}: param {i} gradient differs from GradScaler's " \
                f"(max abs diff {(p.grad - q.grad).abs().max().item():.3g})"
        assert bit_equal(p.detach(), q.detach()), f"{what}: param {i} differs from GradScaler's"
    for oa, ob in zip(a.opts, b.opts):
        for p, q in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"]):
            for k in oa.state[p]:
                assert bit_equal(oa.state[p][k], ob.state[q][k]), f"{what}: optimizer state {k}"


def loss_side_scale(s: Any) -> float:
    """The scale ``s.scale(loss)`` multiplies by next, read without ``get_scale()`` (which a
    per-group rule may refuse): ``state_dict()["scale"]`` is the loss side's."""
    return float(s.state_dict()["scale"]) if s.is_enabled() else 1.0


class Data:
    """The batch of the current iteration (micro-batch ``i`` of step ``k``), also what the fp32
    reference closure of ``norm_ratio``/``hybrid`` reads; and the precision of the forward passes
    (:meth:`amp`: CPU autocast to float16, or fp32)."""

    def __init__(self, autocast: bool = False) -> None:
        self.x, self.y = batch(0)
        self.autocast = autocast

    def amp(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.float16, enabled=self.autocast)

    def at(self, k: int, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.x, self.y = batch(100 * k + i)
        return self.x, self.y


# -------------------------------------------------------------------------------- the patterns
Pattern = Callable[[Any, Run, int, Data], None]


def typical(scaler: Any, r: Run, k: int, data: Data, clip: bool = False) -> None:
    """The page's typical loop; with ``clip``, its "gradient clipping" (``unscale_`` first)."""
    r.opt.zero_grad()
    x, y = data.at(k)
    with data.amp():
        loss = F.mse_loss(r.model(x), y)
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(r.opt)
        torch.nn.utils.clip_grad_norm_(r.model.parameters(), max_norm=0.05)  # small enough to act
    scaler.step(r.opt)
    scaler.update()


def clipping(scaler: Any, r: Run, k: int, data: Data) -> None:
    typical(scaler, r, k, data, clip=True)


def accumulation(poison_step: int | None) -> Pattern:
    """Two micro-batches per step; at ``poison_step`` the second one's loss is Inf. (The page
    zeroes the gradients after ``update()``; here before the first micro-batch — the same loop —
    so that the accumulated gradients the optimizer saw are still there to compare.)"""
    def run(scaler: Any, r: Run, k: int, data: Data) -> None:
        iters_to_accumulate = 2
        r.opt.zero_grad()
        for i in range(iters_to_accumulate):
            x, y = data.at(k, i)
            with data.amp():
                loss = F.mse_loss(r.model(x), y) / iters_to_accumulate
            if k == poison_step and i == 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
        scaler.step(r.opt)
        scaler.update()
    return run


def penalty(scaler: Any, r: Run, k: int, data: Data) -> None:
    r.opt.zero_grad()
    x, y = data.at(k)
    with data.amp():
        loss = F.mse_loss(r.model(x), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), list(r.model.parameters()), create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with data.amp():  # the page computes the penalty under autocast
        grad_norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + grad_norm
    scaler.scale(loss).backward()
    scaler.step(r.opt)
    scaler.update()


def multiple(scaler: Any, r: Run, k: int, data: Data) -> None:
    """Two models, two losses, two optimizers, one scaler (the page's numbers: 2, 3 and 3, -5)."""
    for o in r.opts:
        o.zero_grad()
    x, y = data.at(k)
    with data.amp():
        out0, out1 = r.models[0](x), r.models[1](x)
        loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
        loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(r.opts[0])  # the page: unscale one optimizer to inspect its gradients
    scaler.step(r.opts[0])
    scaler.step(r.opts[1])
    scaler.update()


def unscaled_backward(scaler: Any, r: Run, k: int, data: Data) -> None:
    """A gradient the loop takes for itself (e.g. a logged norm) beside the scaled backward: the
    scaler must leave it alone — it is the plain fp32 gradient of the loss."""
    r.opt.zero_grad()
    x, y = data.at(k)
    with data.amp():
        loss = F.mse_loss(r.model(x), y)
    plain = torch.autograd.grad(loss, list(r.model.parameters()), retain_graph=True)
    r.logged = getattr(r, "logged", []) + [torch.stack([g.norm() for g in plain])]
    scaler.scale(loss).backward()
    scaler.step(r.opt)
    scaler.update()


# ------------------------------------------------------------------------------------ the twin
def strategy_for(case: tuple[str, dict], r: Run, data: Data, attach: torch.nn.Module | None = None,
                 **overrides: Any) -> Any:
    """The strategy as a loop sets it up (tests/helpers.py ``make_strategy``): attached to the
    model (or ``attach``), with the fp32 reference closure over the current batch."""
    name, kw = case
    target = attach if attach is not None else r.model

    def reference() -> torch.Tensor:
        return sum(F.mse_loss(m(data.x), data.y) for m in r.models)

    s = make_strategy(name, kw, target, reference, **overrides)
    spread_groups(s)
    return s


def spread_groups(s: Any) -> None:
    """A per-group rule starts with every group at a different power of two (2^8 on the loss
    side, x4 per group towards the input), loaded through ``load_state_dict``: from the first
    step on, a result that assumed one scale for all gradients is visibly wrong."""
    if not (s.per_group and s.is_enabled() and s.num_groups > 1):
        return
    sd = s.state_dict()
    scales = [2.0 ** (8 + 2 * (s.num_groups - 1 - i)) for i in range(s.num_groups)]
    sd["extra"]["scale"], sd["scale"] = scales, scales[-1]
    s.load_state_dict(sd)
    assert s.state_dict()["extra"]["scale"] == scales


def same_scale(s: Any) -> torch.amp.GradScaler:
    """A GradScaler at the strategy's loss-side scale (enabled as the strategy is) that does not
    move it within the iteration."""
    return torch.amp.GradScaler("cpu", init_scale=loss_side_scale(s), growth_interval=2**30, enabled=s.is_enabled())


def twin(case: tuple[str, dict], pattern: Pattern, autocast: bool, steps: int = STEPS, n_models: int = 1,
         custom: bool = False, attach: Callable[[Run], torch.nn.Module] | None = None,
         check: Callable[[int, Any, Run], None] | None = None) -> Any:
    """Run ``pattern`` ``steps`` times with the strategy and with GradScaler at the same scale;
    assert bit-identical results after every step; return the strategy. Under autocast fp16 the
    strategy starts at 2^10 (:data:`AUTOCAST_SCALE`, :data:`PER_GROUP_FLOOR`)."""
    a, b, data = Run(n_models, custom), Run(n_models, custom), Data(autocast)
    s = strategy_for(case, a, data, attach(a) if attach else None, **autocast_overrides(case[0], autocast))
    for k in range(steps):
        g = same_scale(s)
        pattern(s, a, k, data)
        pattern(g, b, k, data)
        assert_same(a, b, f"step {k}")
        if check is not None:
            check(k, s, a)
    return s


def exact_or_refused(case: Any, pattern_name: str, run: Callable[[], Any]) -> Any:
    """``run()`` must pass (exact), or — only where :func:`may_refuse` — raise one clear
    ``RuntimeError``/``ValueError`` naming the strategy. Returns the strategy, or None if refused."""
    name = case[0]
    if not may_refuse(name, pattern_name):
        return run()
    try:
        return run()
    except (RuntimeError, ValueError) as e:
        msg = str(e)
        assert name in msg and "\n" not in msg, f"not one clear error naming {name!r}: {msg!r}"
        return None


# ---------------------------------------------------------------------------------------- tests
AUTOCAST_SCALE = 2.0**10
"""The initial scale under autocast fp16: keeps this MLP's scaled fp16 gradients far from 65504
and from the subnormals at the start (a rule that later moves S into an overflow skips that step
on both sides alike: same scale, same arithmetic)."""

PER_GROUP_FLOOR = 2.0**8
"""``min_scale`` of a per-group rule under autocast fp16. Its groups' fp16 gradients are computed
at S_l, GradScaler's at the loss side's S: the two round alike only while no fp16 gradient is
subnormal, which needs every S_l >= ~2^8 for this MLP (``layerwise_adaloss`` places its groups
at 1.0 and 0.5 in fp16, where the two differ by ~1e-7 — the underflow that scaling is about,
outside the exact regime these tests check)."""


def autocast_overrides(name: str, autocast: bool) -> dict:
    if not autocast:
        return {}
    return {"init_scale": AUTOCAST_SCALE, **({"min_scale": PER_GROUP_FLOOR} if per_group(name) else {})}


PRECISION = pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_fp16"])


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_typical_loop(name: str, kw: dict, autocast: bool) -> None:
    twin((name, kw), typical, autocast)


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_clipping_after_unscale(name: str, kw: dict, autocast: bool) -> None:
    twin((name, kw), clipping, autocast)


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_accumulation_an_inf_in_one_micro_batch_skips_the_whole_step(name: str, kw: dict, autocast: bool) -> None:
    seen: dict[str, Any] = {}

    def check(k: int, s: Any, r: Run) -> None:
        if not s.is_enabled():  # GradScaler(enabled=False) steps on the Inf too: compared above
            return
        if k == 1:
            seen["before"], seen["scale_before"] = r.snapshot(), loss_side_scale(s)
            seen["skipped_before"] = s.telemetry()["skipped_steps"].item()
        if k == 2:  # the poisoned step: nothing moved, the skip counted, S reacted as documented
            assert all(torch.equal(p, q) for p, q in zip(r.params(), seen["before"]))
            tel = s.telemetry()
            assert tel["skipped_steps"].item() == seen["skipped_before"] + 1 and tel["found_inf"].item() == 1.0
            floor = s.params.min_scale
            if floor is not None and seen["scale_before"] <= floor:  # already at the floor: stays
                assert loss_side_scale(s) == seen["scale_before"]
            else:
                assert_overflow_reaction(s, loss_side_scale(s), seen["scale_before"])

    twin((name, kw), accumulation(poison_step=2), autocast, check=check)


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_gradient_penalty(name: str, kw: dict, autocast: bool) -> None:
    exact_or_refused((name, kw), "penalty", lambda: twin((name, kw), penalty, autocast))


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
@pytest.mark.parametrize("order", ["called_order", "other_order"])
def test_several_models_losses_and_optimizers_one_scaler(name: str, kw: dict, autocast: bool, order: str) -> None:
    """Attached through a container listing the models in the order they are called, or in the
    other order."""
    def container(r: Run) -> torch.nn.Module:
        return torch.nn.ModuleList(r.models if order == "called_order" else r.models[::-1])

    exact_or_refused((name, kw), f"multiple_{order}",
                     lambda: twin((name, kw), multiple, autocast, n_models=2, attach=container))


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_custom_autograd_functions(name: str, kw: dict, autocast: bool) -> None:
    twin((name, kw), typical, autocast, custom=True)


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_a_backward_the_strategy_did_not_scale_is_left_alone(name: str, kw: dict, autocast: bool) -> None:
    """The plain ``autograd.grad(loss)`` beside the scaled backward equals GradScaler's side's
    (which no hook touches) — as well as the scaled step itself."""
    logged: list[torch.Tensor] = []

    def pattern(scaler: Any, r: Run, k: int, data: Data) -> None:
        unscaled_backward(scaler, r, k, data)
        logged.append(r.logged[-1])

    if exact_or_refused((name, kw), "unscaled_backward", lambda: twin((name, kw), pattern, autocast)) is not None:
        assert all(bit_equal(logged[i], logged[i + 1]) for i in range(0, len(logged), 2))


@pytest.mark.parametrize("name,kw", CASES)
@PRECISION
def test_state_dict_into_a_new_scaler_mid_run(name: str, kw: dict, autocast: bool) -> None:
    """The page's checkpoint recipe: ``state_dict()`` saved (torch.save, loaded with
    weights_only=True), a new scaler built and loaded, training continues — bit-identical to
    GradScaler at every step, and the new scaler continues exactly as the uninterrupted one."""
    case, over = (name, kw), autocast_overrides(name, autocast)
    a, b, c, data = Run(), Run(), Run(), Data(autocast)
    s, u = strategy_for(case, a, data, **over), strategy_for(case, c, data, **over)
    for k in range(2 * STEPS):
        if k == STEPS:
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            buf.seek(0)
            s.detach()
            s = strategy_for(case, a, data, **over)
            s.load_state_dict(torch.load(buf, weights_only=True))
            assert s.state_dict() == u.state_dict()
        g = same_scale(s)
        typical(s, a, k, data)
        typical(g, b, k, data)
        typical(u, c, k, data)
        assert_same(a, b, f"step {k}")
        assert_same(a, c, f"step {k} (uninterrupted)")
        assert s.state_dict() == u.state_dict(), f"step {k}: the loaded scaler diverged from the uninterrupted one"
