"""``scalelab-reproduce``: the published claims (``claims/``), the runner (``cli.py``) that
launches their sweeps, and the page (``page.py``) written from their runs.
"""

__all__: list[str] = []
