"""Published loss-scaling claims that ``scalelab-reproduce`` tests (issue 22), one module each.

``CLAIMS`` lists them in the order of ``docs/reproductions.md``; :mod:`analysis.claims.base`
holds what they share (the :class:`~analysis.claims.base.Claim` description, findings, verdicts).
"""

from __future__ import annotations

from analysis.claims.base import Claim
from analysis.claims.micikevicius2018 import CLAIM as micikevicius2018_CLAIM

CLAIMS: list[Claim] = []
CLAIMS.append(micikevicius2018_CLAIM)
