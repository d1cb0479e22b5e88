"""Lower a function for an abstract NVIDIA H200 from a CPU-only machine (PALLAS.md section 2), or
for an abstract TPU.

This runs the real Pallas -> Triton lowering, which rejects what the GPU cannot compile (value
slicing, scratch, non-power-of-two tiles), without a GPU. It does not compile Triton to PTX. The TPU
lowering needs no libtpu either: it checks that a program lowers for the platform at all.
"""
import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")


def h200_mesh():
  """A context in which Pallas' Triton lowering takes the abstract H200 for the GPU it needs."""
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200))


def lower_h200(fn, *args):
  specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  with h200_mesh():
    txt = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in txt, "no Triton custom call in the lowered module"
  return txt


# Device kinds of the TPU generations the Mosaic TPU kernels target (kda._mosaic_tpu.GENERATIONS)
TPU_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v7x": "TPU7x"}


def lower_tpu(fn, *args, gen="v7x"):
  """Mosaic TPU lowering for an abstract TPU of generation `gen` (no TPU, no libtpu): the jax-side
  Mosaic lowering, which rejects block shapes and primitives a TPU cannot take (TPU.md, section 4).
  Under the abstract mesh pltpu.get_tpu_info() answers for `gen`, so tiles follow its VMEM.
  Returns the number of Mosaic kernels in the lowered module."""
  specs = jax.tree.map(lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  dev = jax.sharding.AbstractDevice(device_kind=TPU_KINDS[gen], num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
    txt = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
  return txt.count("stablehlo.custom_call @tpu_custom_call")
