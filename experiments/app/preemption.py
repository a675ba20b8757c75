"""Tell a job that submitit requeues (preempted or timed out on SLURM) from one that failed.

Inside a submitit job (``hydra/launcher=slurm`` or ``slurm_local``; ``SUBMITIT_EXECUTOR`` is
set), submitit installs a handler for its preemption signal, ``SIG`` + ``$SUBMITIT_PREEMPT_SIGNAL``
(default ``USR2``; SLURM sends it ahead of a time limit or a preemption). The handler
(``submitit/core/job_environment.py``, ``SignalHandler.checkpoint_and_try_requeue``) runs in the
main thread at whatever line training is at, and either

* requeues the job — ``scontrol requeue <id>`` on SLURM, exit code 144 from the local executor —
  and then exits with ``sys.exit(-1)`` (SLURM), i.e. raises ``SystemExit`` from the handler; or
* does not (not checkpointable, out of requeues): raises ``submitit.core.utils.UncompletedJobError``.

So a ``SystemExit`` coming out of that handler means "requeued": the job will run again and
resume from its checkpoint. :class:`RequeueWatch` wraps the installed handler for the run's
duration and records that case; the loop then writes ``status: requeued`` instead of ``failed``.
Outside submitit, or when the signal has no Python handler, it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["RequeueWatch"]


class RequeueWatch:
    """Wraps submitit's preemption handler from construction until :meth:`close`.

    ``signal_name`` is ``None`` until the handler ended the job by ``SystemExit`` (requeued),
    then the signal's name (e.g. ``"SIGUSR2"``).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._signum: int | None = None
        self._previous: Any = None
        if not os.environ.get("SUBMITIT_EXECUTOR") or threading.current_thread() is not threading.main_thread():
            return
        signum = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
        previous = signal.getsignal(signum) if isinstance(signum, int) else None
        if not callable(previous):
            return

        def watched(num: int, frame: FrameType | None) -> None:
            try:
                previous(num, frame)
            except SystemExit:
                self.signal_name = signal.Signals(num).name
                raise

        self._signum, self._previous = signum, previous
        signal.signal(signum, watched)

    @property
    def requeued(self) -> bool:
        return self.signal_name is not None

    def close(self) -> None:
        """Put submitit's own handler back."""
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None
