#!/bin/bash
# One H200 device call that checks and measures the backward, each step cut to the time left:
#   1. tools.gpu_check_bwd (long sequences): every backward kernel against its stage reference,
#      the kernels' variants timed beside the defaults, jax.grad against the reference, bit
#      determinism;
#   2. tools.gpu_check_edges' NaN confinement (short sequences; q and do spoiled);
#   3. tools.bench on A, B, C (all of them only with 150 s left, else B), then the peers
#      (../shared/peer/run_peer.sh copied to .peer, their wheels in .whl: see that script);
#   4. with time left, shape B with S3's split kernel (bwd_wy.split=1), then with pipeline.defer_qg=1.
# Phase 2 (a second call): tools.gpu_check_edges' K = V = 256 and 128 x 256 cases, the per-stage
# profile of A, B, C (tools.profile), then tools.bench_states with traced cu_seqlens.
# Everything lands in $OUT (logs and JSON). Device call: carry [".peer", ".whl"], command
#   bash scripts/h200_round.sh SECONDS [2]    (SECONDS: what the call may take in all)
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
END=$(( $(date +%s) + ${1:-590} - 10 ))
nvidia-smi -L > $O/gpu.txt 2>&1
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }; t() { echo "[$(el)s] $*"; }
lim() { local l=$(( END - $(date +%s) )); [ $l -lt $1 ] && echo $l || echo $1; }
if [ "${2:-1}" = 2 ]; then
t dims
timeout $(lim 150) python3 -m tools.gpu_check_edges --parts dims --dtypes bfloat16 --out $O/dims.json > $O/dims.log 2>&1; echo "rc=$?" >> $O/dims.log
tail -3 $O/dims.log
t profile
timeout $(lim 240) python3 -m tools.profile --variants A:plain,B:plain,C:plain --no-fwd --reps 3 --out $O/kda_profile.json > $O/profile.log 2>&1; echo "rc=$?" >> $O/profile.log
tail -3 $O/profile.log
t states
timeout $(lim 600) python3 -m tools.bench_states --many 200000x1 --reps 5 --out $O/states_traced.json > $O/states.log 2>&1; echo "rc=$?" >> $O/states.log
tail -3 $O/states.log
t done; exit 0
fi
t check_bwd
timeout $(lim 120) python3 -m tools.gpu_check_bwd --cases long --gates plain --reps 5 --repeat 2 --out $O/check_bwd_long.json > $O/check_bwd_long.log 2>&1; echo "rc=$?" >> $O/check_bwd_long.log
tail -3 $O/check_bwd_long.log
t edges
timeout $(lim 90) python3 -m tools.gpu_check_edges --parts nan --dtypes bfloat16 --where q,do --lengths 1-3 --out $O/edges.json > $O/edges.log 2>&1; echo "rc=$?" >> $O/edges.log
tail -3 $O/edges.log
v=A:plain,B:plain,C:plain; [ $(lim 999) -lt 150 ] && v=B:plain
t "bench $v"
timeout $(lim 180) python3 -m tools.bench --variants $v --impls auto --reps 10 --out $O/kda.json > $O/bench.log 2>&1; echo "rc=$?" >> $O/bench.log
tail -6 $O/bench.log
t peer
timeout $(lim 140) bash .peer/run_peer.sh A,B,C > $O/peer.log 2>&1; echo "rc=$?" >> $O/peer.log
tail -6 $O/peer.log
left=$(lim 600)
t "split B ($left s left)"
if [ $left -gt 40 ]; then
timeout $(lim 90) python3 -m tools.bench --variants B:plain --impls auto --reps 10 --config bwd_wy.split=1 --out $O/kda_B_split.json > $O/bench_split.log 2>&1; echo "rc=$?" >> $O/bench_split.log
tail -4 $O/bench_split.log
fi
left=$(lim 600)
t "defer_qg B ($left s left)"
if [ $left -gt 40 ]; then
timeout $left python3 -m tools.bench --variants B:plain --impls auto --reps 10 --config pipeline.defer_qg=1 --out $O/kda_B_defer.json > $O/bench_defer.log 2>&1; echo "rc=$?" >> $O/bench_defer.log
tail -4 $O/bench_defer.log
fi
t done
