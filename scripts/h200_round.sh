#!/bin/bash
# Two H200 device calls that measure and check the backward, each step cut to the time left.
# Phase 1 (what decides defaults, all in one call): tools.bench on A, B, C (only B with less than
#   150 s left), the peers (../shared/peer/run_peer.sh copied to .peer, their wheels in .whl: see
#   that script), then A, B, C with pipeline.defer_qg=1.
# Phase 2 (where kernels changed since their last device check): tools.gpu_check_bwd (long
#   sequences: every backward kernel against its stage reference, the kernels' variants timed
#   beside the defaults, jax.grad against the reference, bit determinism), tools.gpu_check_edges'
#   NaN confinement (short sequences; q and do spoiled) and K = V = 256 and 128 x 256 cases.
# Phase 3: the per-stage profile of A, B, C (tools.profile), A and C with bwd_wy.split=1, then
#   tools.bench_states with traced cu_seqlens (and its device time by piece).
# Phase 4 CONFIG (a candidate default, tools.configs' text, e.g. bwd_wy.terms=1): A, B, C with the
#   default and with CONFIG in one call, the backward's gradient checks and bits (tools.gpu_check_bwd
#   --cases short: the candidates' gradients beside the default's), NaN confinement with CONFIG, the
#   peers (so both configs stand beside them in one call), then, if time is left, the per-stage
#   profile of A with CONFIG (which kernel of a combined CONFIG moved) and the K = V = 256 cases with
#   CONFIG.
# Phase 5 (the stage short's kernels): tools.gpu_check_edges' states part (a call with states over
#   many short sequences against the recurrence, NaN confinement), tools.bench_states traced (with
#   its profile) and concrete, then the K = V = 256 cases if time is left.
# Phase 6 CONFIG... (which candidate to make the default): the per-stage profile of A, B, C
#   (forward + backward) with the default, then with each CONFIG, then the backward's gradient checks
#   (the candidates' gradients and times beside the default's) if time is left.
# Everything lands in $OUT: the JSON, and every step's output in one round.log (a device call
# brings back at most 8 files). Device call: carry [".peer", ".whl"], command
#   bash scripts/h200_round.sh SECONDS [2|3|4 CONFIG|5|6 CONFIG...]    (SECONDS: what the call may take in all)
# .dev/extra.sh OUT, where present (an ignored path: carry it), runs in phase 3 before the states.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
END=$(( $(date +%s) + ${1:-590} - 10 ))
L=$O/round.log
nvidia-smi -L > $L 2>&1
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }; t() { echo "[$(el)s] $*" | tee -a $L; }
# run LIMIT TAIL CMD...: CMD's output appended to round.log, its exit status after it, its last TAIL lines shown
run() { local lim=$1 n=$2; shift 2; timeout $lim "$@" > /tmp/step.log 2>&1; echo "rc=$?" >> /tmp/step.log; cat /tmp/step.log >> $L; tail -$n /tmp/step.log; }
# lim N: N seconds, or what is left if less (at least 1: timeout 0 would mean no limit)
lim() { local l=$(( END - $(date +%s) )); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
if [ "${2:-1}" = 2 ]; then
t check_bwd
run $(lim 200) 3 python3 -m tools.gpu_check_bwd --cases long --gates plain --reps 5 --repeat 2 --out $O/check_bwd_long.json
t edges
run $(lim 90) 3 python3 -m tools.gpu_check_edges --parts nan --dtypes bfloat16 --where q,do --lengths 1-3 --out $O/edges.json
run $(lim 170) 3 python3 -m tools.gpu_check_edges --parts dims --dtypes bfloat16 --out $O/dims.json
t done; exit 0
fi
if [ "${2:-1}" = 4 ]; then
cfg=$3
t "bench default"
run $(lim 140) 6 python3 -m tools.bench --variants A:plain,B:plain,C:plain --impls auto --reps 10 --out $O/kda.json
t "bench $cfg"
run $(lim 140) 6 python3 -m tools.bench --variants A:plain,B:plain,C:plain --impls auto --reps 10 --config $cfg --out $O/kda_candidate.json
t check_bwd
run $(lim 120) 4 python3 -m tools.gpu_check_bwd --cases short --gates plain --total 8192 --reps 3 --repeat 2 --out $O/check_bwd.json
t "edges $cfg"
run $(lim 80) 3 python3 -m tools.gpu_check_edges --parts nan --dtypes bfloat16 --where q,do --lengths 1-3 --config $cfg --out $O/edges.json
t peer
run $(lim 150) 6 bash .peer/run_peer.sh A,B,C
if [ $(lim 999) -gt 90 ]; then
t "profile A $cfg"
run $(lim 90) 3 python3 -m tools.profile --variants A:plain --no-fwd --reps 3 --config $cfg --out $O/kda_profile_candidate.json
fi
if [ $(lim 999) -gt 60 ]; then
t "dims $cfg"
run $(lim 130) 3 python3 -m tools.gpu_check_edges --parts dims --dtypes bfloat16 --config $cfg --out $O/dims.json
fi
t done; exit 0
fi
if [ "${2:-1}" = 6 ]; then
shift 2
i=0
for cfg in "" "$@"; do     # "": the default, kda_profile_0.json
t "profile ${cfg:-default}"
run $(lim 150) 3 python3 -m tools.profile --variants A:plain,B:plain,C:plain --no-fwd --reps 3 ${cfg:+--config $cfg} --out $O/kda_profile_$i.json
i=$((i + 1))
done
if [ $(lim 999) -gt 100 ]; then
t check_bwd
run $(lim 120) 4 python3 -m tools.gpu_check_bwd --cases short --gates plain --total 8192 --reps 3 --repeat 2 --out $O/check_bwd.json
fi
t done; exit 0
fi
if [ "${2:-1}" = 5 ]; then
t "edges states"
run $(lim 150) 3 python3 -m tools.gpu_check_edges --parts states --total 20000 --out $O/states_check.json
t "states traced"
run $(lim 200) 8 python3 -m tools.bench_states --many 200000x1 --reps 5 --profile /tmp/kda-states-profile --out $O/states_traced.json
t "states concrete"
run $(lim 120) 4 python3 -m tools.bench_states --many 200000x1 --reps 5 --concrete --out $O/states_concrete.json
t "short's tests, compiled"
run $(lim 90) 3 python3 -m pytest -q -p no:cacheprovider tests/stages/test_short.py
if [ $(lim 999) -gt 60 ]; then
t "dims"
run $(lim 150) 3 python3 -m tools.gpu_check_edges --parts dims --dtypes bfloat16 --out $O/dims.json
fi
t done; exit 0
fi
if [ "${2:-1}" = 3 ]; then
t profile
run $(lim 150) 3 python3 -m tools.profile --variants A:plain,B:plain,C:plain --no-fwd --reps 3 --out $O/kda_profile.json
t split
run $(lim 120) 3 python3 -m tools.profile --variants A:plain,C:plain --no-fwd --reps 3 --config bwd_wy.split=1 --out $O/kda_profile_split.json
if [ -f .dev/extra.sh ]; then t extra; run $(lim 210) 40 bash .dev/extra.sh $O; fi
t states
run $(lim 600) 3 python3 -m tools.bench_states --many 200000x1 --reps 5 --profile /tmp/kda-states-profile --out $O/states_traced.json
t done; exit 0
fi
v=A:plain,B:plain,C:plain; [ $(lim 999) -lt 150 ] && v=B:plain
t "bench $v"
run $(lim 180) 6 python3 -m tools.bench --variants $v --impls auto --reps 10 --out $O/kda.json
t peer
run $(lim 200) 6 bash .peer/run_peer.sh A,B,C
left=$(lim 600)
t "defer_qg ($left s left)"
if [ $left -gt 40 ]; then
run $left 6 python3 -m tools.bench --variants $v --impls auto --reps 10 --config pipeline.defer_qg=1 --out $O/kda_defer_qg.json
fi
t done
