#!/usr/bin/env bash
# On the lent GPU machine, run groups of pytest node ids at once, one process per group, on one
# GPU: a tiny test engine takes two minutes to start there (Triton compiles in every process),
# so running the CUDA test modules one after the other needs several device calls.
#     source .gpu/env.sh && bash scripts/gpu_plugin.sh && \
#     bash scripts/gpu_parallel_tests.sh 560 "$OUT" "tests/a.py::t1 tests/a.py::t2" "tests/b.py"
# Arguments: a time limit in seconds for every group, a log directory, then one quoted group
# each. Each group logs to LOGDIR/group<N>.log; the script exits non-zero if any group failed.
# Every test engine gets a fixed 2 GiB KV budget (VLLM_HPC_TEST_KV_CACHE_GIB, see
# tests/server_support.py), so the processes' memory profiling does not see each other.
set -uo pipefail
LIMIT=$1
LOGDIR=$2
shift 2
export VLLM_WORKER_MULTIPROC_METHOD=spawn
export VLLM_HPC_TEST_GDN_PREFILL_BACKEND=${VLLM_HPC_TEST_GDN_PREFILL_BACKEND:-triton}
export VLLM_HPC_TEST_KV_CACHE_GIB=${VLLM_HPC_TEST_KV_CACHE_GIB:-2}
mkdir -p "$LOGDIR"
pids=()
n=0
for group in "$@"; do
  n=$((n + 1))
  # shellcheck disable=SC2086  # a group is a space-separated list of node ids
  timeout "$LIMIT" python3 -m pytest --tb=short -s -p no:cacheprovider -o addopts="" \
    $group > "$LOGDIR/group$n.log" 2>&1 &
  pids+=($!)
done
status=0
n=0
for pid in "${pids[@]}"; do
  n=$((n + 1))
  wait "$pid"
  rc=$?
  echo "group$n rc=$rc: $(tail -n 1 "$LOGDIR/group$n.log")"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
