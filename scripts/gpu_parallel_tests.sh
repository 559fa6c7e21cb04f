#!/usr/bin/env bash
# On the lent GPU machine, run groups of pytest node ids at once, one process per group, on one
# GPU: a tiny test engine takes two minutes to start there (Triton compiles in every process),
# so running the CUDA test modules one after the other needs several device calls.
#     source .gpu/env.sh && bash scripts/gpu_plugin.sh && \
#     bash scripts/gpu_parallel_tests.sh 560 "$OUT" "tests/a.py::t1 tests/a.py::t2" "tests/b.py"
# Arguments: a time limit in seconds for every group, a log directory, then one quoted group
# each. Each group logs to LOGDIR/group<N>.log (its node ids in group<N>.ids, its exit status
# and seconds in group<N>.rc); the script exits non-zero if any group failed. PARALLEL=N runs at
# most N groups at once, starting the next as one ends (default 0: all at once).
# Every test engine gets a fixed 2 GiB KV budget (VLLM_HPC_TEST_KV_CACHE_GIB, see
# tests/server_support.py), so the processes' memory profiling does not see each other. The GDN
# prefill kernel is FLA's Triton one unless VLLM_HPC_TEST_GDN_PREFILL_BACKEND says otherwise (the
# 0.32 staging has no FlashInfer); set it empty for vLLM's own choice (FlashInfer on Hopper with
# vLLM 0.34). Each log ends with pytest's lines for failed, erroring and skipped tests (-rfEs).
set -uo pipefail
LIMIT=$1
LOGDIR=$2
shift 2
export VLLM_WORKER_MULTIPROC_METHOD=spawn
export VLLM_HPC_TEST_GDN_PREFILL_BACKEND=${VLLM_HPC_TEST_GDN_PREFILL_BACKEND-triton}
export VLLM_HPC_TEST_KV_CACHE_GIB=${VLLM_HPC_TEST_KV_CACHE_GIB:-2}
mkdir -p "$LOGDIR"
PARALLEL=${PARALLEL:-0}
pids=()
n=0
for group in "$@"; do
  n=$((n + 1))
  # At most PARALLEL groups at once (0: all): the next starts when one ends.
  while [ "$PARALLEL" -gt 0 ] && [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n || true; done
  echo "$group" > "$LOGDIR/group$n.ids"
  # shellcheck disable=SC2086  # a group is a space-separated list of node ids
  ( t0=$SECONDS
    timeout -k 30 "$LIMIT" python3 -m pytest --tb=short -rfEs -s -p no:cacheprovider -o addopts="" \
      $group > "$LOGDIR/group$n.log" 2>&1
    echo "$? $((SECONDS - t0))" > "$LOGDIR/group$n.rc" ) &
  pids+=($!)
done
status=0
n=0
for pid in "${pids[@]}"; do
  n=$((n + 1))
  wait "$pid"
  read -r rc secs < "$LOGDIR/group$n.rc" || { rc=1; secs='?'; }
  [ "$rc" != 124 ] || echo "[gpu_parallel_tests.sh: stopped after its $LIMIT s]" >> "$LOGDIR/group$n.log"
  echo "group$n rc=$rc ${secs}s [$(cut -c1-120 "$LOGDIR/group$n.ids")]: $(tail -n 1 "$LOGDIR/group$n.log")"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
