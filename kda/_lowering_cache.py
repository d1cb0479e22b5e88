"""kda's Mosaic GPU kernels lowered once per process, whatever program calls them.

Lowering a Mosaic GPU kernel (jaxpr -> Mosaic GPU module, layout inference, dialect lowering) is
most of the time JAX takes to lower a kda program for a GPU, and JAX redoes it in every program
that calls the kernel: a forward + backward lowers the forward's kernels again after the forward
alone was compiled, an evaluation step after a training step, and so on. jax also names each
lowered module apart (a process-wide counter in its `mosaic_gpu.dump_basename`), so the same kernel
gets a new hash and is compiled for CUDA again.

This module keeps, per process, each kda kernel's lowered module as bytecode, keyed by what the
lowering reads: the kernel's name, its jaxpr (printed), the mesh, the abstract operands and results
and the compiler params. A later lowering of the same kernel parses that bytecode into its own
MLIR context instead of lowering again; the first lowering's module is handed out in the same
parsed form, so every program calling the kernel carries the same bytes (and hash) and the CUDA
compile of one serves them all. The parsed module is the lowered one: the same operations and
attributes (tests/test_lowering_cache.py compares them for every kernel of a forward + backward),
its locations those of the first program that lowered it.

Hooks jax 0.11.2's `jax._src.pallas.mosaic_gpu.lowering.lower_unpipelined_jaxpr_to_module`; only
kernels named `kda_*` are cached. On unless the environment has KDA_LOWERING_CACHE=0 (`enabled()`,
read at each lowering): every lowering then runs, as jax does it.
"""
from __future__ import annotations

import collections
import hashlib
import os
import threading

KERNEL_PREFIX = "kda_"
MAX_ENTRIES = 256              # kernels kept (least recently used dropped); a kda program holds ~20

_lock = threading.Lock()
_cache: collections.OrderedDict = collections.OrderedDict()
_installed = False
stats = collections.Counter()  # "hits", "misses": lowerings served from the cache and done


def enabled() -> bool:
  """Whether lowered kernels are reused (KDA_LOWERING_CACHE=0 turns it off)."""
  return os.environ.get("KDA_LOWERING_CACHE", "1") != "0"


def clear():
  """Forget every cached kernel (the next lowering of each lowers again)."""
  with _lock:
    _cache.clear()
    stats.clear()


def key(jaxpr, mesh, jax_mesh, avals_in, avals_out, params) -> bytes:
  """What a kernel's lowering depends on, as a digest (the traceback only places locations)."""
  text = "\n".join([jaxpr.debug_info.func_name, str(mesh), str(jax_mesh), repr(params),
                    ";".join(map(str, avals_in)), ";".join(map(str, avals_out)), str(jaxpr)])
  return hashlib.sha256(text.encode()).digest()


def install():
  """Wraps jax's lowering of an unpipelined Mosaic GPU kernel once (idempotent); False where jax has
  none to wrap."""
  global _installed
  with _lock:
    if _installed:
      return True
    try:
      from jax._src.pallas.mosaic_gpu import lowering
      from jax._src.lib.mlir import ir
      original = lowering.lower_unpipelined_jaxpr_to_module
      result_type = lowering.LoweringResult
    except (ImportError, AttributeError):
      return False

    def lower(mesh, jax_mesh, jaxpr, avals_in, avals_out, params, *args, **kwargs):
      name = getattr(getattr(jaxpr, "debug_info", None), "func_name", "") or ""
      if not (enabled() and name.startswith(KERNEL_PREFIX)):
        return original(mesh, jax_mesh, jaxpr, avals_in, avals_out, params, *args, **kwargs)
      k = key(jaxpr, mesh, jax_mesh, avals_in, avals_out, params)
      with _lock:
        entry = _cache.get(k)
        if entry is not None:
          _cache.move_to_end(k)
      if entry is None:
        res = original(mesh, jax_mesh, jaxpr, avals_in, avals_out, params, *args, **kwargs)
        if res.profiler_spec is not None:      # a profiled kernel writes its own trace: not shared
          return res
        entry = (res.module.operation.get_asm(binary=True),
                 (res.grid, res.block, res.new_out_shapes, res.profiler_spec, res.gmem_scratch_shapes))
        with _lock:
          _cache[k] = entry
          while len(_cache) > MAX_ENTRIES:
            _cache.popitem(last=False)
          stats["misses"] += 1
      else:
        with _lock:
          stats["hits"] += 1
      asm, rest = entry
      return result_type(ir.Module.parse(asm), *rest)

    lower.__wrapped__ = original
    lowering.lower_unpipelined_jaxpr_to_module = lower
    _installed = True
    return True
