"""Lower a function for an abstract NVIDIA H200 from a CPU-only machine (PALLAS.md section 2).

This runs the real Pallas -> Triton lowering, which rejects what the GPU cannot compile (value
slicing, scratch, non-power-of-two tiles), without a GPU. It does not compile Triton to PTX.
"""
import jax

_H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")


def lower_h200(fn, *args):
  specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H200)
  with jax.sharding.use_abstract_mesh(mesh):
    txt = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in txt, "no Triton custom call in the lowered module"
  return txt
