#!/usr/bin/env bash
# On the lent GPU machine, run every real-engine test module (those marked `engine`) on CUDA in
# parallel groups, through scripts/gpu_parallel_tests.sh. In two halves, one device call each (a
# call runs at most 10 minutes), as the vLLM 0.32 runs did:
#     source .gpu/env.sh && bash scripts/gpu_plugin.sh && \
#     bash scripts/gpu_engine_modules.sh 1 540 "$OUT/t"      # then, in the next call, 2
# or all of them in one detached job (`scripts/gpu_vllm034.sh modules` does this on vLLM 0.34):
#     SPLIT=... PARALLEL=8 bash scripts/gpu_engine_modules.sh all 1200 /tmp/jobs/m 0
# Arguments: the part (1 or 2: a half of the modules; all; split: the SPLIT groups alone), a time
# limit in seconds for every group, a log directory, and optionally the number of groups the
# modules are dealt into (default 8; 0: a module a group). Modules are dealt out in name order,
# one to each group in turn. SKIP leaves modules out, SPLIT runs modules a parametrization a
# group, one path a line each (SKIP=$'tests/a.py\ntests/b.py'):
# - SPLIT: its node ids are collected here and grouped by their parameters' id (the text in
#   brackets; the tests without one together), so that module-scoped variants run in processes
#   of their own. tests/test_quantized.py's eight CUDA variants (16 engines) outgrow one group,
#   and tests/test_cuda_graphs.py (seven compiled engines) did not finish in one group beside ten
#   others (benchmarks/results/gpu_engine_modules.md): they ran a variant (an engine) a group.
#   Parts all and split run the SPLIT groups first (they hold the compiled engines), then the
#   other modules; parts 1 and 2 leave the SPLIT modules out.
# PARALLEL (gpu_parallel_tests.sh) bounds how many groups run at once.
# On vLLM 0.32 the server modules need the OpenAI server's wheels (`.gpu/srvwhl`) installed into
# the staged site directory, and tests/test_ray_executor.py needs Ray (`scripts/gpu_ray_parcel.sh`);
# on vLLM 0.34, scripts/stage_vllm034.sh stages both (Ray among its extras).
set -uo pipefail
PART=$1
LIMIT=$2
LOGDIR=$3
GROUPS_N=${4:-8}
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
mapfile -t modules < <(grep -l "pytest.mark.engine" tests/test_*.py | grep -v -x -F "${SKIP:-none}" | sort)
mapfile -t split < <(printf '%s\n' "${modules[@]}" | grep -x -F "${SPLIT:-none}")
mapfile -t plain < <(printf '%s\n' "${modules[@]}" | grep -v -x -F "${SPLIT:-none}")

# The groups of one SPLIT module: its node ids by the text in their brackets.
split_groups() { # MODULE -> lines, one group (space-separated node ids) each
  local module=$1 ids id key keys=()
  declare -A by_key=()
  mkdir -p "$LOGDIR"
  ids=$(python3 -m pytest --collect-only -q -p no:cacheprovider -o addopts="" "$module" 2>&1 \
    | tee "$LOGDIR/collect_$(basename "$module" .py).log" | grep '::')
  if [ -z "$ids" ]; then echo "$module"; return; fi   # run it whole: its log says why
  while read -r id; do
    key="(none)"
    [[ "$id" == *"["*"]" ]] && key=${id##*[}
    [ -n "${by_key[$key]+x}" ] || keys+=("$key")
    by_key[$key]="${by_key[$key]:-} $id"
  done <<< "$ids"
  for key in "${keys[@]}"; do echo "${by_key[$key]# }"; done
}

case "$PART" in
  1|2)
    half=$(( (${#plain[@]} + 1) / 2 ))
    if [ "$PART" = 1 ]; then chosen=("${plain[@]:0:$half}"); else chosen=("${plain[@]:$half}"); fi ;;
  all) chosen=("${plain[@]}") ;;
  split) chosen=() ;;
  *) echo "part: 1, 2, all or split" >&2; exit 2 ;;
esac
groups=()
if [ "$PART" = all ] || [ "$PART" = split ]; then
  for module in "${split[@]}"; do
    mapfile -t -O "${#groups[@]}" groups < <(split_groups "$module")
  done
fi
first=${#groups[@]}
for i in "${!chosen[@]}"; do
  if [ "$GROUPS_N" -gt 0 ]; then g=$(( first + i % GROUPS_N )); else g=$(( first + i )); fi
  groups[g]="${groups[g]:+${groups[g]} }${chosen[i]}"
done
echo "part $PART: ${#chosen[@]} of ${#modules[@]} engine modules and ${#split[@]} split into $first groups," \
  "in ${#groups[@]} groups${PARALLEL:+, at most $PARALLEL at once}"
[ ${#groups[@]} -gt 0 ] || exit 0
exec bash scripts/gpu_parallel_tests.sh "$LIMIT" "$LOGDIR" "${groups[@]}"
