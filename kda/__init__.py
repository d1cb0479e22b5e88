"""kda: varlen chunked Kimi Delta Attention in JAX, as a staged pipeline (jnp reference + Pallas)."""
__version__ = "0.2.0.dev0"

from kda import padding, reference, stages
from kda.api import chunk_kda
from kda.pipeline import Plan

__all__ = ["chunk_kda", "reference", "padding", "stages", "Plan"]
