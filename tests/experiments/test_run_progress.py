"""RunProgress, the training loop's one progress object: a tqdm bar on a terminal and no lines;
plain lines at each new tenth in a log and no bar; nothing when ``train.progress`` is off."""

from __future__ import annotations

import io

import pytest

from experiments.app.log_lines import RunProgress

__all__: list[str] = []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(monkeypatch, stream: io.StringIO, enabled: bool, start: int = 0) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    progress = RunProgress(enabled, 20, start, "native")
    for step in range(start + 1, 21):
        progress.logged(step, {"loss": 3.0 - step / 10, "scale": 65536.0, "skipped_total": 1})
        progress.advance()
    progress.close()
    return stream.getvalue()


def test_a_terminal_gets_the_bar_and_no_lines(monkeypatch) -> None:
    out = _run(monkeypatch, _Terminal(), True)
    assert "native" in out and "20/20" in out and "scalelab-train: step" not in out


def test_a_log_gets_a_line_per_tenth_and_no_bar(monkeypatch) -> None:
    out = _run(monkeypatch, io.StringIO(), True)
    lines = out.splitlines()
    assert [ln.split(",")[0] for ln in lines] == [f"scalelab-train: step {s}/20" for s in range(2, 21, 2)]
    assert "loss 2.8, scale 6.55e+04, 1 skipped |" in lines[0] and "|" not in out.replace(" | ", "")


def test_a_resumed_run_starts_its_lines_after_the_tenth_it_reached(monkeypatch) -> None:
    out = _run(monkeypatch, io.StringIO(), True, start=9)
    assert [ln.split(",")[0] for ln in out.splitlines()] == [f"scalelab-train: step {s}/20" for s in range(10, 21, 2)]


@pytest.mark.parametrize("stream", [_Terminal, io.StringIO])
def test_progress_off_shows_nothing(monkeypatch, stream) -> None:
    assert _run(monkeypatch, stream(), False) == ""
