"""The gradient-fidelity probe against a case computed by hand, and its promise to change nothing."""

from __future__ import annotations

import math

import pytest
import torch

import strategies
from experiments.app.fidelity import capture_rng, probe


def two_layers() -> torch.nn.Sequential:
    """h = x (identity weights), y = w . h with w = (2^-14, 2^-11): fp16 values, exact products."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[1].weight.copy_(torch.tensor([[2.0**-14, 2.0**-11]]))
    return model


def test_a_flushed_activation_gradient_by_hand() -> None:
    """At S = 2^-12 the fp16 activation gradient dL/dh = S w = (2^-26, 2^-23): the first entry is
    below half the smallest fp16 subnormal (2^-25) and flushes to zero, so row 0 of layer 0's
    weight gradient is lost; row 1 survives exactly. By hand, with r the fp32 gradient of layer 0,
    rows (2^-14, 2^-13) and (2^-11, 2^-10): lost 2 of 4 entries, cosine = |row 1| / |r| = 8/sqrt(65),
    relative error = |row 0| / |r| = 1/sqrt(65). Layer 1 (dL/dw = h = (1, 2)) is exact."""
    model = two_layers()
    x = torch.tensor([[1.0, 2.0]])
    s = strategies.create("native", init_scale=2.0**-12)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rng = capture_rng(torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    s.scale(out.float().sum()).backward()
    s.unscale_(opt)
    assert model[0].weight.grad.tolist() == [[0.0, 0.0], [2.0**-11, 2.0**-10]]
    grads = [p.grad.clone() for p in model.parameters()]

    row = probe(model, lambda: model(x).float().sum(), list(model.parameters()), rng)

    assert row["layer_lost_frac"] == {"0": 0.5, "1": 0.0}
    assert row["layer_cosine"]["0"] == pytest.approx(8 / math.sqrt(65), rel=1e-12)
    assert row["layer_rel_err"]["0"] == pytest.approx(1 / math.sqrt(65), rel=1e-12)
    assert row["layer_cosine"]["1"] == 1.0 and row["layer_rel_err"]["1"] == 0.0
    assert row["lost_frac"] == pytest.approx(2 / 6)
    rr = 2.0**-28 + 2.0**-26 + 2.0**-22 + 2.0**-20 + 5.0
    assert row["rel_err"] == pytest.approx(math.sqrt((2.0**-28 + 2.0**-26) / rr), rel=1e-12)
    assert not row["skipped"] and row["fidelity_probe_s"] >= 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # .grad untouched


def test_the_probe_leaves_rng_buffers_and_training_unchanged() -> None:
    """Dropout masks are replayed from the step's RNG state (same masks as the step), and the
    RNG stream, the BatchNorm statistics and every later step are as if no probe ran."""

    def run(with_probe: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = strategies.create("native", init_scale=2.0**4)
        out = []
        for step in range(4):
            x = torch.randn(16, 4)
            opt.zero_grad()
            rng = capture_rng(torch.device("cpu"))
            loss = model(x).square().mean()
            s.scale(loss).backward()
            s.unscale_(opt)
            if with_probe:
                row = probe(model, lambda: model(x).square().mean(), list(model.parameters()), rng)
                # fp32 model: the step's gradient *is* the reference when the masks are the same
                assert row["cosine"] == pytest.approx(1.0, abs=1e-6) and row["lost_frac"] == 0.0
            s.step(opt)
            s.update()
            out.append(loss.detach())
        return out + [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]

    plain, probed = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed))


def test_a_non_finite_step_is_marked_skipped() -> None:
    model = two_layers()
    x = torch.tensor([[1.0, 2.0]])
    rng = capture_rng(torch.device("cpu"))
    model(x).sum().backward()
    model[1].weight.grad[0, 0] = math.inf
    row = probe(model, lambda: model(x).sum(), list(model.parameters()), rng)
    assert row["skipped"] is True


TRAIN_NUMBERS = ("loss", "loss_avg", "scale", "skipped_total", "grad_absmax", "grad_norm", "grad_zero_frac")


@pytest.mark.parametrize("strategy,precision,model", [
    ("native", "fp16", "gpt"), ("max_ema", "fp16", "mlp"), ("layerwise", "fp16", "mlp"),
    ("norm_ratio", "fp16", "mlp"), ("native", "fp8_e5m2", "mlp"), ("none", "fp16", "mlp"),
])
def test_training_is_bit_identical_with_the_probe_on_or_off(tmp_path, strategy: str, precision: str,
                                                           model: str) -> None:
    """The probe runs between unscale_ and the optimizer step every `train.fidelity_every` steps;
    every training number (losses, scales, gradient statistics, evaluation) is unchanged."""
    from tests.experiments.runs import run_tiny

    common = (f"strategy={strategy}", f"precision={precision}", "regime=small_grad", "train.steps=12",
              "train.log_every=2", "train.eval_every=6")
    off, rows_off = run_tiny(tmp_path / "off", *common, model=model)
    on, rows_on = run_tiny(tmp_path / "on", *common, "train.fidelity_every=3", model=model)
    strip = lambda rows, kind: [{k: r.get(k) for k in TRAIN_NUMBERS + ("eval_loss", "step")}  # noqa: E731
                                for r in rows if r["kind"] == kind]
    assert strip(rows_on, "train") == strip(rows_off, "train")
    assert strip(rows_on, "eval") == strip(rows_off, "eval")
    fid = [r for r in rows_on if r["kind"] == "fidelity"]
    assert [r["step"] for r in fid] == [3, 6, 9, 12] and not any(r["kind"] == "fidelity" for r in rows_off)
    for r in fid:
        assert r["rel_err"] >= 0 and 0.0 <= r["lost_frac"] <= 1.0
        # cosine is NaN exactly when the mixed-precision gradient is all zero (everything lost)
        assert (-1.0 <= r["cosine"] <= 1.0 + 1e-9) if r["lost_frac"] < 1.0 else math.isnan(r["cosine"])
        assert set(r["layer_cosine"]) == set(r["layer_lost_frac"]) and r["fidelity_probe_s"] > 0
    assert off["final_eval_loss"] == on["final_eval_loss"] and off["skipped_steps"] == on["skipped_steps"]
    assert "fidelity_lost_frac_mean" not in off and on["fidelity_time_s"] > 0
    assert 0.0 <= on["fidelity_lost_frac_mean"] <= 1.0
    assert on["fidelity_one_minus_cos_mean"] is None or on["fidelity_one_minus_cos_mean"] >= -1e-9


def test_fidelity_separates_unscaled_fp16_from_a_scaled_run(tmp_path) -> None:
    """At loss x 1e-6 fp16 without scaling loses most entries; native's 2^16 loses far fewer."""
    from tests.experiments.runs import run_tiny

    common = ("precision=fp16", "regime=small_grad", "train.steps=6", "train.fidelity_every=2")
    none, _ = run_tiny(tmp_path / "none", "strategy=none", *common)
    native, _ = run_tiny(tmp_path / "native", "strategy=native", *common)
    assert none["fidelity_lost_frac_mean"] > 0.9 and native["fidelity_lost_frac_mean"] < 0.5 * none["fidelity_lost_frac_mean"]
