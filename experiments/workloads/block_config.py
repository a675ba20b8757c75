"""The ``precision.blocks`` node of the block-scaled precision modes (``mxfp8``, ``fp8_blockwise``,
``nvfp4``), checked and turned into the recipes of :mod:`strategies.block_recipes`.

::

    blocks:
      recipe: mx                  # mx | fp8_blockwise | nvfp4
      activation: {elem: e4m3, block_size: 32, scale_rounding: floor, rounding: nearest}
      weight:     {...}           # the recipe's fields, per GEMM operand role
      gradient:   {...}
      keep: [head]                # Linear names (fnmatch patterns) kept in the autocast precision

Each role's mapping holds the fields of its recipe class (:class:`strategies.block_recipes.MX`,
``FP8Blockwise``, ``NVFP4``), every one stated in the YAML so that any can be overridden without
``+``. One exception to the recipe's meaning: NVFP4's ``rht`` of a role applies to that role's
**column-wise** copy only (the operands of the weight-gradient GEMM), as TE applies it
(``NVFP4BlockScaling``: "currently only applied to column-wise usage"); the weight has no such copy,
so ``weight.rht`` must be false. A bad option is one ``ValueError`` line naming
``precision.blocks.<role>.<field>`` and its allowed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from strategies.block_recipes import MX, NVFP4, FP8Blockwise, Recipe

__all__ = ["BLOCK_RECIPES", "BLOCK_ROLES", "BlockSpec", "parse_blocks"]

BLOCK_RECIPES: dict[str, type[Recipe]] = {"mx": MX, "fp8_blockwise": FP8Blockwise, "nvfp4": NVFP4}
BLOCK_ROLES = ("activation", "weight", "gradient")
"""The operands of a Linear's GEMMs: its input, its weight and the gradient of its output."""


@dataclass(frozen=True)
class BlockSpec:
    """The checked ``precision.blocks``: the recipe name, each role's row-wise recipe (the copy
    whose blocks run along the input-feature / output-feature dim), each role's column-wise recipe
    (blocks along the token dim for activation and gradient, along the output dim for the weight;
    NVFP4 with ``rht`` there where configured) and the kept Linear patterns."""

    recipe: str
    rowwise: dict[str, Recipe]
    columnwise: dict[str, Recipe]
    keep: tuple[str, ...] = ()


def _role(recipe: str, role: str, opts: Any) -> tuple[Recipe, Recipe]:
    """The row-wise and column-wise recipes of ``role`` from its option mapping."""
    cls, where = BLOCK_RECIPES[recipe], f"precision.blocks.{role}"
    if not isinstance(opts, dict):
        raise ValueError(f"{where} must be a mapping of {cls.__name__} options, got {opts!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"{where} has no option {unknown[0]!r}; allowed: {', '.join(allowed)}")
    if recipe == "nvfp4" and role == "weight" and opts.get("rht"):
        raise ValueError(f"{where}.rht must be false (TE applies the RHT to the weight-gradient GEMM's operands only), "
                         f"got {opts['rht']!r}")
    try:
        col = cls(**opts)
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None
    row = dataclasses.replace(col, rht=False) if recipe == "nvfp4" else col
    return row, col


def parse_blocks(cfg: Any) -> BlockSpec:
    """``precision.blocks`` checked (see the module docstring)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"precision.blocks must be a mapping with recipe, {', '.join(BLOCK_ROLES)} and keep, got {cfg!r}")
    unknown = sorted(set(cfg) - {"recipe", "keep", *BLOCK_ROLES})
    if unknown:
        raise ValueError(f"precision.blocks has no option {unknown[0]!r}; allowed: recipe, {', '.join(BLOCK_ROLES)}, keep")
    recipe = cfg.get("recipe")
    if recipe not in BLOCK_RECIPES:
        raise ValueError(f"precision.blocks.recipe must be one of {', '.join(BLOCK_RECIPES)}, got {recipe!r}")
    keep = cfg.get("keep") or []
    if not isinstance(keep, (list, tuple)) or not all(isinstance(k, str) and k for k in keep):
        raise ValueError(f"precision.blocks.keep must be a list of Linear names or fnmatch patterns, got {keep!r}")
    rows, cols = {}, {}
    for role in BLOCK_ROLES:
        rows[role], cols[role] = _role(recipe, role, cfg.get(role, {}))
    return BlockSpec(recipe, rows, cols, tuple(keep))
