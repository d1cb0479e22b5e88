#!/bin/bash
# One H200 device call that checks and measures the backward, each step cut to the time left:
#   1. tools.gpu_check_bwd (long sequences): every backward kernel against its stage reference,
#      the kernels' variants timed beside the defaults, jax.grad against the reference, bit
#      determinism;
#   2. tools.gpu_check_edges' NaN confinement (short sequences; q and do spoiled);
#   3. tools.bench on A, B, C (all of them only with 150 s left, else B), then the peers
#      (../shared/peer/run_peer.sh copied to .peer, their wheels in .whl: see that script);
#   4. with time left, shape B with S3's split kernel (bwd_wy.split=1).
# Everything lands in $OUT (logs and JSON). Device call: carry [".peer", ".whl"], command
#   bash scripts/h200_round.sh SECONDS        (SECONDS: what the call may take in all)
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
END=$(( $(date +%s) + ${1:-590} - 10 ))
nvidia-smi -L > $O/gpu.txt 2>&1
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }; t() { echo "[$(el)s] $*"; }
lim() { local l=$(( END - $(date +%s) )); [ $l -lt $1 ] && echo $l || echo $1; }
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
timeout $left python3 -m tools.bench --variants B:plain --impls auto --reps 10 --config bwd_wy.split=1 --out $O/kda_B_split.json > $O/bench_split.log 2>&1; echo "rc=$?" >> $O/bench_split.log
tail -4 $O/bench_split.log
fi
t done
