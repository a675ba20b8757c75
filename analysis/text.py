"""Text of the report: numbers formatted once, and untrusted strings made inert once.

Strategy, workload, layer and run names, error messages and file paths come from run records a
careless or hostile hand may have written. :func:`code` is the one place they enter report text:
as an inline code span, which neither Markdown (HTML tags, ``$`` math, emphasis) nor the HTML
renderer of :mod:`analysis.document` (which escapes ``<&>`` first) interprets. Figures turn
mathtext off instead (:func:`analysis.figures.figure_rc`); CSV files are written through
:func:`write_csv`, which makes cells a spreadsheet would run as formulas inert.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["FORMULA_START", "MAX_CHARS", "clock", "code", "fmt", "fmt_ci", "fmt_p", "human",
           "inert_cell", "is_missing", "pct", "prob", "write_atomic", "write_csv"]

#: Longest untrusted string shown in full (the rest is cut with "…").
MAX_CHARS = 160
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def code(x: object, max_chars: int = MAX_CHARS) -> str:
    """``x`` as a one-line inline code span: control characters and newlines become spaces,
    backticks become ``'``, long text is cut; ``?`` for a missing value."""
    if is_missing(x):
        return "`?`"
    s = _CONTROL.sub(" ", str(x)).replace("`", "'").strip() or " "
    if len(s) > max_chars:
        s = s[: max_chars - 1] + "…"
    return f"`{s}`"


def is_missing(x: object) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def fmt(x: object, digits: int = 3) -> str:
    """A number with ``digits`` significant digits; ``–`` for missing/NaN."""
    if is_missing(x):
        return "–"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x)) if abs(int(x)) < 10**12 else f"{float(x):.{digits - 1}e}"
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return code(x)
    if math.isnan(v):
        return "–"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def pct(v: float, decimals: int = 1) -> str:
    return "–" if not np.isfinite(v) else f"{100 * v:.{decimals}f}%"


def prob(v: float) -> str:
    return "–" if not np.isfinite(v) else f"{v:.2f}"


def fmt_ci(mean: float, lo: float, hi: float, pct_: bool = False, prob_: bool = False) -> str:
    """``mean [lo, hi]`` (percentages when ``pct_``, two decimals when ``prob_``)."""
    f = pct if pct_ else prob if prob_ else fmt
    if not np.isfinite(mean):
        return "–"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"{f(mean)} [no CI]"
    return f"{f(mean)} [{f(lo)}, {f(hi)}]"


def fmt_p(p: float) -> str:
    if p is None or not np.isfinite(p):
        return "–"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def human(n: float) -> str:
    """1000000 → ``1M`` (parameter counts)."""
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:g}{suffix}"
    return f"{n:g}"


def clock(seconds: float) -> str:
    """A duration as progress lines print it: ``42s``, ``3m07s``."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


#: First characters that make a spreadsheet read a cell as a formula (OWASP, "CSV Injection").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def inert_cell(x: object) -> object:
    """A string that a spreadsheet would run as a formula, prefixed with ``'``; anything else
    (numbers, negative ones included) unchanged."""
    return "'" + x if isinstance(x, str) and x.startswith(FORMULA_START) else x


def write_csv(df: pd.DataFrame, path: str | Path) -> None:
    """``df.to_csv(path, index=False)`` with every string cell (and column name) made inert
    (:func:`inert_cell`): strategy names, errors and paths come from run records. Lines end in
    CRLF (RFC 4180), so that a cell holding a lone CR is quoted too (pandas quotes only the
    characters of the line terminator) and cannot start a row of its own."""
    out = df.copy()
    for col in out.columns:
        if not pd.api.types.is_numeric_dtype(out[col]) and not pd.api.types.is_bool_dtype(out[col]):
            out[col] = out[col].map(inert_cell)
    out.columns = [inert_cell(c) for c in out.columns]
    out.to_csv(path, index=False, lineterminator="\r\n")


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``
    (a reader sees the old file or the new one, never half of one). The file keeps its mode, or
    a new one gets the mode ``open`` would give it (``0o666`` less the umask), not the temporary
    file's ``0o600``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, _mode_of(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_of(path: Path) -> int:
    """The permission bits of ``path``, or those a new file gets from ``open`` (``0o666`` less
    the process umask, read by setting it and putting it back)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask
