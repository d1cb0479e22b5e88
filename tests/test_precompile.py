"""kda._precompile: each kda kernel lowered for CUDA is handed, as a one-op program holding a copy
of its custom call, to a worker that compiles it (here a fake CUDA backend records the programs)."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda import _precompile


class FakeCuda:
  """Records what it is asked to compile; raises if told to."""

  def __init__(self, fail=False):
    self.calls, self.fail, self.threads = [], fail, []

  def local_devices(self):
    return ["gpu0"]

  def compile_and_load(self, blob, devices, options):
    self.threads.append(threading.current_thread().name)
    if self.fail:
      raise RuntimeError("no compiler here")
    self.calls.append((blob, devices, options))


@pytest.fixture
def fake(monkeypatch):
  backend = FakeCuda()
  monkeypatch.setattr(_precompile, "_backend", backend)
  monkeypatch.setattr(_precompile, "_seen", set())
  monkeypatch.setattr(_precompile, "_futures", [])
  monkeypatch.setenv("KDA_PRECOMPILE", "1")
  assert _precompile.install()
  return backend


def _kernel(name, n=128, bump=1.0):
  def body(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * y_ref[...] + bump
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n,), jnp.float32), kernel_name=name)


def _lower(f, n=128):
  x = jax.ShapeDtypeStruct((n,), jnp.float32)
  return jax.jit(lambda a, b: f(a, b) * 2.0).trace(x, x).lower(lowering_platforms=("cuda",))


def _custom_calls(module_text_or_blob):
  with mlir.make_ir_context():
    m = ir.Module.parse(module_text_or_blob)
    found = []

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for o in block.operations:
            if o.operation.name == "stablehlo.custom_call":
              found.append((str(o.attributes["call_target_name"]), str(o.attributes["mhlo.backend_config"]),
                            [str(a.type) for a in o.operands], [str(r.type) for r in o.results]))
            walk(o.operation)
    walk(m.operation)
    main = [o for o in m.body.operations if str(o.attributes["sym_name"]) == '"main"']
    return found, str(main[0].attributes["function_type"]) if main else None


def test_kda_kernel_is_handed_over_as_a_one_op_program(fake):
  lowered = _lower(_kernel("kda_probe"))
  n, _, errors = _precompile.wait()
  assert (n, errors) == (1, []) and len(fake.calls) == 1
  assert all(t.startswith("kda-precompile") for t in fake.threads)
  blob, devices, _ = fake.calls[0]
  assert devices == ["gpu0"]
  got, ftype = _custom_calls(blob)
  want, _ = _custom_calls(lowered.as_text())
  assert len(got) == 1 and got == want           # the same target, backend config (kernel hash, module)
  assert got[0][0] == '"mosaic_gpu_v2"'
  assert ftype == "(tensor<128xf32>, tensor<128xf32>) -> tensor<128xf32>"


def test_every_kernel_of_a_program(fake):
  f, g = _kernel("kda_a"), _kernel("kda_b", bump=2.0)
  x = jax.ShapeDtypeStruct((128,), jnp.float32)
  lowered = jax.jit(lambda a, b: g(f(a, b), b)).trace(x, x).lower(lowering_platforms=("cuda",))
  n, _, errors = _precompile.wait()
  assert (n, errors, len(fake.calls)) == (2, [], 2)
  want, _ = _custom_calls(lowered.as_text())
  got = [_custom_calls(blob)[0][0] for blob, _, _ in fake.calls]
  assert len(want) == 2 and sorted(got) == sorted(want)


def test_other_kernels_and_switch_off_are_left_alone(fake, monkeypatch):
  _lower(_kernel("someone_elses"))
  monkeypatch.setenv("KDA_PRECOMPILE", "0")
  _lower(_kernel("kda_off"))
  assert _precompile.wait()[0] == 0 and fake.calls == []


def test_no_cuda_backend_no_work(monkeypatch):
  monkeypatch.setattr(_precompile, "_backend", None)       # a CPU lowering for CUDA, as in CI
  monkeypatch.setattr(_precompile, "_futures", [])
  _lower(_kernel("kda_cpu"))
  assert _precompile.wait()[0] == 0


def test_a_failed_compile_is_reported_not_raised(monkeypatch):
  backend = FakeCuda(fail=True)
  monkeypatch.setattr(_precompile, "_backend", backend)
  monkeypatch.setattr(_precompile, "_seen", set())
  monkeypatch.setattr(_precompile, "_futures", [])
  lowered = _lower(_kernel("kda_fails"))            # the lowering itself is unaffected
  assert "mosaic_gpu_v2" in lowered.as_text()
  n, _, errors = _precompile.wait()
  assert n == 1 and len(errors) == 1 and "no compiler here" in str(errors[0])
