"""Published loss-scaling claims that ``scalelab-reproduce`` tests (issue 22), one module each.

``CLAIMS`` lists them in the order of ``docs/reproductions.md``; :mod:`analysis.claims.base`
holds what they share (the :class:`~analysis.claims.base.Claim` description, findings, verdicts).
"""

from __future__ import annotations

from analysis.claims.adaloss import CLAIM as adaloss_CLAIM
from analysis.claims.base import Claim

CLAIMS: list[Claim] = []
CLAIMS.append(adaloss_CLAIM)
