"""Drivers shared by the rule tests: real scale/unscale_/step/update calls on tiny models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from strategies.base import ScaleFloorError
from tests.helpers import batch, forbid_host_sync, mlp

INF = math.inf


def drive(s, found: list[int]) -> list[float]:
    """Feed a sequence of found_inf flags straight into the rule (one scalar 'gradient')."""
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for f in found:
        opt.zero_grad()
        s.scale(p * 0 + 1.0).backward()
        if f:
            p.grad.fill_(float("inf"))
        with forbid_host_sync():
            s.unscale_(opt)
        s.step(opt)
        with forbid_host_sync():
            s.update()
        out.append(s.get_scale())
    return out


def run(s, flags: list[int]) -> tuple[list[float], str | None]:
    """Real training-loop calls (``drive``: one scalar parameter, ``flags[i]`` poisoning step
    i's gradient, no host read in unscale_/update); the scale after each update (from
    telemetry: ``get_scale`` raises once a fault is recorded) and the message of a
    ``ScaleFloorError`` raised by ``step()`` (the loop stops there)."""
    scales: list[float] = []
    for f in flags:
        updates = s.updates
        try:
            drive(s, [f])
        except ScaleFloorError as e:
            if s.updates == updates:  # raised by step(), before the update
                return scales, str(e)
        scales.append(s.telemetry()["scale"].item())
    return scales, None


def train(s, model, steps, *, autocast=False, lr=0.1, closure=True, params=None, poison_at=(), multiplier=None):
    """``steps`` SGD steps of ``model`` on ``batch(step)`` with strategy ``s`` (fp16 autocast when
    ``autocast``), the fp32 reference closure set when ``closure`` (over ``params``), an Inf
    planted in the first parameter's gradient at the steps of ``poison_at``, the loss (and the
    reference's) times ``multiplier(step)`` when given; the telemetry after every update."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cur: dict = {}

    def reference():
        loss = F.mse_loss(model(cur["x"]), cur["y"])
        return loss if multiplier is None else loss * cur["m"]

    if closure:
        s.set_reference(reference, params)
    tel = []
    for step in range(steps):
        cur["x"], cur["y"] = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = F.mse_loss(model(cur["x"]).float(), cur["y"])
        if multiplier is not None:
            cur["m"] = multiplier(step)
            loss = loss * cur["m"]
        s.scale(loss).backward()
        if step in poison_at:
            next(model.parameters()).grad.view(-1)[0] = INF
        s.step(opt)
        s.update()
        tel.append({k: v.item() for k, v in s.telemetry().items()})
    return tel


def fp16_run(s, steps, *, closure, multiplier=lambda step: 1.0, poison_at=(), seed=0):
    """:func:`train` of a fresh ``mlp(seed)`` under fp16 autocast; ``(model, telemetry)``."""
    model = mlp(seed=seed)
    return model, train(s, model, steps, autocast=True, closure=closure, poison_at=poison_at, multiplier=multiplier)
