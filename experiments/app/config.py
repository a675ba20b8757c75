"""The run options the loop reads, as typed values: :class:`RunConfig` (``seed``, ``threads``, ...),
its :class:`TrainConfig` (``train.*``) and :class:`RegimeConfig` (``regime.*``).

:meth:`RunConfig.from_hydra` first checks the whole composed config with
:func:`experiments.app.build.validate` (the one place run options are validated: a bad type or value is
a one-line :class:`~experiments.app.build.ConfigError` naming the option and its allowed range), then
reads the values once; the loop never looks a key up again. The groups the builders consume
(``model``, ``data``, ``optimizer``, ``strategy``, ``precision``, ``logger``) stay in the Hydra
config, which is also what the run record stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from omegaconf import DictConfig

from experiments.app import recipe
from experiments.app.build import validate

__all__ = ["RunConfig", "TrainConfig", "RegimeConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """``train.*`` (meaning of each option: ``conf/config.yaml``)."""

    steps: int
    batch_size: int
    log_every: int
    hist_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    warmup: int
    grad_clip: float
    lr_warmup: int
    lr_decay: str
    min_lr_ratio: float
    divergence_loss: float
    fidelity_every: int
    max_consecutive_skips: int
    kill_at_step: int | None
    resume: bool
    deterministic: bool
    progress: bool
    zero_grad: bool  # false: the optimizer's zero_grad() clears nothing (build.keep_gradients)

    def lr_schedule(self, lr: float) -> Callable[[int], float]:
        """``step -> lr`` for the optimizer's base rate ``lr`` (:func:`experiments.app.recipe.lr_at`)."""
        return partial(recipe.lr_at, steps=self.steps, lr=float(lr), warmup=self.lr_warmup, decay=self.lr_decay,
                       min_lr_ratio=self.min_lr_ratio)

    def log_step(self, step: int) -> bool:
        """A train line (and a telemetry read) every ``log_every`` steps and at the last step."""
        return step % self.log_every == 0 or step == self.steps

    def histogram_step(self, step: int) -> bool:
        """The exponent histogram goes on the first logging step at or after each multiple of
        ``hist_every``."""
        prev_log = ((step - 1) // self.log_every) * self.log_every
        return self.log_step(step) and self.hist_every > 0 and step // self.hist_every > prev_log // self.hist_every

    def checkpoint_step(self, step: int) -> bool:
        """A checkpoint every ``checkpoint_every`` steps before the last (the last one: at the end)."""
        return self.checkpoint_every > 0 and step % self.checkpoint_every == 0 and step < self.steps


@dataclass(frozen=True)
class RegimeConfig:
    """``regime.*``: the stress on the low-precision backward (``experiments/app/loop.py``)."""

    name: str
    loss_multiplier: float
    spike_steps: frozenset[int]
    spike_factor: float
    rescale_grads: bool

    def multiplier(self, step: int) -> float:
        """``m`` of ``step``: ``loss_multiplier``, times ``spike_factor`` on a spike step."""
        return self.loss_multiplier * (self.spike_factor if step in self.spike_steps else 1.0)


@dataclass(frozen=True)
class RunConfig:
    """The run-level options of a composed config, validated (see the module docstring)."""

    seed: int
    device: str
    threads: int | None
    sweep: str
    tags: tuple[str, ...]
    train: TrainConfig
    regime: RegimeConfig

    @classmethod
    def from_hydra(cls, cfg: DictConfig) -> RunConfig:
        """Validate ``cfg`` (:func:`experiments.app.build.validate`), then read its run options."""
        validate(cfg)
        t, r = cfg.train, cfg.regime
        kill = t.get("kill_at_step")
        train = TrainConfig(
            steps=int(t.steps), batch_size=int(t.batch_size), log_every=int(t.log_every),
            hist_every=int(t.hist_every), eval_every=int(t.eval_every), eval_batches=int(t.eval_batches),
            checkpoint_every=int(t.checkpoint_every), warmup=int(t.warmup), grad_clip=float(t.grad_clip),
            lr_warmup=int(t.get("lr_warmup", 0)), lr_decay=str(t.get("lr_decay", "constant")),
            min_lr_ratio=float(t.get("min_lr_ratio", 1.0)), divergence_loss=float(t.divergence_loss),
            fidelity_every=int(t.get("fidelity_every", 0)), max_consecutive_skips=int(t.get("max_consecutive_skips", 0)),
            kill_at_step=None if kill is None else int(kill), resume=bool(t.get("resume", True)),
            deterministic=bool(t.get("deterministic", False)), progress=bool(t.get("progress", True)),
            zero_grad=bool(t.get("zero_grad", True)),
        )
        regime = RegimeConfig(
            name=str(r.get("name", "plain")), loss_multiplier=float(r.loss_multiplier),
            spike_steps=frozenset(int(s) for s in r.spike_steps), spike_factor=float(r.spike_factor),
            rescale_grads=bool(r.get("rescale_grads", True)),
        )
        threads = cfg.get("threads")
        return cls(seed=int(cfg.seed), device=str(cfg.device), threads=None if threads is None else int(threads),
                   sweep=str(cfg.sweep), tags=tuple(str(x) for x in cfg.get("tags") or []), train=train, regime=regime)
