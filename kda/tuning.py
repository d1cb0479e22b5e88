"""The defaults table: which Config each stage, fused group and the pipeline run with.

One table keyed by (stage or group, backend, device generation, dtype, K, V, chunk size); a row's
key fields may be None (any). Rows apply in order, later rows refining earlier ones, on top of the
Config class's own defaults. A user's `config={name: Config}` replaces the table's choice.

Generations: "sm90" (H100, H200), "gpu" (other CUDA GPUs), "v5e", "v6e", "v7x" (TPU), "cpu". The
TPU kernels size their tiles from the generation's VMEM (kda._mosaic_tpu's table) per call, where
no row here names them.
"""
from __future__ import annotations

import dataclasses

Key = tuple  # (name, backend, generation, dtype, K, V, chunk_size)

TABLE: list[tuple[Key, dict]] = [
    # K = 256 in the Triton state and output kernels (float16 / float32 inputs: the Mosaic GPU
    # kernels take bf16): the carried state's two [128, BV] slabs and the dot tiles of BV = 64 ask
    # Triton for more shared memory than an H200 block has; BV = 32 halves them
    (("state", "pallas", None, None, 256, None, None), dict(block_v=32)),
    (("output", "pallas", None, None, 256, None, None), dict(block_v=32)),
    # the pipeline: segmented pieces of many short sequences (Mosaic GPU kernels only take them)
    (("pipeline", None, None, None, None, None, None), dict(segment_pieces=16, segment_walks=256)),
]


def _matches(key: Key, want: Key) -> bool:
  return all(k is None or k == w for k, w in zip(key, want))


def _fields(name, backend, generation, dtype, K, V, chunk_size) -> dict:
  want = (name, backend, generation, dtype, K, V, chunk_size)
  out = {}
  for key, fields in TABLE:
    if _matches(key, want):
      out.update(fields)
  return out


def default_config(op, backend: str, *, generation, dtype, K, V, chunk_size):
  """The table's Config for backend `backend` of stage or group `op`. None where it has no Config,
  and where the backend computes its default per call (mosaic_tpu: the heads per program that fit
  the generation's VMEM, from the call's head count and dtypes: its module's `default_config`) and
  no row of the table names it."""
  cls = op.config_type(backend)
  if cls is None:
    return None
  fields = _fields(op.name, backend, generation, dtype, K, V, chunk_size)
  if not fields and hasattr(getattr(op, backend), "default_config"):
    return None
  known = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in fields.items() if k in known})


def pipeline_fields(*, generation, dtype, K, V, chunk_size) -> dict:
  """The table's fields of kda.plan.PipelineConfig."""
  return _fields("pipeline", "", generation, dtype, K, V, chunk_size)
