"""The rules: one module per strategy, each registered with ``@register_strategy``
and discovered on ``import strategies``.
"""

__all__: list[str] = []
"""No names: each rule is a submodule (listing them here would make adding a rule two edits)."""
