"""kda._lowering_cache: a kernel lowered again comes from the cache, and every cached module is the
lowered one (the same operations and attributes, the dump name and one default attribute that the
bytecode round trip writes out aside)."""
import re

import jax
import pytest

from kda import _lowering_cache
from tools import bench, compile_report


def _modules(lowered):
  """{kernel name: [its Mosaic GPU modules as text, without locations]} of a lowered program."""
  from jax._src.lib.mlir import ir
  found = {}
  module = lowered.compiler_ir("stablehlo")
  from jax._src.interpreters import mlir
  from jax.experimental.mosaic import gpu as mgpu
  ctx = mlir.make_ir_context()
  mgpu.dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True     # the modules are stored in their serialized dialects

  def visit(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if inner.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in inner.attributes:
            cfg = inner.attributes["mhlo.backend_config"]
            if "module" in cfg:
              kernel = ir.Module.parse(ir.StringAttr(cfg["module"]).value_bytes, context=ctx)
              text = kernel.operation.get_asm(enable_debug_info=False)
              text = re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", text)
              # the global's default unnamed_addr, written out by the bytecode round trip
              text = text.replace("unnamed_addr = 0 : i64, ", "")
              name = re.search(r"module @(\w+)", text).group(1)
              found.setdefault(name, []).append(text)
          visit(inner.operation)
  visit(module.operation)
  return found


def _lower(fn, specs):
  jax.clear_caches()      # JAX's own caches would hand back a program lowered before
  with compile_report.as_hopper(True):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


@pytest.fixture
def programs(monkeypatch):
  monkeypatch.setenv("KDA_PRECOMPILE", "0")
  with compile_report.as_hopper(True):
    args, fwd, loss = bench.calls("B", "plain", "auto", total=2048)
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  return fwd, jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), specs


def test_cached_kernels_are_the_lowered_ones(programs, monkeypatch):
  fwd, fb, specs = programs
  monkeypatch.setenv("KDA_LOWERING_CACHE", "0")
  _lowering_cache.clear()
  plain = _modules(_lower(fb, specs))   # off: B's rerun lowers its kernels a second time, none from a cache
  assert _lowering_cache.stats["hits"] == 0 and _lowering_cache.stats["misses"] == 0
  monkeypatch.setenv("KDA_LOWERING_CACHE", "1")
  _lowering_cache.clear()
  _lower(fwd, specs)
  misses = _lowering_cache.stats["misses"]
  cached = _modules(_lower(fb, specs))
  assert _lowering_cache.stats["hits"] >= 4           # the forward's kernels, lowered again in fb
  assert _lowering_cache.stats["misses"] > misses     # the backward's, lowered for the first time
  assert sorted(plain) == sorted(cached) and all(n.startswith("kda_") for n in plain)
  for name in plain:
    assert sorted(plain[name]) == sorted(cached[name]), name
