"""The statistics trace and its replay (``strategies.tracing``): recorded on the device with no host
read per step, read back from its file format, and replayed through each rule's own ``update()`` —
a rule replayed on its own trace retraces its recorded scales exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies.tracing import FORMATS, Histogram, MissingInput, Trace, TraceError, TraceRecorder, replay
from strategies.tracing.inputs import RECENT, group_overflow, lost_fractions
from tests.helpers import batch, forbid_host_sync, mlp

SPIKES = {4: 1e6, 9: 1e6, 10: 1e6}  # step -> loss multiplier: overflows at any usual scale


def train(name: str, steps: int = 14, flush_every: int = 5, **kw) -> tuple[Trace, list[str]]:
    """A small fp16 loop recording its trace; returns it (kept in memory) and its file lines."""
    model = mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = strategies.create(name, "cpu", **kw)
    if s.per_group:
        s.attach(model)
    rec = TraceRecorder(s, model, keep=True, meta={"strategy": name})
    lines = [json.dumps(rec.header())]
    for step in range(1, steps + 1):
        x, y = batch(step)
        with forbid_host_sync():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            s.scale(loss * SPIKES.get(step, 1.0)).backward()
            s.unscale_(opt)
            rec.unscaled(model.parameters())
        s.step(opt)  # GradScaler's own skip decision: its one read
        with forbid_host_sync():
            s.update()
            rec.stepped(step, loss, 0.05)
        opt.zero_grad()
        if step % flush_every == 0:
            lines.append(json.dumps(rec.flush()))
    chunk = rec.flush()
    if chunk is not None:
        lines.append(json.dumps(chunk))
    return rec.trace(), lines


@pytest.mark.parametrize("name", ["native", "max_ema", "layerwise", "amax_history", "tolerance", "learned", "static"])
def test_a_rule_replayed_on_its_own_trace_retraces_its_scales(name: str, one_thread) -> None:
    trace, _ = train(name, init_scale=2.0**14) if name != "static" else train(name)
    assert sum(trace.found_inf) >= 2  # the spikes overflowed
    result = replay(trace, strategies.create(name, "cpu", **({"init_scale": 2.0**14} if name != "static" else {})))
    assert [s.skipped for s in result.steps] == trace.found_inf
    if strategies.get(name).per_group:
        assert [s.scales for s in result.steps] == trace.scale
    else:
        assert [s.scale for s in result.steps] == [row[0] for row in trace.scale]


def test_the_file_format_round_trips_and_a_torn_last_line_is_dropped(one_thread) -> None:
    trace, lines = train("layerwise")
    read = Trace.from_lines(lines)
    assert read.steps == list(range(1, 15)) and read.groups == trace.groups == ["0", "2", "4"]
    assert read.scale == trace.scale and read.found_inf == trace.found_inf
    assert [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(read.grad_absmax, trace.grad_absmax)]
    assert Trace.from_lines(lines[:-1] + [lines[-1][:40]]).steps == list(range(1, 11))
    again = Trace.from_lines(list(trace.lines(chunk=4)))
    assert again.scale == trace.scale and again.group_numel == trace.group_numel == [144, 272, 68]
    assert again.truncated(6).steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("bad,what", [
    (lambda ls: [ls[0], "{not json", *ls[1:]], "line 2"),
    (lambda ls: ls[1:], "before the header"),
    (lambda ls: [ls[0].replace('"version": 2', '"version": 9'), *ls[1:]], "version"),
    (lambda ls: [ls[0], ls[2], ls[1]], "after step"),
    (lambda ls: [], "no trace header"),
])
def test_a_corrupt_trace_is_one_error(bad, what: str, one_thread) -> None:
    _, lines = train("native", steps=10)
    with pytest.raises(TraceError, match=what):
        Trace.from_lines(bad(lines))


def test_recording_reads_the_device_only_at_a_flush(one_thread) -> None:
    train("layerwise", steps=6, flush_every=100)  # forbid_host_sync around every step's calls


@pytest.mark.parametrize("name,why", [("norm_ratio", "fp32 reference"), ("hybrid", "fp32 reference")])
def test_rules_whose_input_the_trace_lacks_say_so(name: str, why: str, one_thread) -> None:
    trace, _ = train("native", steps=5)
    with pytest.raises(MissingInput, match=why):
        replay(trace, name)
    with pytest.raises(MissingInput, match="adaloss"):
        replay(trace, strategies.create("layerwise", rule="adaloss"))
    with pytest.raises(MissingInput, match="histogram"):
        replay(trace, "underflow_target")
    with pytest.raises(MissingInput, match="disabled"):
        replay(trace, strategies.create("native", enabled=False))


def test_the_overflow_model() -> None:
    t = Trace(["a", "b"], [10, 10], format=FORMATS["fp16"])
    t.add_row(1, [0.0, 1.0, 2.0, 1.0, 0.0, 0.0, 0.1, 1024.0, 1.0, 2.0])  # clean at 1024
    t.add_row(2, [1.0, 1.0, math.nan, math.nan, 0.0, 0.0, 0.1, 1024.0, 1.0, math.inf])  # overflow in b
    t.add_row(3, [1.0, math.nan, math.nan, math.nan, 0.0, 0.0, 0.1, 1024.0, math.inf, math.inf])  # NaN loss
    assert group_overflow(t, 0, [32768.0], "persist")[0] == [False, True]  # 2 * 32768 >= 65504
    assert group_overflow(t, 0, [16384.0], "persist") == ([False, False], [1.0, 2.0])
    assert group_overflow(t, 1, [1.0], "persist")[0] == [False, True]
    over, feed = group_overflow(t, 1, [512.0], "bound")  # below the recorded scale: the lower bound
    assert over == [False, False] and feed == [1.0, 65504.0 / 1024.0]
    assert group_overflow(t, 1, [1024.0], "bound")[0] == [False, True]
    assert group_overflow(t, 2, [1e-6], "bound")[0] == [True, True]  # no scale fixes a non-finite loss
    e4m3 = Trace(["a"], [1], format=FORMATS["fp8_e4m3"])
    e4m3.add_row(1, [0.0, 1.0, 2.0, 1.0, 0.0, 0.0, 0.1, 1.0, 2.0])
    assert group_overflow(e4m3, 0, [1e9], "persist")[0] == [False]  # saturates, never inf


def test_a_clean_step_never_overflows_at_or_below_its_recorded_scale() -> None:
    t = Trace(["a"], [1], format=FORMATS["fp16"])
    t.add_row(1, [0.0, 1.0, 100.0, 1.0, 0.0, 0.0, 0.1, 1024.0, 100.0])  # 100 * 1024 > 65504, yet it did not overflow
    assert group_overflow(t, 0, [1024.0], "persist") == ([False], [100.0])  # the recorded run replays as itself
    assert group_overflow(t, 0, [2048.0], "persist")[0] == [True]


def test_auto_tells_a_scale_that_overflowed_from_a_jump() -> None:
    """``auto``: a recorded overflow after gradients at the edge at that scale (max a * S >= NEAR * M)
    is the scale's (``bound``: a lower scale survives it); after gradients riding at M / 2, a jump (``persist``)."""
    grown = 1.0 * 65504.0 / 1024.0  # a * S = M: a scale that doubled from a * S = M / 2 into the overflow
    riding = 0.5 * 65504.0 / 1024.0  # a * S = M / 2: max_ema's target; its overflow takes a jump
    for before, kept in ((grown, True), (riding, False)):
        t = Trace(["a"], [1], format=FORMATS["fp16"])
        for step in range(1, 1 + RECENT):
            t.add_row(step, [0.0, 1.0, before, 1.0, 0.0, 0.0, 0.1, 1024.0, before])
        t.add_row(1 + RECENT, [1.0, 1.0, math.nan, math.nan, 0.0, 0.0, 0.1, 1024.0, math.inf])
        over, feed = group_overflow(t, RECENT, [512.0], "auto")
        assert over == [not kept] and feed == ([65504.0 / 1024.0] if kept else [math.inf])
        assert group_overflow(t, RECENT, [1024.0], "auto")[0] == [True]  # at the recorded scale: always
        assert group_overflow(t, RECENT, [512.0], "bound")[0] == [False]
        assert group_overflow(t, RECENT, [512.0], "persist")[0] == [True]


def test_auto_reads_an_opening_string_of_overflows_by_the_clean_steps_after_it() -> None:
    """A run from 2^32 halves through a string of overflows; late in the string some groups are
    already finite (and small at that scale). Only clean steps are evidence: the string is the
    scale's (the clean gradients after it sit near M at those scales), so a lower scale survives
    it. With the partly finite overflow rows as evidence it read as a jump, and every preset
    replayed on an AReaL trace skipped a step its real run did not."""
    t = Trace(["a", "b"], [1, 1], format=FORMATS["fp16"])
    scale = 2.0**24
    for step in range(1, 5):  # the opening string: b overflows, a finite and small at this scale
        t.add_row(step, [1.0, 1.0, math.nan, math.nan, 0.0, 0.0, 0.1, scale, 0.01, math.inf])
        scale /= 2
    for step in range(5, 5 + RECENT):  # clean at 2^20 with b at 0.5: 0.5 * 2^24 far above M
        t.add_row(step, [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.1, 2.0**20, 0.01, 0.5])
    over, feed = group_overflow(t, 3, [65536.0], "auto")  # the last opening step (recorded at 2^21)
    assert over == [False, False] and feed == [0.01, 65504.0 / 2.0**21]


def test_lost_entries_from_the_histogram() -> None:
    t = Trace(["a"], [1], format=FORMATS["fp16"])
    h = Histogram(-30, [10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 20], 5)  # exponents -30, -20, -14
    assert lost_fractions(h, 1.0, t) == (0.25, 0.5)  # 2^-29 <= 2^-25; 2^-19 <= 2^-14
    assert lost_fractions(h, 2.0**10, t) == (0.0, 0.25)
    assert lost_fractions(h, 2.0**-10, t) == (0.5, 1.0)


def test_a_fault_stops_the_replay_where_training_would_stop(one_thread) -> None:
    trace, _ = train("native", steps=12)
    kw = dict(min_scale=2.0**13, on_min_scale="raise", init_scale=2.0**14)
    result = replay(trace, strategies.create("native", "cpu", **kw))
    assert result.stopped is not None and "on_min_scale='raise'" in result.stopped[1]
    assert result.stopped[0] == result.skipped_steps[1] and result.floor_step == result.skipped_steps[0] + 1
    assert len(result.steps) == result.stopped[0]


def test_a_plugin_rule_is_replayed_through_its_own_update(one_thread) -> None:
    calls = []

    class Halving(strategies.Strategy):  # not registered: any Strategy instance replays
        name = "halving"

        def update_(self, found_inf, stats):
            calls.append(stats.absmax.clone())
            self.state.scale.mul_(torch.where(found_inf != 0, 0.5, 1.0))

    trace, _ = train("native", steps=6)
    result = replay(trace, Halving("cpu", init_scale=2.0**20))
    # 2^20 and 2^19 overflow (|g| ~ 0.2), 2^18 does not; step 4 is a spike
    assert len(calls) == 6 and [s.skipped for s in result.steps] == [True, True, False, True, False, False]
    assert result.steps[-1].scale == 2.0**17 and math.isinf(calls[0].item())


def test_auto_judges_an_opening_string_of_overflows_by_the_clean_steps_after_it() -> None:
    """A run that opens by overflowing (2^32 halving down, no finite abs-max before): ``auto`` reads the
    first clean steps after it. Gradients of 1.0 overflow at 2^32 by the scale (``bound``: 65536
    survives); gradients of 1e-9 would not have overflowed at 2^32, so the overflow was a jump."""
    for after, kept in ((1.0, True), (1e-9, False)):
        t = Trace(["a"], [1], format=FORMATS["fp16"])
        t.add_row(1, [1.0, 1.0, math.nan, math.nan, 0.0, 0.0, 0.1, 2.0**32, math.inf])
        t.add_row(2, [1.0, 1.0, math.nan, math.nan, 0.0, 0.0, 0.1, 2.0**31, math.inf])
        for step in range(3, 3 + RECENT):
            t.add_row(step, [0.0, 1.0, after, 1.0, 0.0, 0.0, 0.1, 2.0**30, after])
        assert group_overflow(t, 0, [65536.0], "auto")[0] == [not kept]
        assert group_overflow(t, 1, [65536.0], "auto")[0] == [not kept]
        assert group_overflow(t, 0, [65536.0], "persist")[0] == [True]


def test_an_overflowing_group_records_inf_not_float_max(one_thread) -> None:
    """torch.nan_to_num(x, nan=inf) alone also maps +inf to float32's max (3.4e38): a group whose
    gradient holds +inf (and no NaN) must record inf, as a NaN one does."""
    model = mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = strategies.create("native", "cpu")
    rec = TraceRecorder(s, model, keep=True)
    x, y = batch(1)
    loss = F.mse_loss(model(x), y)
    s.scale(loss).backward()
    list(model.parameters())[-2].grad.view(-1)[0] = math.inf  # the last Linear's weight: +inf, no NaN
    s.unscale_(opt)
    rec.unscaled(model.parameters())
    s.step(opt)
    s.update()
    rec.stepped(1, loss, 0.05)
    rec.flush()
    row = rec.trace().group_absmax[0]
    assert math.isinf(row[-1]) and all(math.isfinite(v) for v in row[:-1]), row
