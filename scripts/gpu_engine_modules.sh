#!/usr/bin/env bash
# On the lent GPU machine, run every real-engine test module (those marked `engine`) on CUDA, in
# two halves of parallel groups, one device call each (a call runs at most 10 minutes):
#     source .gpu/env.sh && bash scripts/gpu_plugin.sh && \
#     bash scripts/gpu_engine_modules.sh 1 540 "$OUT/t"      # then, in the next call, 2
# Arguments: the half (1 or 2), a time limit in seconds for every group, a log directory, and
# optionally the number of groups (default 8). Modules are dealt out in name order, one to each
# group in turn, through scripts/gpu_parallel_tests.sh. The server modules need the OpenAI
# server's wheels (`.gpu/srvwhl`) installed into the staged site directory, and
# tests/test_ray_executor.py needs Ray (`scripts/gpu_ray_parcel.sh`). tests/test_quantized.py's eight
# CUDA variants (16 engines) outgrow one group: run them a variant a group, as
# benchmarks/results/gpu_quantized.md does, and leave it out here with SKIP=tests/test_quantized.py.
# Likewise tests/test_cuda_graphs.py (seven compiled engines) did not finish in one group beside
# ten others: run it an engine a group (benchmarks/results/gpu_engine_modules.md). SKIP takes
# several paths, one a line: SKIP=$'tests/test_quantized.py\ntests/test_cuda_graphs.py'.
set -uo pipefail
PART=$1
LIMIT=$2
LOGDIR=$3
GROUPS_N=${4:-8}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t modules < <(grep -l "pytest.mark.engine" tests/test_*.py | grep -v -x -F "${SKIP:-none}" | sort)
half=$(( (${#modules[@]} + 1) / 2 ))
if [ "$PART" = 1 ]; then
  chosen=("${modules[@]:0:$half}")
else
  chosen=("${modules[@]:$half}")
fi
groups=()
for i in "${!chosen[@]}"; do
  g=$(( i % GROUPS_N ))
  groups[g]="${groups[g]:-} ${chosen[i]}"
done
echo "part $PART: ${#chosen[@]} of ${#modules[@]} engine modules in ${#groups[@]} groups"
exec bash scripts/gpu_parallel_tests.sh "$LIMIT" "$LOGDIR" "${groups[@]}"
