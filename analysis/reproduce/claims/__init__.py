"""Published loss-scaling claims that ``scalelab-reproduce`` tests (issue 22), one module each.

``CLAIMS`` lists them in the order of ``docs/reproductions.md``; :mod:`analysis.reproduce.claims.base`
holds what they share (the :class:`~analysis.reproduce.claims.base.Claim` description, findings, verdicts).
"""

from __future__ import annotations

from analysis.reproduce.claims.adaloss import CLAIM as ADALOSS
from analysis.reproduce.claims.base import Claim
from analysis.reproduce.claims.fp8 import CLAIM as FP8
from analysis.reproduce.claims.micikevicius2018 import CLAIM as MICIKEVICIUS2018
from analysis.reproduce.claims.profiles import CLAIM as PROFILES
from analysis.reproduce.claims.unit_scaling import CLAIM as UNIT_SCALING
from analysis.reproduce.claims.wortsman2023 import CLAIM as WORTSMAN2023

#: Issue 22's order: mixed precision (2018), AdaLoss, unit scaling, FP8, Wortsman 2023, profiles.
CLAIMS: list[Claim] = [MICIKEVICIUS2018, ADALOSS, UNIT_SCALING, FP8, WORTSMAN2023, PROFILES]
