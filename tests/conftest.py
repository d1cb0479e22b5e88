"""The CI budget (15 minutes on a 2-core CPU machine, DESIGN.md): tests whose coverage other tests
in the default run already give are moved to the `large` run (`pytest -m large`, run on the
device machine) by node id here, with their measured CPU seconds, rather than by editing each
parametrization. Each entry keeps a sibling case in the default run."""
from __future__ import annotations

import os

import pytest

# CPU runs (CI): XLA's backend at optimization level 0 compiles the tests' many small programs
# faster (a simulator-heavy file 47 s against 61) and they run as fast at these sizes. Before any
# test imports jax; the multidevice subprocess inherits it.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# kda's lowering cache on (the default), whatever the environment says: the tests that compare two
# configs' lowered programs compare kernels (without it every lowering names its module apart, so
# any two programs differ).
os.environ["KDA_LOWERING_CACHE"] = "1"

CI_BUDGET_LARGE = {
    # id: seconds on the 2-core CPU (pytest --durations), and what stays in the default run
    "tests/test_fused_gate_intra.py::test_fused_equals_unfused_kernels[bf16]": 11.5,   # [f32], [strong], [mixed]
    "tests/test_fused_gate_intra.py::test_fused_kernels_lower_for_cuda[bf16]": 10.2,   # [f32]
    "tests/test_fused_gate_intra.py::test_fused_equals_unfused_kernels[strong]": 7.3,  # [mixed] (the two-part kernel)
    "tests/test_fused_state_output.py::test_pipeline_fuses_state_and_output_only_when_both_select_mosaic_gpu": 21.4,  # packed-group tests
    "tests/test_tools.py::test_bench_backward_pieces": 17.6,              # test_bench_smoke_table_and_pieces
    "tests/test_tools.py::test_trace_plot_writes_png": 3.8,               # the trace tool's text tests
    "tests/stages/test_intra_mosaic.py::test_packed_equals_aligned[K64-V64-HV2]": 9.5,   # [K128-V128-HV1-strong]
    "tests/stages/test_intra_mosaic.py::test_packed_kernels_lower_for_cuda[64-128]": 5.1,  # test_packed_kernels_smem,
    "tests/stages/test_intra_mosaic.py::test_packed_kernels_lower_for_cuda[128-128]": 7.0,  # test_segment_masks' lowering
    "tests/stages/test_intra_mosaic.py::test_packed_unwritten_tail": 7.8,   # the gate's; tests/test_pipeline.py's packed runs (TAIL_ZEROS=False)
    "tests/test_grad.py::test_custom_vjp_matches_autodiff_of_the_forward_stages[trailing_empty+13nan-f32-BT32-noh0]": 6.0,  # [softplus-in-kernel+7nan-f32-BT32]
    "tests/test_extreme_gates.py::test_gate_in_kernel_extremes[pallas]": 8.6,   # [reference], the mosaic simulator tests
    "tests/test_extreme_gates.py::test_bf16_never_nan[pallas]": 7.7,            # [reference]
    "tests/test_pipeline.py::test_packed_backward_equals_the_aligned_one": 38.0,  # the stages' packed-mode tests, the packed lowering
    "tests/test_extreme_gates.py::test_forward_f32[one_inf-reference]": 10.9,  # [one_inf-pallas], the other reference patterns
    "tests/test_grad.py::test_grad_matches_recurrence[45_80_20-bf16-BT64]": 7.7,  # boundaries-f32-BT64
    "tests/test_extreme_gates.py::test_forward_f32[-1e5-pallas]": 3.3,          # [one_inf-pallas], [-1e4-pallas]
    "tests/test_extreme_gates.py::test_forward_f32[-1e3-pallas]": 3.1,
    "tests/test_extreme_gates.py::test_forward_f32[sprinkled-pallas]": 3.2,
    "tests/test_extreme_gates.py::test_forward_f32[all_inf-pallas]": 3.0,
    "tests/test_grad.py::test_grad_matches_recurrence[trailing_empty+13nan-f32-BT32-noh0]": 6.2,  # softplus-in-kernel+7nan
    "tests/test_grad.py::test_grad_matches_recurrence[with_empty-gva-l2norm-f32-BT32]": 5.9,  # softplus-in-kernel-gva-l2norm-bf16
    "tests/test_grad.py::test_grad_matches_recurrence[K96-V96-f32-BT32]": 4.4,         # boundaries-f32-BT64
    "tests/test_grad.py::test_grad_matches_recurrence[K192-V192-f32-BT64]": 3.9,
    "tests/test_grad.py::test_grad_matches_recurrence[strong-safe_gate-f32-BT64]": 4.1,  # sigmoid-lb5-safe-in-kernel
    "tests/stages/test_intra.py::test_kernel_matches_reference[T128-K128-V32-BT64-bf16]": 5.8,
    "tests/stages/test_intra.py::test_kernel_matches_reference[30_50-K96-V96-BT64-f32]": 5.5,
    "tests/stages/test_intra.py::test_kernel_matches_reference[T64-K64-V32-BT64-bf16-huge]": 4.9,
    "tests/stages/test_intra.py::test_kernel_matches_reference[T128-K128-V64-BT64-f32-pairwise]": 4.3,
    "tests/stages/test_intra.py::test_kernel_matches_reference[T128-K128-V32-BT64-f32-strong]": 3.9,
    "tests/stages/test_intra.py::test_kernel_matches_reference[100-K96-V32-BT32-bf16]": 3.7,
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_long_sequences[K64-V64]": 6.3,  # [K128-V128]
    "tests/stages/test_state_mosaic.py::test_state_bf16_stores[K128-V64]": 5.5,      # [K64-V64]
    "tests/stages/test_state_mosaic.py::test_state_bf16_stores[K64-V128-direct-stores]": 5.0,
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_boundaries[K128-V64]": 4.1,  # [K64-V64]
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_configs[direct-stores]": 3.7,
    "tests/stages/test_gate_mosaic.py::test_packed_configs[tma-stores-unroll8]": 3.4,  # the default config's tests
    "tests/stages/test_gate_mosaic.py::test_packed_configs[no-unroll]": 2.2,
    "tests/test_fused_state_output.py::test_fused_packed_o_equals_unaligned[K128-V64-split]": 3.8,  # [K128-V128-split-bf16]
    "tests/test_fused_state_output.py::test_fused_packed_o_equals_unaligned[K64-V128-serial-bf16]": 2.7,
    "tests/test_fused_state_output.py::test_fused_matches_composed_references_warp_specialized[K128-V128]": 2.8,
    "tests/test_pipeline.py::test_head_dims[K96]": 2.8,                   # [K64], [K128]
    "tests/test_pipeline.py::test_head_dims[K192]": 2.9,
    "tests/test_pipeline.py::test_head_dims[K64-V96]": 3.1,
    "tests/stages/test_bwd_intra_mosaic.py::test_kernel_matches_reference[K128-HV2-100-strong-nonunit-auto]": 4.3,
    # six levels on the strong case: test_flipped_config_matches_the_reference, test_bounded_levels_run_where_flagged
    "tests/stages/test_bwd_intra_mosaic.py::test_kernel_matches_reference[K64-HV2-40_64-strong-unit-never]": 10.0,
    # the bf16 body lowers in test_kernel_smem[128-True-40968]
    "tests/stages/test_bwd_dav_mosaic.py::test_kernel_lowers_for_cuda[128-all_bf16]": 0.4,
    "tests/stages/test_bwd_dh_mosaic.py::test_bwd_dh_matches_reference_and_emulation[K64-V64]": 5.8,  # [K128-V128]
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K128-V128-HV1-64_50-ordinary-unit-never]": 4.0,  # the other five
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K128-V128-HV1-64_50-ordinary-nonunit-auto]": 3.4,
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K64-V64-HV2-100_20-ordinary-unit-never]": 3.1,
    "tests/stages/test_bwd_gate_mosaic.py::test_kernel_matches_reference[softplus-f32-HV2-K128]": 4.1,  # the other two
    "tests/stages/test_gate_mosaic.py::test_kernel_matches_reference[softplus-f32-HV2-K128]": 2.3,  # the other seven
    "tests/stages/test_gate_mosaic.py::test_kernel_matches_reference[softplus-nobias-f32-HV1-K128]": 2.0,
    "tests/test_extreme_gates.py::test_gradients_f32[one_inf]": 5.7,     # [all_inf], [-1e4], [sprinkled]
    "tests/test_pipeline.py::test_seq_lens_matrix[30_50-f32-BT64]": 3.8,  # the other three
    # the packed forward's wiring: test_packed_backward_equals_the_aligned_one checks its o too
    "tests/test_pipeline.py::test_packed_group_runs_and_equals_the_aligned_kernels": 15.5,
    # the grouped walks (2026-12-02): one case of each in the default run
    "tests/stages/test_state_mosaic.py::test_state_grouped_walk_same_bits[G3-f32-stores]": 6.1,   # [G2]
    "tests/test_fused_state_output.py::test_fused_grouped_walk_same_bits[G3]": 3.1,              # [G2]
    # 2026-12-03 (seconds of a two-worker run); the gate -> intra group's pipeline test stays (the
    # default path), its [f32] equality case does not ([mixed], [one_strong] cover the one-part kernel)
    "tests/test_fused_gate_intra.py::test_fused_equals_unfused_kernels[f32]": 24.7,
    "tests/stages/test_bwd_gate.py::test_bwd_gate_matches_vjp_of_gate[plain]": 14.6,  # the other cases
    # fourth session, for the inverse mode's tests (CI 930-965 s on a 2-core machine): one case of each
    # parametrised test below stays in the default run with its code path (the kernel, K, dtype)
    "tests/stages/test_gate_mosaic.py::test_packed_matches_aligned[softplus-nobias-f32-HV2-K64-T3]": 6.3,
    "tests/stages/test_gate_mosaic.py::test_kernel_matches_reference[softplus-bf16-HV2-K64]": 5.4,
    "tests/stages/test_gate_mosaic.py::test_kernel_matches_reference[identity-f32-HV2-K64]": 5.4,
    "tests/stages/test_gate_mosaic.py::test_packed_lowers_for_cuda[softplus-bfloat16-HV16-K128-cfg]": 8.1,
    "tests/stages/test_state_mosaic.py::test_state_matches_bf16_emulation[K64-V64]": 5.0,
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_configs[seq-minor-grid]": 6.0,
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_boundaries[K64-V128]": 4.1,
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_empty_sequence[K128-V64]": 3.2,
    "tests/test_fused_state_output.py::test_fused_packed_o_segment_gaps[split-bf16]": 8.3,
    "tests/test_fused_state_output.py::test_fused_packed_o_equals_unaligned[K128-V128-split-bf16]": 7.9,
    "tests/test_fused_state_output.py::test_fused_matches_composed_references_warp_specialized[K64-V64-HV2]": 4.6,
    "tests/stages/test_bwd_gate_mosaic.py::test_kernel_matches_reference[identity-f32-HV2-K64]": 5.4,
    "tests/stages/test_bwd_gate_mosaic.py::test_packed_equals_aligned_unaligned[sigmoid-f32]": 5.9,
    "tests/stages/test_bwd_gate_mosaic.py::test_extreme_raw_gates_and_huge_A[softplus]": 5.2,
    "tests/stages/test_segment_masks.py::test_intra_with_segments_matches_reference_on_the_bounded_path[64-False]": 7.2,
    "tests/stages/test_segment_masks.py::test_bwd_intra_with_segments_matches_reference_on_the_bounded_path[64-False]": 3.7,
    "tests/stages/test_intra.py::test_kernel_matches_reference[45_80_20-K64-V64-BT32-f32-raw]": 4.9,
    "tests/test_fused_state_output.py::test_fused_packed_o_segment_gaps[one-program-per-sequence]": 6.8,
    "tests/stages/test_bwd_gate_mosaic.py::test_packed_equals_aligned_unaligned[gaps-empty-bf16-softplus]": 8.6,
    "tests/stages/test_bwd_gate_mosaic.py::test_kernel_matches_reference[sigmoid-noA-nobias-bf16-HV1-K128]": 4.1,
    "tests/stages/test_gate_mosaic.py::test_packed_matches_aligned[small-f32-HV2-K64]": 7.9,
    "tests/stages/test_gate_mosaic.py::test_packed_extreme_gates[softplus]": 4.2,
    "tests/stages/test_gate_mosaic.py::test_kernel_matches_reference[sigmoid-noA-f32-HV2-K64]": 2.9,
    "tests/stages/test_gate_mosaic.py::test_kernel_matches_reference[sigmoid-noA-nobias-bf16-HV1-K128]": 3.4,
    "tests/stages/test_intra.py::test_kernel_matches_reference[T64-K32-V32-BT32-f32-extreme]": 3.2,
    "tests/stages/test_intra.py::test_kernel_matches_reference[with_empty-K64-V96-BT16-bf16-raw]": 3.4,
    "tests/test_extreme_gates.py::test_forward_f32[-1e4-pallas]": 4.8,
    "tests/test_extreme_gates.py::test_forward_f32[-1e3-reference]": 4.6,
    # the xla path and confinement: one dtype or one input each stays in the default run
    "tests/test_extreme_gates.py::test_xla_forward_and_gradients_every_pattern[bfloat16]": 14.1,  # [float32]
    "tests/stages/test_intra_xla.py::test_matches_reference[bf16-BT32]": 13.4,   # [f32-BT64], [extreme-BT16]
    "tests/test_nan_confinement.py::test_nan_stays_in_its_sequence[q-reference]": 9.0,   # [q-xla] and the others
    "tests/test_nan_confinement.py::test_nan_stays_in_its_sequence[k-reference]": 9.0,   # [k-xla]
    "tests/test_nan_confinement.py::test_nan_stays_in_its_sequence[beta-reference]": 9.0,  # [beta-xla]
    "tests/test_segmented.py::test_a_non_finite_value_stays_in_its_sequence[q]": 10.0,  # [v], [g], [do], [g-at-a-reset]
    # sixth session (CI 1049 s): one sibling of each stays in the default run
    "tests/test_tools.py::test_compile_report_lowers_the_program_and_each_kernel": 35.3,  # the lowering tests below
    "tests/test_tools.py::test_cpu_check_smoke": 25.9,                     # the xla path's tests
    "tests/test_tools.py::test_stages_tool_compares_the_mosaic_gpu_kernels": 14.0,  # the stages tool's other tests
    "tests/stages/test_segment_masks.py::test_kernels_with_segments_lower_for_cuda": 21.7,  # test_segmented's step
    "tests/test_pipeline.py::test_packed_backward_lowers_for_cuda": 17.6,  # test_segmented's step, test_multidevice's
    "tests/test_elide_states.py::test_elided_variants_lower_for_cuda": 8.2,  # the walk variants' simulator tests
    "tests/test_fused_tpu.py::test_fused_equal_unfused_and_close_to_reference[A]": 17.7,  # [B]
    "tests/stages/test_gate_mosaic.py::test_packed_matches_aligned[boundaries-tail-plain-f32-HV2-K64]": 13.4,  # [gaps-empty-softplus-bf16-HV1-K128]
    "tests/test_grad.py::test_grad_matches_recurrence[sigmoid-lb5-safe-in-kernel-gva-f32-BT64]": 9.5,  # softplus-in-kernel-gva-l2norm-bf16
    "tests/stages/test_intra_mosaic.py::test_config_field_changes_the_program[bounded-never]": 9.8,  # [approx_math-False]
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K64-V64-HV2-100_20-ordinary-unit-auto]": 7.4,  # the other five
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K128-V128-HV1-64_50-strong-unit-never]": 6.0,
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K64-V64-HV2-100_20-strong-unit-never]": 5.4,
    "tests/stages/test_intra.py::test_kernel_matches_reference[T128-K64-V64-BT64-bf16-strong]": 7.0,  # [30_50-K32-V32-BT32-f32-huge]
    "tests/stages/test_bwd_dh_xla.py::test_matches_reference[f32-BT64]": 8.7,     # [bf16-BT32], [extreme-BT16]
    "tests/stages/test_gate_xla.py::test_matches_reference[f32-BT64]": 6.0,       # [bf16-BT32], [extreme-BT16]
    "tests/stages/test_state_mosaic.py::test_state_matches_reference_configs[input-order]": 6.6,  # [swizzled-stages], [lane]
    "tests/stages/test_output_mosaic.py::test_output_matches_reference_varlen[K128-V128]": 5.9,  # the other three
    "tests/test_validate.py::test_validate_names_argument_index_and_value[seg_negative]": 4.6,  # [seg_too_many]
    "tests/test_validate.py::test_validate_names_argument_index_and_value[cu_past_T]": 3.1,     # [cu_start], [cu_decreasing]
    "tests/test_validate.py::test_validate_names_argument_index_and_value[beta_nan]": 3.9,      # [q_nan], [g_nan], [v_inf]
    "tests/test_fused_state_output.py::test_fused_matches_composed_references_serial[K128-V128]": 4.4,  # the other three
    "tests/test_fused_state_output.py::test_fused_variants_same_bits[one-slot]": 4.1,  # the other two
    "tests/test_pipeline.py::test_seq_lens_matrix[45_80_20-f32-BT64]": 4.8,       # [45_80_20-bf16-BT64] and nine others
    "tests/test_pipeline.py::test_seq_lens_matrix[100_50-f32-BT32]": 2.7,
    "tests/test_pipeline.py::test_seq_lens_matrix[long_short-f32-BT64]": 2.4,
    "tests/test_extreme_gates.py::test_gradients_f32[-1e4]": 6.8,                 # [all_inf], [sprinkled]
    "tests/test_fused_gate_intra.py::test_fused_equals_unfused_kernels[one_strong]": 10.7,  # [mixed]
    "tests/test_segmented.py::test_forward_with_final_state_lowers_without_while_loops": 15.0,  # the step's
    "tests/test_extreme_gates.py::test_gradients_f32_autodiff_path": 10.0,  # test_grad's custom_vjp vs autodiff
    # (the same session, a second pass: 852 s of tests on an idle 2-core machine before it)
    "tests/test_fused_gate_intra.py::test_fused_equals_unfused_kernels[mixed]": 26.3,  # test_one_part_keeps_the_bounded_chunks, the pipeline test
    "tests/stages/test_intra_mosaic.py::test_packed_equals_aligned[K128-V128-HV1-strong]": 14.5,  # test_packed_defer_solve, the packed pipeline tests
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K64-V64-HV2-100_20-strong-unit-auto]": 8.1,  # the other three
    "tests/stages/test_intra_mosaic.py::test_kernel_matches_reference[K128-V64-HV1-40_64-ordinary-unit-auto]": 6.8,
    "tests/test_grad.py::test_grad_matches_recurrence[softplus-in-kernel+7nan-f32-BT32]": 8.9,  # the other two; NaN: test_nan_confinement
    "tests/test_extreme_gates.py::test_forward_f32[one_inf-pallas]": 9.3,     # the reference patterns, the simulator's
    "tests/test_extreme_gates.py::test_gradients_f32[sprinkled]": 7.0,        # [all_inf]
    "tests/stages/test_bwd_intra_xla.py::test_matches_reference[f32-BT64]": 7.9,  # [bf16-BT32]
    "tests/stages/test_state_xla.py::test_matches_reference[f32-BT64]": 7.0,      # [bf16-BT32]
    "tests/test_fused_gate_intra.py::test_fused_matches_member_references[moderate]": 5.8,  # [f32]
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.nodeid in CI_BUDGET_LARGE:
      item.add_marker(pytest.mark.large)
