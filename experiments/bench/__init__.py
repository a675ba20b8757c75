"""``scalelab-bench``: strategy overhead and the statistics pass, CPU and GPU sections.
"""

__all__: list[str] = []
