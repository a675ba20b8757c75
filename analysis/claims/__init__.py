"""Published loss-scaling claims that ``scalelab-reproduce`` tests (issue 22), one module each.

``CLAIMS`` lists them in the order of ``docs/reproductions.md``; :mod:`analysis.claims.base`
holds what they share (the :class:`~analysis.claims.base.Claim` description, findings, verdicts).
"""

from __future__ import annotations

from analysis.claims.base import Claim
from analysis.claims.profiles import CLAIM as profiles_CLAIM

CLAIMS: list[Claim] = []
CLAIMS.append(profiles_CLAIM)
