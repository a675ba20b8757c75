"""``scalelab-doctor``: the CLI (:mod:`.cli`), the diagnosis of a stopped run (:mod:`.diagnosis`),
and the labelled fault suite (:mod:`.cases`) with its evaluation and page (:mod:`.evaluate`).
The doctor's library is :mod:`strategies.doctor`.
"""

__all__: list[str] = []
"""No names: each part is a submodule."""
