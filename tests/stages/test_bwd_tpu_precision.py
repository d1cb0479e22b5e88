"""The dtype policy in the Mosaic MLIR of every TPU backward kernel. The interpreters compute float32
dots exactly whatever their precision says (TPU.md section 3), so the numeric tests cannot see a
float32 dot left at DEFAULT (one bf16 MXU pass on a TPU): here, every tpu.matmul with float32
operands must carry contract_precision<fp32> (float32 inputs: all of them; bf16 inputs: the 0/1
cumsum dots), and with bf16 inputs every other one must take bf16 operands."""
from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re

import pytest
from jax.experimental import pallas as pl

from tests.stages import tpu_bwd_setup as S

KERNELS = ["bwd_recompute", "bwd_dav", "bwd_dh", "bwd_wy", "bwd_intra", "bwd_gate", "bwd_fused"]


def _matmuls(stage, dtype, monkeypatch):
  mod = importlib.import_module("kda.fused.bwd_walk.mosaic_tpu" if stage == "bwd_fused" else f"kda.stages.{stage}.mosaic_tpu")
  orig = pl.pallas_call
  monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: orig(*a, **{**k, "debug": True}))   # prints the MLIR
  args, kw = S.specs(stage, dtype, HV=4, Ta=512)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    S.lower_tpu(functools.partial(mod.apply, **kw), *args)
  return re.findall(r"tpu\.matmul[^\n]*", out.getvalue())


@pytest.mark.parametrize("stage", KERNELS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_dot_precision_follows_the_dtype_policy(stage, dtype, monkeypatch):
  mms = _matmuls(stage, {"f32": S.F32, "bf16": S.BF16}[dtype], monkeypatch)
  assert mms, "no tpu.matmul in the lowered kernels"
  for m in mms:
    operands = re.findall(r"vector<[0-9x]+x(\w+)>", m)[:2]
    highest = "contract_precision<fp32>" in m
    if dtype == "f32" or "bf16" not in operands:
      assert operands == ["f32", "f32"] and highest, m
    else:
      assert operands == ["bf16", "bf16"] and not highest, m
