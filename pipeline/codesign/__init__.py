"""Harness co-design: the operators that propose harness variants (``operators``) and the advancement step
that scores them with the candidate's adapters (``step``)."""

from pipeline.codesign.operators import (
    OPERATORS,
    HarnessVariant,
    parent_variant,
    propose_variants,
    variant_label,
)
from pipeline.codesign.step import codesign_step

__all__ = [
    "OPERATORS",
    "HarnessVariant",
    "codesign_step",
    "parent_variant",
    "propose_variants",
    "variant_label",
]
