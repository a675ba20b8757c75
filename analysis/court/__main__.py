"""``python -m analysis.court RUN_DIR [--page docs/court.md] [--quick]``
(:func:`analysis.court.page.main`)."""

import sys

from analysis.court.page import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
