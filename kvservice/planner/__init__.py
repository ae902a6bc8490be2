"""Request planner: CRAFT (CA-Table, reorder, CP-Tree, conversation dedup),
Cache-Craft (variant choice by CFO, top-N recompute) and the CacheBlend loading
controller. Pure Python, no torch: it runs on every request's path.

Entry point: `Planner(catalog, PlannerConfig()).plan(model_id, conv_id, chunks,
question_tokens)`; see docs/planner.md.
"""

from .catalog import TIERS, InMemoryCatalog, InvalidVariant, Variant, VariantCatalog
from .controller import LoadingController, ModelProfile, TierProfile
from .plan import FRESH, PREFIX, VARIANT, ChunkPlan, ChunkRef, Plan, PlanError, Planner, PlannerConfig
from .variants import fr_increment

__all__ = [
    "TIERS", "InMemoryCatalog", "InvalidVariant", "Variant", "VariantCatalog",
    "LoadingController", "ModelProfile", "TierProfile",
    "FRESH", "PREFIX", "VARIANT", "ChunkPlan", "ChunkRef", "Plan", "PlanError", "Planner",
    "PlannerConfig", "fr_increment",
]
