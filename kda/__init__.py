"""kda: varlen chunked Kimi Delta Attention in JAX, as a staged pipeline (jnp references + Pallas kernels)."""
__version__ = "0.2.0.dev0"

from kda import fused, padding, plan, reference, stages
from kda.api import chunk_kda
from kda.plan import PipelineConfig, Plan

__all__ = ["chunk_kda", "reference", "padding", "stages", "fused", "plan", "Plan", "PipelineConfig", "__version__"]
