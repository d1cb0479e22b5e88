"""kda: varlen chunked Kimi Delta Attention in JAX, as a staged pipeline (jnp reference + Pallas)."""
from kda import padding, reference, stages
from kda.api import chunk_kda
from kda.pipeline import Plan

__all__ = ["chunk_kda", "reference", "padding", "stages", "Plan"]
