"""What every Pallas kernel shares: GPU compiler params, feature padding, precision choices.

Interpret or not is decided once, in the composer (`Plan.interpret`, from the platform), and passed
to every launcher as an explicit `interpret` argument.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltr

# f32 dots on Triton default to TF32; HIGHEST gives IEEE float32 (the CPU interpreter always does).
HI = lax.Precision.HIGHEST
NT_DIMS = (((1,), (1,)), ((), ()))   # a @ b^T
TN_DIMS = (((0,), (0,)), ((), ()))   # a^T @ b


def compiler_params(num_warps: int = 4, num_stages: int = 2):
  return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def pad_dim(x, axis: int, size: int):
  """Zero-pad x along `axis` to `size` (feature dims that tiles need as powers of two)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


# Config.precision names -> f32 dot precision on GPU. "highest" is IEEE float32 (FMA units, slow);
# "tf32x3" splits each operand into TF32 parts (3 tensor-core passes, ~float32 accuracy); "tf32" is
# one pass (~1e-3 relative error per dot).
DOT_PRECISIONS = {
    "highest": HI,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": lax.Precision.DEFAULT,
}


def dot_precision(name: str, interpret: bool):
  """The precision for f32 dots; the CPU interpreter supports only HIGHEST (it is float32 anyway)."""
  return HI if interpret else DOT_PRECISIONS[name]


def check_config(cfg):
  """Checks the launch fields a stage Config has (num_warps, num_stages, precision, block_v)."""
  if cfg.num_warps < 1 or cfg.num_warps & (cfg.num_warps - 1):
    raise ValueError(f"num_warps must be a power of two, got {cfg.num_warps}")
  if cfg.num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {cfg.num_stages}")
  precision = getattr(cfg, "precision", None)
  if precision is not None and precision not in DOT_PRECISIONS:
    raise ValueError(f"precision must be one of {sorted(DOT_PRECISIONS)}, got {precision!r}")
  for field in ("block_v", "block_k"):
    b = getattr(cfg, field, None)
    if b is not None and (b < 16 or b & (b - 1)):
      raise ValueError(f"{field} must be a power of two >= 16 (Triton dot tiles), got {b}")
