"""The rules: one module per strategy, each registered with ``@register_strategy``
and discovered on ``import strategies``.
"""
