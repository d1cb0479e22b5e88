"""The little that the xla implementations (kda/stages/<stage>/xla.py, kda/fused/*_xla.py) share."""
from __future__ import annotations

import functools
import inspect

import jax


def compiled(fn):
  """fn under jax.jit with its keyword-only parameters static: called eagerly (op by op, as a
  test or a notebook calls chunk_kda) the stage is one compiled program instead of hundreds of
  small dispatches, each compiled apart the first time; under an outer jit it is inlined."""
  static = [n for n, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY]
  return functools.wraps(fn)(jax.jit(fn, static_argnames=static))
