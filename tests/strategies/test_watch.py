"""The early warning where users train: a plain loop (:class:`strategies.watch.Watch`), Lightning's
``MixedPrecision`` plugin and the Hugging Face ``Trainer`` (the real packages; skipped where they are
not installed). In each, an FFN weight jumps so that the fp16 forward overflows from step
:data:`ONSET` on: the scaler skips, the warning fires, and the doctor's verdict names the module —
in the user's own log. The detector here is a fixed one that reads the skip rate only, so that the test
holds the plumbing (the fitted detector's accuracy: ``docs/early-warning.md``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from experiments.replay.cli import load_trace
from strategies.watch import Detector, Watch, hf_callback, lightning_callback
from strategies.watch.detector import FEATURES
from tests.helpers import batch, forbid_host_sync

ONSET, STEPS = 6, 24
SKIPS = {"features": list(FEATURES), "mean": [0.0] * len(FEATURES), "scale": [1.0] * len(FEATURES),
         "coef": [10.0] + [0.0] * (len(FEATURES) - 1), "intercept": -3.0, "threshold": 0.5}
"""Alarm once more than 30% of the window's steps are skipped (5 of 16: from step ONSET + 4)."""
NEAR_MAX = {"features": ["act_fill"], "mean": [0.0], "scale": [1.0], "coef": [10.0], "intercept": -5.0, "threshold": 0.5}
"""Alarm once the forward activation abs-max passes half of the format's max (65504 / 2 in fp16)."""


def ffn(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def blow_up(model: torch.nn.Module, weight: torch.Tensor, factor: float = 1e6) -> None:
    with torch.no_grad():
        weight.mul_(factor)  # the layer's fp16 output passes 65504: the forward overflows from here on


def mse(model: torch.nn.Module, b) -> torch.Tensor:
    x, y = b
    return F.mse_loss(model(x).float(), y)


def test_a_plain_loop_gets_the_warning_and_the_doctor_in_its_log(one_thread) -> None:
    model, lines = ffn(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = strategies.create("native", "cpu", init_scale=2.0**10)
    watch = Watch(scaler, model, loss_fn=mse, every=4, log=lines.append, detector=Detector(SKIPS))
    for step in range(1, STEPS + 1):
        if step == ONSET:
            blow_up(model, model[2].weight)
        b = batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(model, b)
        with forbid_host_sync():
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            watch.unscaled()
        scaler.step(opt)
        with forbid_host_sync():
            scaler.update()
            if step % 4:  # a step that does not read the device
                watch.step(loss, 0.01, b)
                opt.zero_grad()
                continue
        watch.step(loss, 0.01, b)
        opt.zero_grad()
    assert len(lines) == 1 and lines[0].startswith(f"scalelab watch: step {ONSET + 4}: overflows: "), lines
    assert lines[0].endswith("doctor says: forward overflow at 2"), lines[0]
    assert watch.diagnosis.cause == "forward_overflow"
    megatron = strategies.create("native", "cpu", init_scale=2.0**32, growth_interval=1000, hysteresis=2, min_scale=1.0)
    result = watch.replay(megatron)
    assert len(result.steps) == STEPS and result.skipped_steps[-1] == STEPS


def test_the_forward_headroom_warns_before_a_forward_overflow_with_no_skipped_step(one_thread) -> None:
    """An FFN weight growing by half every step: its fp16 output nears 65504 with clean steps only (the
    gradients show nothing), and the activation abs-max from Watch's forward hooks warns first."""
    lines, runs = [], {}
    for activations in (True, False):
        model = ffn()
        scaler = strategies.create("native", "cpu", init_scale=2.0**10)
        watch = Watch(scaler, model, loss_fn=lambda m, b: mse(m, b) * 1e-9, every=1, log=lines.append,
                      detector=Detector(NEAR_MAX), activations=activations)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for step in range(1, 41):
            blow_up(model, model[2].weight, 1.5)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model, batch(step)) * 1e-9  # gradients that stay in range: only the forward can overflow
            with forbid_host_sync():
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            watch.step(loss, 0.0, batch(step))
            opt.zero_grad()
        watch.close()
        runs[activations] = watch
    trace = runs[True].trace()
    first_skip = trace.found_inf.index(True) + 1
    assert trace.act_modules == ["0", "1", "2"] and trace.act_max == 65504.0
    with torch.autocast("cpu", dtype=torch.float16):  # the reference: the same grown weight's output
        model = ffn()
        for _ in range(8):
            blow_up(model, model[2].weight, 1.5)
        ref = float(model(batch(8)[0]).detach().float().abs().max())
    assert trace.act_absmax[7] == ref and trace.act_name(7) == "2"
    near = next(j for j, a in enumerate(trace.act_absmax) if a >= 65504 / 2) + 1
    assert runs[True].detector.alarm_step == near < first_skip and not any(trace.found_inf[:near])
    assert lines == [f"scalelab watch: step {near}: forward activations at {100 * trace.act_absmax[near - 1] / 65504:.0f}% "
                     f"of the format's max ({math.log2(65504 / trace.act_absmax[near - 1]):.2f} binades of headroom) in 2; "
                     "doctor says: no fault in this step yet"]  # the precursor comes before the overflow
    assert runs[True].diagnosis.cause == "healthy"
    assert runs[False].detector.alarm_step is None and all(math.isnan(a) for a in runs[False].trace().act_absmax)


def test_the_saved_trace_is_what_scalelab_replay_reads(tmp_path, one_thread) -> None:
    model = ffn()
    scaler = strategies.create("max_ema", "cpu")
    watch = Watch(scaler, model, every=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 8):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(model, batch(step))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        watch.step(loss, 0.01)
        opt.zero_grad()
    trace = load_trace(watch.save(tmp_path / "trace.jsonl"))
    assert trace.steps == list(range(1, 8)) and trace.groups == ["0", "2"] and not any(trace.found_inf)
    assert all(math.isnan(a) for row in trace.group_absmax for a in row)  # unscaled() was not called


def test_lightning(tmp_path, one_thread) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ffn()

        def forward(self, x):
            return self.net(x)

        def training_step(self, b, batch_idx):
            return mse(self, b)

        def on_train_batch_start(self, b, batch_idx) -> None:
            if self.trainer.global_step + 1 == ONSET:
                blow_up(self, self.net[2].weight)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader([batch(i, n=1) for i in range(STEPS)], batch_size=None)
    lines = []
    strategy = strategies.create("native", "cpu", init_scale=2.0**10)
    cb = lightning_callback(every=4, log=lines.append)
    trainer = L.Trainer(max_steps=STEPS, callbacks=[cb], plugins=[MixedPrecision("16-mixed", "cpu", scaler=strategy)],
                        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_with_detector(Module(), cb), data)
    assert len(lines) == 1 and "overflows: " in lines[0] and lines[0].endswith("doctor says: forward overflow at net.2")
    assert len(cb.watch.trace()) == STEPS and cb.watch.trace().groups == ["net"]
    act = cb.watch.trace()  # the forward hooks: every step's finite abs-max and its module
    assert all(0 < a <= 65504 for a in act.act_absmax) and act.act_modules == ["net.0", "net.1", "net.2"]
    same = strategies.create("native", "cpu", init_scale=2.0**10)  # the recorded run's rule: itself again
    assert cb.watch.replay(same).skipped_steps == list(range(ONSET, STEPS + 1)) == \
        [s for s, f in zip(cb.watch.trace().steps, cb.watch.trace().found_inf) if f]


def _with_detector(module, cb):
    """Give the callback's Watch the skip-rate detector once it exists (on_train_start)."""
    start = type(cb).on_train_start

    def on_train_start(self, trainer, pl_module):
        start(self, trainer, pl_module)
        self.watch.detector = Detector(SKIPS)

    type(cb).on_train_start = on_train_start
    return module


def test_hugging_face_trainer(tmp_path, one_thread) -> None:
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(0, 32, (16,), generator=g)), "labels": ids} for _ in range(4 * STEPS)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, max_steps=STEPS,
                                          per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
                                          save_strategy="no", logging_steps=1000, disable_tqdm=True)
    class Trainer(transformers.Trainer):  # accelerate gives fp16 on the CPU no autocast; on a GPU it does
        def autocast_smart_context_manager(self, cache_enabled=True):
            return torch.autocast("cpu", dtype=torch.float16)

    trainer = Trainer(model=model, args=args, train_dataset=rows)
    strategy = strategies.create("native", "cpu", init_scale=2.0**10)
    trainer.accelerator.scaler, trainer.accelerator.native_amp = strategy, True  # what accelerate does on a GPU
    lines = []
    cb = hf_callback(trainer, every=4, log=lines.append)

    class Onset(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == ONSET:
                blow_up(model, model.transformer.h[0].mlp.c_proj.weight, 1e7)

        def on_train_begin(self, args, state, control, **kw):
            cb.watch.detector = Detector(SKIPS)

    trainer.add_callback(cb)
    trainer.add_callback(Onset())
    trainer.train()
    accelerate.state.AcceleratorState._reset_state(True)
    assert len(lines) == 1 and "overflows: " in lines[0], lines
    assert lines[0].endswith("at transformer.h.0.mlp.c_proj"), lines[0]  # the doctor's cause: its own business
    assert cb.watch.diagnosis.first_module == "transformer.h.0.mlp.c_proj"
    trace = cb.watch.trace()
    assert len(trace) == STEPS and all(math.isfinite(x) for x in trace.loss[:ONSET - 1])
    assert trace.found_inf[ONSET - 1:] == [True] * (STEPS - ONSET + 1)
    assert all(0 < a <= 65504 for a in trace.act_absmax) and "transformer.h.0.mlp.c_proj" in trace.act_modules
