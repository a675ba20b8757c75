"""The doctor's verdict on one step: :class:`Diagnosis`, its causes and their exit codes, and
the per-layer damage rows it reports (:class:`LayerDamage`), with their text and JSON forms.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CAUSES", "EXIT_CODES", "Diagnosis", "LayerDamage", "cos_text", "pct"]

CAUSES = (
    "healthy",
    "scale_overflow",
    "forward_overflow",
    "nan_in_data_or_loss",
    "grads_not_cleared",
    "lr_spike",
    "gradient_overflow",
    "underflow",
    "block_clipping",
)
"""Every verdict class, in the order of their exit codes."""

EXIT_CODES = {
    "healthy": 0,
    "scale_overflow": 1,
    # 2 is left to command-line errors (argparse's usage code).
    "forward_overflow": 3,
    "nan_in_data_or_loss": 4,
    "grads_not_cleared": 5,
    "lr_spike": 6,
    "gradient_overflow": 7,
    "underflow": 8,
    "block_clipping": 9,
}
"""Exit code of ``scalelab-doctor`` per cause (2: the run directory or the command line is bad)."""

@dataclass
class LayerDamage:
    """Underflow damage of one layer's gradient at one scale, against the fp32 gradient."""

    layer: str
    scale: float
    lost_frac: float
    cosine: float
    found_inf: bool


@dataclass
class Diagnosis:
    """The doctor's verdict on one step (the decision list: :mod:`strategies.doctor.decide`)."""

    cause: str
    verdict: str
    fix: str
    precision: str
    scale: float
    first_module: str | None = None
    tensor: str | None = None
    value: float | None = None
    evidence: list[str] = field(default_factory=list)
    per_layer: list[LayerDamage] = field(default_factory=list)
    strategy_scales: dict[str, float] = field(default_factory=dict)
    not_compared: dict[str, str] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.cause]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["exit_code"] = self.exit_code
        return out

    def to_json_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with non-finite numbers as the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
        return _finite_json(self.to_dict())

    def to_json(self) -> str:
        """JSON text of :meth:`to_json_dict`."""
        return json.dumps(self.to_json_dict(), indent=2)

    def one_line(self) -> str:
        """The verdict in one line, e.g. for an error message: ``cause at module: verdict; fix: ...``."""
        where = f" at {self.first_module}" if self.first_module else ""
        return f"doctor: {self.cause}{where}: {self.verdict}; fix: {self.fix}"

    def table(self) -> str:
        """The per-layer damage as fixed-width text: one row per layer, one column pair per scale."""
        scales = sorted({d.scale for d in self.per_layer})
        names = list(dict.fromkeys(d.layer for d in self.per_layer))
        if not names:
            return ""
        cell = {(d.layer, d.scale): d for d in self.per_layer}
        width = max(len(n) for n in names + ["layer"])
        head = f"{'layer':<{width}}" + "".join(f"  {'S=' + _num(s) + ' lost/cos':>22}" for s in scales)
        rows = [head]
        for n in names:
            parts = []
            for s in scales:
                d = cell.get((n, s))
                parts.append(f"  {'-':>22}" if d is None else f"  {pct(d.lost_frac) + ' / ' + cos_text(d):>22}")
            rows.append(f"{n:<{width}}" + "".join(parts))
        return "\n".join(rows)

    def text(self) -> str:
        """The verdict readable at a glance: cause, where, value, fix, evidence, damage table."""
        lines = [f"verdict: {self.cause.upper()} — {self.verdict}"]
        if self.first_module is not None:
            where = f"{self.first_module}" + (f" ({self.tensor})" if self.tensor else "")
            lines.append(f"where:   {where}" + (f", value {_num(self.value)}" if self.value is not None else ""))
        lines.append(f"fix:     {self.fix}")
        lines += [f"  - {e}" for e in self.evidence]
        if self.strategy_scales:
            lines.append("scales the strategies would choose: "
                         + ", ".join(f"{k}={_num(v)}" for k, v in sorted(self.strategy_scales.items())))
        table = self.table()
        if table:
            lines += ["per-layer underflow (lost nonzero entries / cosine vs fp32):", table]
        return "\n".join(lines)


def _finite_json(node: Any) -> Any:
    if isinstance(node, float) and not math.isfinite(node):
        return str(node)
    if isinstance(node, dict):
        return {k: _finite_json(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_finite_json(v) for v in node]
    return node


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def pct(v: float) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{100 * v:.1f}%"


def cos_text(d: LayerDamage) -> str:
    """A layer's cosine to fp32 with four decimals (``inf`` where it overflowed, ``nan`` where undefined)."""
    return "inf" if d.found_inf else ("nan" if d.cosine != d.cosine else f"{d.cosine:.4f}")
