"""kda's Mosaic GPU kernels compiled while the program is still lowering.

XLA compiles each Mosaic GPU custom call's kernel (MLIR -> LLVM -> PTX -> ptxas) one after the other
while it compiles the program, after a lowering during which no kernel compiles: most of a cold
forward + backward compile. jaxlib keeps compiled kernels in a cache of the
process keyed by the kernel's hash, which any program's compile fills. So as each kda kernel is
lowered, a worker thread compiles a one-op program holding a copy of its custom call (the same
module, so the same hash): XLA's compile of the whole program then finds most kernels compiled.
XLA's compile releases the GIL, so the workers run beside the lowering.

Hooks jax 0.11.2's Pallas Mosaic GPU lowering, which calls
`jax.experimental.mosaic.gpu.core._mosaic_gpu_lowering_rule` for every kernel; only kernels named
`kda_*` are copied, and nothing changes where that function is missing, where no CUDA backend is
initialised (a CPU lowering for CUDA) or while the environment has KDA_PRECOMPILE=0 (`enabled()`).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
import time

log = logging.getLogger(__name__)


def enabled() -> bool:
  """Whether kernels are compiled ahead (read at each lowering: KDA_PRECOMPILE=0 turns it off)."""
  return os.environ.get("KDA_PRECOMPILE", "1") != "0"


WORKERS = max(1, min(8, (os.cpu_count() or 2) - 1))
KERNEL_PREFIX = "kda_"

_lock = threading.Lock()
_pool = None
_seen = set()
_futures = []
_installed = False
_backend = ()          # () not looked up yet; None: no CUDA backend


def install():
  """Wraps jax's Mosaic GPU lowering rule once (idempotent); False where jax has none to wrap."""
  global _installed
  with _lock:
    if _installed:
      return True
    try:
      from jax.experimental.mosaic.gpu import core as mcore
      original = mcore._mosaic_gpu_lowering_rule
    except (ImportError, AttributeError):
      return False

    def rule(ctx, *args, module, **params):
      outs = original(ctx, *args, module=module, **params)
      backend = _cuda_backend() if enabled() else None
      if backend is not None and _named_ours(module):
        try:
          _schedule(backend, outs)
        except Exception as e:     # the program's own compile still compiles the kernel
          log.debug("kda precompile skipped: %s", e)
      return outs

    rule.__wrapped__ = original
    mcore._mosaic_gpu_lowering_rule = rule
    _installed = True
    return True


def _named_ours(module):
  for op in module.body.operations:
    name = op.attributes["sym_name"] if "sym_name" in op.attributes else None
    if name is not None and str(name).strip('"').startswith(KERNEL_PREFIX):
      return True
  return False


def _cuda_backend():
  global _backend
  if _backend == ():
    try:
      from jax._src import xla_bridge
      _backend = xla_bridge.get_backend("cuda")
    except Exception:
      _backend = None
  return _backend


def standalone(custom_call):
  """MLIR bytecode of a module whose main function takes the custom call's operands and returns
  its results, with a copy of the op between (built in the op's context, on the lowering thread)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import func as func_d
  with custom_call.context, ir.Location.unknown():
    m = ir.Module.create()
    m.operation.attributes["sym_name"] = ir.StringAttr.get("kda_precompile")
    with ir.InsertionPoint(m.body):
      ftype = ir.FunctionType.get([o.type for o in custom_call.operands],
                                  [r.type for r in custom_call.results])
      f = func_d.FuncOp("main", ftype)
      f.attributes["sym_visibility"] = ir.StringAttr.get("public")
      block = f.add_entry_block()
      with ir.InsertionPoint(block):
        op = custom_call.clone()
        for i, a in enumerate(block.arguments):
          op.operands[i] = a
        func_d.ReturnOp(list(op.results))
    return m.operation.get_asm(binary=True)


def _schedule(backend, outs):
  global _pool
  if not outs:
    return
  blob = standalone(outs[0].owner.operation)
  key = hashlib.sha256(blob).digest()
  with _lock:
    if key in _seen:
      return
    _seen.add(key)
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="kda-precompile")
    _futures.append(_pool.submit(_compile, backend, blob))


def _compile(backend, blob):
  from jax._src import compiler
  t0 = time.perf_counter()
  options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
  backend.compile_and_load(blob, backend.local_devices()[:1], options)
  return time.perf_counter() - t0


def wait():
  """Blocks until every scheduled compile has ended; (count, seconds of compile summed, errors)."""
  with _lock:
    futures = list(_futures)
  done = concurrent.futures.wait(futures).done
  errors = [f.exception() for f in done if f.exception() is not None]
  return len(futures), sum(f.result() for f in done if f.exception() is None), errors
