"""Published loss-scaling claims that ``scalelab-reproduce`` tests (issue 22), one module each.

``CLAIMS`` lists them in the order of ``docs/reproductions.md``; :mod:`analysis.claims.base`
holds what they share (the :class:`~analysis.claims.base.Claim` description, findings, verdicts).
"""

from __future__ import annotations

from analysis.claims.adaloss import CLAIM as ADALOSS
from analysis.claims.base import Claim
from analysis.claims.fp8 import CLAIM as FP8
from analysis.claims.micikevicius2018 import CLAIM as MICIKEVICIUS2018
from analysis.claims.profiles import CLAIM as PROFILES
from analysis.claims.unit_scaling import CLAIM as UNIT_SCALING
from analysis.claims.wortsman2023 import CLAIM as WORTSMAN2023

#: Issue 22's order: mixed precision (2018), AdaLoss, unit scaling, FP8, Wortsman 2023, profiles.
CLAIMS: list[Claim] = [MICIKEVICIUS2018, ADALOSS, UNIT_SCALING, FP8, WORTSMAN2023, PROFILES]
