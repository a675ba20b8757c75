"""`norm_ratio`: the pure rule against a hand-computed table; the probe against fp32 references."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies.rules.norm_ratio import norm_ratio_update_
from tests.helpers import batch, forbid_host_sync, mlp, params_equal
from tests.strategies.drivers import train

INF, NAN = math.inf, math.nan
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny fp16-autocast models: one thread (conftest.py)


def run_rule(rows, S0=1024.0, interval=3):
    """rows: (probed, found_inf, ref_sumsq, mp_sumsq) -> [(S, tracker, m, last_ratio)]."""
    S = torch.tensor(S0)
    t = torch.zeros((), dtype=torch.int32)
    m = torch.zeros(())
    n = torch.zeros((), dtype=torch.int32)
    r = torch.full((), NAN)
    out = []
    for probed, found, ref, mp in rows:
        norm_ratio_update_(S, t, m, n, r, torch.tensor(float(found)), torch.tensor(float(ref)),
                           torch.tensor(float(mp)), probed, 2.0, 0.5, interval, 8.0, 0.125, 0.5)
        out.append((S.item(), int(t.item()), m.item(), r.item()))
    return out


# growth_interval 3, EMA decay 0.5 over log2 r, thresholds 8 (log 3) and 1/8 (log -3).
TABLE = [
    ((True, 0, 256.0, 1.0), (2048.0, 0, 4.0)),    # r = 16: m = 4 (EMA start) > 3 -> x2, tracker restarts
    ((False, 0, 0.0, 0.0), (2048.0, 1, 4.0)),     # between probes: torch's rule, t = 1
    ((True, 0, 1.0, 1.0), (2048.0, 2, 2.0)),      # r = 1: m = 2, r_bar = 4 -> keep: torch's rule, t = 2
    ((False, 0, 0.0, 0.0), (4096.0, 0, 2.0)),     # t reaches 3: torch's growth
    ((True, 0, 1.0, 4096.0), (4096.0, 1, -2.0)),  # r = 1/64: m = -2, r_bar = 1/4 >= 1/8 -> keep
    ((True, 0, 1.0, 4096.0), (2048.0, 0, -4.0)),  # r = 1/64 again: m = -4 < -3 -> x0.5
    ((True, 1, 1.0, INF), (1024.0, 0, -4.0)),     # non-finite: skip + backoff, EMA not fed
    ((True, 0, 1.0, 0.0), (2048.0, 0, 6.0)),      # mp norm 0 (all underflowed): log r clamped to 16
    ((True, 0, 0.0, 0.0), (2048.0, 1, 6.0)),      # both norms 0: no information, torch's rule
    ((True, 0, INF, 1.0), (2048.0, 2, 6.0)),      # fp32 reference not finite: discarded
    ((False, 0, 0.0, 0.0), (4096.0, 0, 6.0)),     # torch's growth again
]


def test_rule_trajectory_table() -> None:
    got = run_rule([i for i, _ in TABLE])
    assert [g[:3] for g in got] == [o for _, o in TABLE]
    ratios = [g[3] for g in got]
    assert ratios[0] == 16.0 and ratios[4] == 1 / 64 and ratios[7] == INF and math.isnan(ratios[8])


# --------------------------------------------------------------------- the probe, end to end


def test_without_closure_it_is_torch_gradscaler_and_warns_once() -> None:
    m1, m2 = mlp(seed=3), mlp(seed=3)
    s = strategies.create("norm_ratio", init_scale=2.0**10, growth_interval=2, probe_interval=2)
    with pytest.warns(UserWarning, match="no reference closure") as rec:
        tel = train(s, m1, 8, closure=False, poison_at=(3,))
    assert len([w for w in rec if "no reference closure" in str(w.message)]) == 1
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    opt = torch.optim.SGD(m2.parameters(), lr=0.1)
    scales = []
    for step in range(8):
        x, y = batch(step)
        opt.zero_grad()
        ref.scale(F.mse_loss(m2(x), y)).backward()
        if step == 3:
            next(m2.parameters()).grad.view(-1)[0] = INF
        ref.step(opt)
        ref.update()
        scales.append(ref.get_scale())
    assert [t["scale"] for t in tel] == scales
    assert params_equal(m1, m2)
    assert tel[-1]["probe_count"] == 0


def test_probe_schedule_cost_and_ratio_at_the_pre_step_parameters() -> None:
    # fp32 "mixed precision": the two gradients agree, so r = 1 up to rounding -- but only if the
    # probe differentiates at the parameters the gradients were taken at (lr is large).
    s = strategies.create("norm_ratio", init_scale=2.0**10, probe_interval=3)
    tel = train(s, mlp(seed=4), 7, lr=0.5)
    assert [t["probe_count"] for t in tel] == [1, 1, 1, 2, 2, 2, 3]  # steps 0, 3, 6
    for k in (0, 3, 6):
        assert tel[k]["norm_ratio"] == pytest.approx(1.0, rel=1e-5)
    times = [t["probe_time_s"] for t in tel]
    assert times[0] > 0 and times[1] == times[0] and times[3] > times[2] and times[6] > times[5]
    assert tel[6]["probe_last_time_s"] == pytest.approx(times[6] - times[5])
    assert [t["scale"] for t in tel] == [2.0**10] * 7  # r = 1: keep


def test_telemetry_reports_the_raw_ratio_and_the_ema_of_its_log() -> None:
    """The keys the module docstring names: ``norm_ratio`` is the last probe's raw r and
    ``log_ratio_ema`` is m (the first valid probe sets m = log2 r; then m <- d m + (1 - d) log2 r)."""
    s = strategies.create("norm_ratio", init_scale=2.0**-20, probe_interval=2, ema_decay=0.5)
    tel = train(s, mlp(seed=6), 3, autocast=True)  # S far too small: fp16 loses mass, r > 1
    r0, r2 = tel[0]["norm_ratio"], tel[2]["norm_ratio"]
    assert r0 > 1.2 and r0 != r2 and tel[1]["norm_ratio"] == r0  # step 1 does not probe
    assert tel[0]["log_ratio_ema"] == pytest.approx(math.log2(r0), rel=1e-5)
    assert tel[2]["log_ratio_ema"] == pytest.approx(0.5 * math.log2(r0) + 0.5 * math.log2(r2), rel=1e-5)


def test_probe_never_touches_grad_or_parameters() -> None:
    # Thresholds nobody crosses: the probe decides nothing, so with and without it the run must
    # be bit-identical (same .grad, same parameters, same scales).
    kw = dict(init_scale=2.0**4, probe_interval=1, threshold_high=2.0**60, threshold_low=2.0**-60)
    a, b = mlp(seed=5), mlp(seed=5)
    ta = train(strategies.create("norm_ratio", **kw), a, 5, autocast=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tb = train(strategies.create("norm_ratio", **kw), b, 5, autocast=True, closure=False)
    assert params_equal(a, b)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    assert [t["scale"] for t in ta] == [t["scale"] for t in tb]
    assert ta[-1]["probe_count"] == 5


def test_underflow_is_detected_and_corrected() -> None:
    # fp16 autocast at S = 2^-28: every activation gradient flushes to zero, ||g_mp|| = 0, r = inf.
    # Each probe doubles S until the ratio is back inside [1/8, 8]; torch's rule alone would wait.
    s = strategies.create("norm_ratio", init_scale=2.0**-28, probe_interval=1)
    tel = train(s, mlp(seed=6), 24, autocast=True, lr=0.0)
    assert tel[0]["grad_zero_frac"] == 1.0 and tel[0]["norm_ratio"] == INF
    assert tel[0]["scale"] == 2.0**-27
    assert tel[-1]["scale"] >= 2.0**-20
    assert 0.125 <= tel[-1]["norm_ratio"] <= 8.0
    # Zeros fall but stay many: the norm is carried by the large entries, so the rule is content
    # (r ~ 1) while most small entries still underflow -- the criterion's blind spot, measured.
    assert tel[-1]["grad_zero_frac"] < tel[0]["grad_zero_frac"]


def test_probe_layers_restrict_the_norms_to_those_layers() -> None:
    model = mlp(seed=7)  # Linear "0", Tanh, Linear "2", Tanh, Linear "4"
    s = strategies.create("norm_ratio", init_scale=2.0**-22, probe_interval=1, probe_layers=["0"])
    s.attach(model)  # names the unnamed tensors handed to set_reference
    x, y = batch(0)
    ref = torch.autograd.grad(F.mse_loss(model(x), y), [model[0].weight, model[0].bias])
    tel = train(s, model, 1, autocast=True, lr=0.0, params=list(model.parameters()))
    mp = torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad.flatten()])
    expect = torch.cat([g.flatten() for g in ref]).norm() / mp.norm()
    assert tel[0]["norm_ratio"] == pytest.approx(expect.item(), rel=1e-5)
    assert tel[0]["norm_ratio"] > 1.5  # layer 0 lost gradient mass at this scale: a real signal


def test_probe_spans_every_optimizer_of_the_step() -> None:
    model = mlp(seed=8)
    ps = list(model.parameters())
    o1, o2 = torch.optim.SGD(ps[:2], lr=0.5), torch.optim.SGD(ps[2:], lr=0.5)
    s = strategies.create("norm_ratio", probe_interval=1)
    x, y = batch(0)
    s.set_reference(lambda: F.mse_loss(model(x), y), ps)
    s.scale(F.mse_loss(model(x), y)).backward()
    s.step(o1)
    s.step(o2)  # o1 has already changed its parameters; the probe ran before that
    s.update()
    t = s.telemetry()
    assert t["probe_count"].item() == 1
    assert t["norm_ratio"].item() == pytest.approx(1.0, rel=1e-5)


def test_probe_steps_never_sync() -> None:
    model = mlp(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = strategies.create("norm_ratio", probe_interval=2)
    cur = {}
    s.set_reference(lambda: F.mse_loss(model(cur["x"]), cur["y"]))
    for step in range(4):
        cur["x"], cur["y"] = batch(step)
        opt.zero_grad()
        with forbid_host_sync():
            s.scale(F.mse_loss(model(cur["x"]), cur["y"])).backward()
            s.unscale_(opt)
        s.step(opt)
        with forbid_host_sync():
            s.update()
    assert s.telemetry()["probe_count"].item() == 2


def test_bad_reference_and_layers_raise_clearly() -> None:
    model = mlp(seed=10)
    x, y = batch(0)
    s = strategies.create("norm_ratio", probe_interval=1, probe_layers=["head"])
    s.set_reference(lambda: F.mse_loss(model(x), y), model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s.scale(F.mse_loss(model(x), y)).backward()
    with pytest.raises(ValueError, match=r"probe_layers \['head'\] match no parameter"):
        s.unscale_(opt)
    s = strategies.create("norm_ratio", probe_interval=1, probe_layers=["0"])
    s.set_reference(lambda: F.mse_loss(model(x), y))  # unnamed, no attach
    s.scale(F.mse_loss(model(x), y)).backward()
    with pytest.raises(ValueError, match="named parameters"):
        s.unscale_(opt)
    s = strategies.create("norm_ratio", probe_interval=1)
    s.set_reference(lambda: model(x))  # not a scalar
    s.scale(F.mse_loss(model(x), y)).backward()
    with pytest.raises(ValueError, match="scalar loss"):
        s.unscale_(opt)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(probe_interval=0), "probe_interval must be an integer >= 1, got 0"),
        (dict(threshold_high=0.1), "threshold_high must be > threshold_low (0.125), got 0.1"),
        (dict(threshold_low=-1.0), "threshold_low must be finite and > 0, got -1.0"),
        (dict(ema_decay=1.0), "ema_decay must be in [0, 1), got 1.0"),
        (dict(probe_layers="0"), "probe_layers must be a list of fnmatch patterns (strings) or None, got '0'"),
        (dict(probe_layers=[]), "probe_layers must be a non-empty list or None, got []"),
    ],
)
def test_invalid_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("norm_ratio", **kwargs)
    assert str(e.value) == message


def accelerate_like(model: torch.nn.Module) -> torch.nn.Module:
    """What accelerate's ``prepare()`` does to ``model.forward`` with mixed precision: an autocast
    inside the forward, outputs converted back to fp32."""
    forward = model.forward
    model.forward = lambda *a, **k: torch.autocast("cpu", dtype=torch.float16)(forward)(*a, **k).float()
    return model


def test_a_reference_forward_that_autocast_reenables_is_refused() -> None:
    """An outer autocast the probe cannot switch off makes the "fp32" reference fp16: one error
    naming the cause and the fix, instead of a silently wrong ratio."""
    from strategies.reference import LowPrecisionReference

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    wrapped = accelerate_like(plain)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    s = strategies.create("norm_ratio", init_scale=2.0**10, probe_interval=1)
    s.set_reference(lambda: F.mse_loss(wrapped(x), y))
    s.scale(F.mse_loss(wrapped(x), y)).backward()
    with pytest.raises(LowPrecisionReference, match=r"norm_ratio: the fp32 reference forward computed .* in "
                                                    r"torch.float16: an autocast inside the model's forward"):
        s.unscale_(opt)
    unwrapped = torch.nn.Sequential(*plain)  # the same modules, without the wrapper
    s2 = strategies.create("norm_ratio", init_scale=2.0**10, probe_interval=1)
    s2.set_reference(lambda: F.mse_loss(unwrapped(x), y))
    opt.zero_grad()
    s2.scale(F.mse_loss(wrapped(x), y)).backward()
    s2.step(opt)
    s2.update()
    assert s2.telemetry()["probe_count"].item() == 1


def test_under_real_accelerate_fp32_forward_gives_a_true_fp32_reference_and_training_keeps_bf16() -> None:
    """The probe's advice is followed as written: the reference reaches the forward beneath
    accelerate's autocast wrapper, and the training forward still runs in bf16 afterwards
    (accelerator.unwrap_model(..., keep_fp32_wrapper=False) strips the wrapper from the model itself)."""
    accelerate = pytest.importorskip("accelerate")
    from strategies.reference import LowPrecisionReference, fp32_forward

    # On the CPU accelerate wraps forward in autocast for bf16 (its fp16 is GPU-only).
    accelerate.state.AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    s = strategies.create("norm_ratio", init_scale=2.0**10, probe_interval=1)
    s.set_reference(lambda: F.mse_loss(model(x), y))
    s.scale(F.mse_loss(model(x), y)).backward()
    with pytest.raises(LowPrecisionReference, match="fp32_forward"):
        s.unscale_(opt.optimizer)
    opt.zero_grad()
    reference = fp32_forward(model)
    s2 = strategies.create("norm_ratio", init_scale=2.0**10, probe_interval=1)
    s2.set_reference(lambda: F.mse_loss(reference(x), y))
    s2.scale(F.mse_loss(model(x), y)).backward()
    s2.unscale_(opt.optimizer)
    assert s2.telemetry()["probe_count"].item() == 1
    inner = []
    handle = model[0].register_forward_hook(lambda mod, args, out: inner.append(out.dtype))
    model(x)
    with torch.autocast("cpu", enabled=False):
        reference(x)
    handle.remove()
    assert inner == [torch.bfloat16, torch.float32]  # training still in bf16; the reference in fp32
    accelerate.state.AcceleratorState._reset_state(True)
