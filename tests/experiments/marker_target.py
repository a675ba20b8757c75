"""A module no config may reach: importing it or building its class writes a marker file
(``$SCALELAB_TEST_MARKER``), so a test sees whether a refused ``_target_`` ran or was imported."""

from __future__ import annotations

import os
from pathlib import Path


def _mark(what: str) -> None:
    path = os.environ.get("SCALELAB_TEST_MARKER")
    if path:
        with Path(path).open("a") as f:
            f.write(what + "\n")


_mark("imported")


class Marker:
    """Writes the marker when built (as a callback, launcher, sweeper or logging factory would be)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        _mark("built")
