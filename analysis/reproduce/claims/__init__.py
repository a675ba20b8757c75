"""Published loss-scaling claims that ``scalelab-reproduce`` tests (issue 22), one module each.

Every module of this package that defines ``CLAIM`` (a
:class:`~analysis.reproduce.claims.base.Claim`) is found and imported here, as ``import strategies``
finds the rules: a new claim is one module here and one ``conf/experiment/repro_<name>.yaml``, no
other edit. :data:`CLAIMS` lists them in
the order of ``docs/reproductions.md``: by ``Claim.order``, then name.
:mod:`analysis.reproduce.claims.base` holds what they share (the claim, findings, verdict rules).
"""

from __future__ import annotations

import importlib
import pkgutil

from analysis.reproduce.claims.base import Claim

__all__ = ["CLAIMS", "discover"]


def discover() -> list[Claim]:
    """The ``CLAIM`` of every module of this package that has one, by ``order`` then name."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        claim = getattr(module, "CLAIM", None)
        if isinstance(claim, Claim):
            found.append(claim)
    return sorted(found, key=lambda c: (c.order, c.name))


#: Every claim, in page order.
CLAIMS: list[Claim] = discover()
