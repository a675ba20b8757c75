"""A run directory's guarantees: one writer at a time, resume only the run it recorded, nothing lost.

What a run does with its directory is decided once, by :meth:`RunDir.resume_plan`, as one value
(:class:`ResumePlan`): start at step 0, resume from the checkpoint's step, leave a finished run
alone (its summary is the result), or refuse with one line. The guarantees it keeps:

* **One writer.** :meth:`RunDir.lock` takes ``flock(LOCK_EX | LOCK_NB)`` on ``run.lock`` for the
  run's lifetime; a second process (or a second run in the same process) fails at once with one
  line. The kernel drops the lock on any exit, a ``SIGKILL`` included.
* **Same run only.** The run records its configuration (``summary.json``'s
  ``fingerprint.config``, and the checkpoint's ``config``). Re-running into the directory with a
  configuration that differs in any key but :data:`NOT_IDENTITY` is refused, naming the keys.
* **Same schedule.** ``train.steps`` may change on resume only when the learning rates of the
  steps already run stay those of a run of the new length (:func:`check_schedule`), so a resumed
  run is, step for step, the run of the new length.
* **Nothing lost.** A run that starts at step 0 in a directory holding any record (``train.resume=
  false``, or no checkpoint to resume from: ``train.checkpoint_every=0``, a deleted checkpoint)
  first moves the earlier records to ``replaced-<n>/`` (each renamed ``<name>.old``, so no reader
  takes them for a run).
* **Finished stays finished.** A run that diverged, stalled, or completed at ``train.steps`` or
  beyond (:func:`finished`, read from the checkpoint, else the summary) is left alone when re-run.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from experiments.app import checkpoint as ckpt
from experiments.app import recipe
from experiments import schema
from experiments.app.build import AppError, ConfigError
from experiments.app.records import read_json, redact

__all__ = ["NOT_IDENTITY", "ResumePlan", "RunDir", "check_schedule", "config_diff", "finished", "identity"]

NOT_IDENTITY = ("train.steps", "train.resume", "train.kill_at_step", "train.progress", "threads", "logger", "tags")
"""Config keys (and their sub-keys) a resumed run may change: how long, how it is shown and
logged, how many CPU threads. Every other key is part of what the run is."""

_RECORD_NAMES = (schema.SUMMARY_NAME, schema.METRICS_NAME, schema.CHECKPOINT_NAME)
_KEEP = (".hydra", schema.LOCK_NAME)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def identity(config: dict) -> dict[str, Any]:
    """The dotted keys of ``config`` (redacted) that make a run what it is (all but :data:`NOT_IDENTITY`)."""
    return {
        k: v for k, v in _flat(redact(config)).items()
        if not any(k == p or k.startswith(p + ".") for p in NOT_IDENTITY)
    }


def config_diff(old: dict, new: dict, limit: int = 6) -> str:
    """One line naming the keys whose values differ: ``seed (0 -> 1), strategy.name ('a' -> 'b')``."""
    a, b = identity(old), identity(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))

    def show(v: Any) -> str:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [f"{k} ({show(a.get(k, '<absent>'))} -> {show(b.get(k, '<absent>'))})" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return ", ".join(parts)


def finished(record: dict, steps: int) -> bool:
    """Whether the run whose latest record is ``record`` (its checkpoint, else its summary) needs
    no more training for a ``steps``-step run: it diverged, stalled, or completed at ``steps`` or
    beyond. A finished run is left alone when re-run."""
    status, at = record.get("status"), record.get("step", record.get("steps"))
    return status in ("diverged", "stalled") or (status == "completed" and isinstance(at, int) and at >= steps)


def check_schedule(old: dict, new: dict, done: int, where: Path) -> None:
    """Refuse (one-line ``ConfigError``) a change of ``train.steps`` that changes the learning
    rate of a step already run.

    A run resumed after ``done`` steps with ``train.steps`` changed from ``N`` to ``M`` must be
    the ``M``-step run: its steps ``1..done`` ran at ``lr_at(t, N)`` (``experiments/app/recipe.py``),
    which are the ``M``-step run's rates only if ``lr_at(t, N) == lr_at(t, M)`` for every
    ``t <= done`` (compared exactly, at the configured base rate). That holds for
    ``train.lr_decay=constant`` and, for ``cosine`` (whose decay spans ``steps - lr_warmup``
    steps), only while the run is still in its warmup; otherwise the change is refused.
    """
    told, tnew = old.get("train") or {}, new.get("train") or {}
    a, b = told.get("steps"), tnew.get("steps")
    if a == b or not isinstance(a, int) or not isinstance(b, int):
        return
    lr = (new.get("optimizer") or {}).get("lr")
    base = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else 1.0
    decay = str(tnew.get("lr_decay", "constant"))
    if decay == "constant":
        return  # lr_at does not read steps then (and the loop below would run over every step)
    args = (int(tnew.get("lr_warmup", 0)), decay, float(tnew.get("min_lr_ratio", 1.0)))
    for t in range(1, done + 1):  # a cosine difference shows by step lr_warmup + 2: the loop ends early
        x, y = recipe.lr_at(t, a, base, *args), recipe.lr_at(t, b, base, *args)
        if x != y:
            raise ConfigError(
                f"train.steps changed ({a} -> {b}) but the learning-rate schedule depends on it "
                f"(train.lr_decay={decay}): steps 1-{done} in {where} ran on the {a}-step schedule (step {t}: "
                f"lr {x:.6g}, a {b}-step run has {y:.6g}), so continuing would not be a {b}-step run; keep "
                f"train.steps={a}, or run {b} steps in another hydra.run.dir or here with train.resume=false "
                f"(the earlier records are moved to {where}/{schema.REPLACED_PREFIX}<n>/)"
            )


@dataclass(frozen=True)
class ResumePlan:
    """What a run does with its directory (:meth:`RunDir.resume_plan`), one of:

    * ``start``: train from step 0; ``replaces`` says why, when the directory holds earlier records
      that are moved to ``replaced-<n>/`` first (``train.resume=false``, no checkpoint to resume from);
    * ``resume``: continue from the checkpoint ``state`` after its step ``step``;
    * ``finished``: the run here needs no more training; ``status`` and ``step`` are its latest
      record's, ``summary`` its ``summary.json``, the result of re-running it;
    * ``refuse``: nothing may run here; ``refusal`` is the one-line error (``ConfigError``: another
      run or a schedule the new ``train.steps`` cannot follow; ``AppError``: an unreadable
      checkpoint, a record without a configuration).
    """

    action: Literal["start", "resume", "finished", "refuse"]
    step: Any = 0
    state: dict | None = None
    status: str | None = None
    summary: dict | None = None
    replaces: str | None = None
    refusal: AppError | None = None

    def check(self) -> ResumePlan:
        """This plan, unless it refuses: then its one-line error is raised."""
        if self.refusal is not None:
            raise self.refusal
        return self


class RunDir:
    """The run directory ``path`` as one process (rank 0) writes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @staticmethod
    def check_path(path: Path) -> None:
        """A one-line ``ConfigError`` unless ``path`` is, or can be created as, a writable directory."""
        if path.exists() and not path.is_dir():
            raise ConfigError(f"output directory {path} exists and is not a directory (set hydra.run.dir)")
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"output directory {path} cannot be created: {existing} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"output directory {path} is not writable (set hydra.run.dir)")

    def prepare(self) -> None:
        """Create the directory; a path that is a file or not writable is a one-line ``ConfigError``."""
        self.check_path(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"output directory {self.path} cannot be created ({exc.strerror or exc})") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"output directory {self.path} is not writable (set hydra.run.dir)")

    def check_free(self) -> None:
        """``AppError`` when another process holds this directory's lock (nothing is created)."""
        if (self.path / schema.LOCK_NAME).is_file():
            self.lock(create=False)
            self.release()

    def lock(self, create: bool = True) -> None:
        """Hold ``run.lock`` until :meth:`release` (or process exit); ``AppError`` when another holds it."""
        fd = os.open(self.path / schema.LOCK_NAME, (os.O_CREAT if create else 0) | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AppError(
                f"run directory {self.path} is in use by another process (pid {holder}); "
                "wait for it to end or use another hydra.run.dir"
            ) from None
        if create:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def has_record(self) -> bool:
        return any((self.path / name).exists() for name in _RECORD_NAMES)

    def recorded_config(self, checkpoint: dict | None) -> dict | None:
        """The configuration the directory's run recorded: the checkpoint's, else the summary's."""
        if checkpoint is not None and isinstance(checkpoint.get("config"), dict):
            return checkpoint["config"]
        fp = read_json(self.path / schema.SUMMARY_NAME).get("fingerprint")
        config = fp.get("config") if isinstance(fp, dict) else None
        return config if isinstance(config, dict) else None

    def resume_plan(self, config: dict, resume: bool, steps: int) -> ResumePlan:
        """The one decision of what a run of ``config`` (``train.resume=resume``, ``train.steps=steps``)
        does here (:class:`ResumePlan`). With ``resume``: the checkpoint must load, the directory
        must hold this run or none (:meth:`_check_same_run`); a finished run (its checkpoint, else its
        summary: ``train.checkpoint_every=0``) is left alone; otherwise a checkpoint is resumed once
        :func:`check_schedule` accepts a changed ``train.steps``, and without one the run starts over."""
        if not resume:
            return ResumePlan("start", replaces="train.resume=false" if self.has_record() else None)
        try:
            state = self._checkpoint()
            self._check_same_run(config, state)
        except AppError as exc:  # ConfigError included
            return ResumePlan("refuse", refusal=exc)
        last = state if state is not None else read_json(self.path / schema.SUMMARY_NAME)
        if finished(last, steps):
            return ResumePlan("finished", step=last.get("step", last.get("steps")), status=last.get("status"),
                              summary=read_json(self.path / schema.SUMMARY_NAME))
        if state is None:
            return ResumePlan("start", replaces="no checkpoint to resume from" if self.has_record() else None)
        try:
            check_schedule(self.recorded_config(state) or {}, config, int(state["step"]), self.path)
        except ConfigError as exc:
            return ResumePlan("refuse", refusal=exc)
        return ResumePlan("resume", step=int(state["step"]), state=state)

    def _checkpoint(self) -> dict | None:
        """The directory's checkpoint (``None`` when there is none); ``AppError`` when it is unusable."""
        if not (self.path / schema.CHECKPOINT_NAME).exists():
            return None
        try:
            return ckpt.load(self.path / schema.CHECKPOINT_NAME)
        except ckpt.CheckpointError as exc:
            raise AppError(str(exc)) from None

    def _check_same_run(self, config: dict, checkpoint: dict | None) -> None:
        """Refuse (one line) a directory holding a record of another configuration, or of an unknown one."""
        if not self.has_record():
            return
        recorded = self.recorded_config(checkpoint)
        restart = (f"use another hydra.run.dir, or train.resume=false to start over there "
                   f"(its records are moved to {self.path}/{schema.REPLACED_PREFIX}<n>/)")
        if recorded is None:
            raise AppError(f"run directory {self.path} holds a record without a readable configuration; {restart}")
        diff = config_diff(recorded, config)
        if diff:
            raise ConfigError(f"run directory {self.path} holds another run, whose configuration differs in {diff}; {restart}")

    def generation(self) -> int:
        """How many earlier runs were moved aside here (the current run is generation ``n``)."""
        return len(list(self.path.glob(f"{schema.REPLACED_PREFIX}*")))

    def run_id(self) -> str:
        """A stable id of the current run: the directory, plus its generation once one was replaced."""
        n = self.generation()
        return f"{self.path}#{n}" if n else str(self.path)

    def move_aside(self) -> Path:
        """Move every earlier record into ``replaced-<n>/`` (renamed ``<name>.old``); return that folder."""
        target = self.path / f"{schema.REPLACED_PREFIX}{self.generation() + 1}"
        target.mkdir()
        for entry in sorted(self.path.iterdir()):
            if entry.name in _KEEP or entry.name.startswith(schema.REPLACED_PREFIX):
                continue
            os.replace(entry, target / (entry.name + schema.REPLACED_SUFFIX))
        return target
