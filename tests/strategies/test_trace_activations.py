"""The trace's forward activation abs-max (``strategies/tracing/activations.py``): each step's value is
the abs-max over the finite entries of every leaf module's low-precision output, as a plain
re-computation of the same forward finds it, its module is the one holding it, an attention mask's
``-inf`` is not read, nothing is read from the device per step, and the file format carries it
(version 1 traces still read)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies.tracing import Trace, TraceRecorder
from strategies.tracing.activations import ForwardAbsMax, leaf_modules
from strategies.tracing.trace import BASE_COLUMNS, encode_chunk
from tests.helpers import batch, forbid_host_sync, mlp


def reference_absmax(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, str]:
    """The same fp16-autocast forward, every leaf module's output kept and reduced in plain Python."""
    outs: dict[str, float] = {}
    def keep(name: str, out: torch.Tensor) -> None:
        finite = [abs(v) for v in out.detach().float().flatten().tolist() if math.isfinite(v)]
        outs[name] = max(outs.get(name, 0.0), max(finite, default=0.0))

    handles = [m.register_forward_hook(lambda m, a, o, n=n: keep(n, o)) for n, m in leaf_modules(model)]
    with torch.autocast("cpu", dtype=torch.float16):
        model(x)
    for h in handles:
        h.remove()
    name = max(outs, key=outs.get)
    return outs[name], name


def run(model: torch.nn.Module, steps: int, gain: dict[int, float] | None = None) -> tuple[Trace, list[str]]:
    """An fp16 loop recording its trace with the forward hooks, every step's calls under forbid_host_sync."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = strategies.create("native", "cpu", init_scale=2.0**10)
    rec = TraceRecorder(s, model, keep=True, forward=torch.float16)
    lines = [json.dumps(rec.header())]
    for step in range(1, steps + 1):
        x, y = batch(step)
        x = x * (gain or {}).get(step, 1.0)
        with forbid_host_sync():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            s.scale(loss).backward()
        s.step(opt)
        with forbid_host_sync():
            s.update()
            rec.stepped(step, loss, 0.05)
        opt.zero_grad()
        with torch.no_grad():  # an evaluation forward between steps: not a training forward, not recorded
            model(x * 1e6)
    lines.append(json.dumps(rec.flush()))
    return rec.trace(), lines


def test_each_steps_absmax_is_the_largest_leaf_output_of_its_forward(one_thread) -> None:
    model = mlp(seed=2)
    expected = []
    probe = mlp(seed=2)
    opt = torch.optim.SGD(probe.parameters(), lr=0.05)
    s = strategies.create("native", "cpu", init_scale=2.0**10)
    for step in range(1, 6):  # the same training, re-measured by the reference before each step
        x, y = batch(step)
        expected.append(reference_absmax(probe, x))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(probe(x).float(), y)
        s.scale(loss).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    trace, _ = run(model, 5)
    assert trace.act_max == 65504.0 and trace.act_modules == ["0", "1", "2", "3", "4"]
    assert trace.act_absmax == [v for v, _ in expected]
    assert [trace.act_name(j) for j in range(5)] == [n for _, n in expected]


class Masked(torch.nn.Module):
    """A leaf that masks half its input with ``-inf``, as causal attention logits are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(torch.arange(x.shape[-1]) % 2 == 0, float("-inf"))


def test_a_mask_is_not_read_and_an_overflow_reads_as_its_finite_neighbours(one_thread) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), Masked())
    hooks = ForwardAbsMax(model, torch.float16)
    x, _ = batch(1)
    x[0, 0] = 1e6  # the Linear's row 0 passes 65504 in fp16: inf there, finite elsewhere
    with torch.autocast("cpu", dtype=torch.float16):
        out = model[0](x)
        model(x)
    values = out.float().flatten().tolist()
    assert any(math.isinf(v) for v in values)
    want = max(abs(v) for v in values if math.isfinite(v))
    amax, index = hooks.take(torch.device("cpu"))
    assert float(amax) == want and hooks.names[int(index)] == "0"  # the Linear's finite abs-max, not the mask's -inf


def test_fp32_outputs_and_no_hooks_record_nothing(one_thread) -> None:
    model = mlp(seed=2)
    hooks = ForwardAbsMax(model, torch.float16)
    x, _ = batch(1)
    model(x)  # fp32: not the low-precision forward's output
    amax, index = hooks.take(torch.device("cpu"))
    assert math.isnan(float(amax)) and float(index) == -1.0
    hooks.remove()
    with torch.autocast("cpu", dtype=torch.float16):
        model(x)
    assert math.isnan(float(hooks.take(torch.device("cpu"))[0]))  # hooks removed
    with pytest.raises(ValueError, match="ForwardAbsMax dtype must be a 16-bit or narrower float, got torch.float32"):
        ForwardAbsMax(model, torch.float32)


def test_reset_drops_what_the_hooks_saw(one_thread) -> None:
    model = mlp(seed=2)
    hooks = ForwardAbsMax(model, torch.float16)
    x, _ = batch(1)
    with torch.autocast("cpu", dtype=torch.float16):
        model(x * 100)  # a diagnostic re-run, say
        hooks.reset()
        model(x)
    assert float(hooks.take(torch.device("cpu"))[0]) == reference_absmax(mlp(seed=2), x)[0]


def test_the_file_format_carries_it_and_reads_version_1(one_thread) -> None:
    trace, lines = run(mlp(seed=2), 6)
    read = Trace.from_lines(lines)
    assert read.act_absmax == trace.act_absmax and read.act_module == trace.act_module
    assert read.act_modules == trace.act_modules and read.act_max == 65504.0
    again = Trace.from_lines(list(trace.lines(chunk=4))).truncated(3)
    assert again.act_absmax == trace.act_absmax[:3] and again.act_modules == trace.act_modules
    # a version-1 file: no act_* header keys, rows without the two activation columns
    width = len(BASE_COLUMNS) + len(trace.scale_groups) + len(trace.groups)
    header = {k: v for k, v in json.loads(lines[0]).items() if not k.startswith("act_")} | {"version": 1}
    rows = [[float(trace.found_inf[j]), trace.loss[j], trace.grad_absmax[j], trace.grad_sumsq[j], trace.zero_frac[j],
             trace.subnormal_frac[j], trace.lr[j], *trace.scale[j], *trace.group_absmax[j]] for j in range(len(trace))]
    v1 = Trace.from_lines([json.dumps(header), json.dumps(encode_chunk(1, rows))])
    assert len(rows[0]) == width and v1.loss == trace.loss and v1.scale == trace.scale
    assert all(math.isnan(v) for v in v1.act_absmax) and v1.act_module == [-1] * 6 and v1.act_name(0) is None
    assert math.isnan(v1.act_max) and v1.act_modules == []
