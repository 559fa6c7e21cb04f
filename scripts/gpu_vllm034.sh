#!/usr/bin/env bash
# On the lent GPU machine, after the last piece of scripts/unpack_vllm034.sh: the vLLM 0.34 runs
# of issues #47 and #48. The replay carries .gpu/model27b-vl (benchmarks/vision_model.py's 27B-shape
# config with the published float32 state and one MTP layer); $MODEL names another (e.g. one built
# with --state-dtype bfloat16).
#   bash scripts/gpu_vllm034.sh tests [PYTEST ARGS]   FlashInfer's kernels once, then CUDA tests
#   bash scripts/gpu_vllm034.sh replay CONFIGS [ARGS]  the replay's workloads ($WORKLOADS, default
#                                                     mix) on the 27B VL shape, into $OUT;
#                                                     $RESUME (a carried JSON) keeps its configs;
#                                                     ARGS go to replay.py
#   bash scripts/gpu_vllm034.sh load CONFIGS [ARGS]   load.py's burst and sessions on the same
#                                                     model, into $OUT ($LOAD_RESUME as $RESUME)
#   bash scripts/gpu_vllm034.sh measure replay|load|disk DIR
#                                                     #47's comparison, one engine at a time,
#                                                     each of vLLM's defaults, native-best and
#                                                     hybrid-prefix: the replay (mix, branching,
#                                                     agent loop; $WORKLOADS: fewer) into
#                                                     DIR/replay, or load.py into DIR/load
#                                                     ($CONFIGS: fewer configurations); or #50's
#                                                     disk tier into DIR/disk (below); from a
#                                                     copy of the tree (start it detached with
#                                                     scripts/gpu_jobs.sh)
#   bash scripts/gpu_vllm034.sh modules DIR           every real-engine test module (marked
#                                                     `engine`) on CUDA, into DIR: the extras
#                                                     unpacked first (waiting up to $EXTRAS_WAIT_S,
#                                                     600, for their pieces), then one pool of
#                                                     groups, $MODULES_PARALLEL (8) at once
#                                                     (scripts/gpu_engine_modules.sh all): a module
#                                                     a group, the modules of MODULES_SPLIT (below) a
#                                                     variant a group; each group stops after
#                                                     $MODULES_LIMIT_S (1200); the GDN prefill is
#                                                     vLLM's own choice unless
#                                                     $MODULES_GDN_BACKEND (e.g. triton) names one;
#                                                     DIR/summary.txt lists every group's outcome,
#                                                     DIR/tests/group<N>.log its log
#   bash scripts/gpu_vllm034.sh chain DIR STEP...     the steps one after another, each into
#                                                     DIR/STEP (its output in DIR/STEP/step.log,
#                                                     a line per step in DIR/chain.txt), from one
#                                                     copy of the tree; a failed step does not stop
#                                                     the next. Steps (the next lease's, in order,
#                                                     benchmarks/results/gpu_vllm034.md):
#       load       load.py, native,native-best,hybrid-prefix, float32 state (.gpu/model27b-vl)
#       mix        the replay's mix, hybrid-prefix-host, max_num_seqs 256 (device snapshot slots)
#       load-bf16  load.py, native,hybrid-prefix, bfloat16 state (.gpu/model27b-vl-bf16)
#       modules    the engine test modules (above)
#       disk       `measure disk` (#50's disk tier report, below)
#     Start it detached, e.g. after the last base piece:
#       bash scripts/gpu_jobs.sh start chain scripts/gpu_vllm034.sh chain /tmp/jobs/chain \
#         load mix load-bf16 modules disk
# measure disk: gpu_disk_tier.py (the sequential read, then a restart with a 100k-token prefix
# read back from disk), load.py's 256-request burst with a disk tier of $LOAD_DISK_GIB (16) under
# the hybrid side, and the replay's mix ($MIX_SESSIONS sessions, default 8) on vLLM's defaults
# and on the plugin with a $DISK_HOST_MIB host tier (2048: about a tenth of the mix's working set
# on the 27B shape, and room for its longest prompt's path and state), without and with a disk
# tier of $DISK_GIB (32); seven engine starts, $MAX_NUM_SEQS (256) on every side. Each part
# resumes from its JSON in DIR/disk when run again. The tiers go under $DISK_DIR (/tmp/hpc-disk),
# outside DIR: each call packs /tmp/jobs, and a tier's slab file is preallocated; each is removed
# once measured.
set -euo pipefail
# The modules run a parametrization a group (scripts/gpu_engine_modules.sh's SPLIT): the engines
# of each cudagraph mode and quantized variant, and the variants of MTP, n-gram and the host tier.
MODULES_SPLIT=$'tests/test_cuda_graphs.py\ntests/test_quantized.py\ntests/test_mtp.py\ntests/test_ngram.py\ntests/test_host_tier.py'
bash scripts/unpack_vllm034.sh env >/dev/null
# shellcheck disable=SC1091  # written on the device by unpack_vllm034.sh
source .gpu034/env.sh
bash scripts/gpu_plugin.sh >/dev/null

# Run this script again from a private copy of the tree, /tmp/src034-NAME: each device call lays
# the checkout out again, and an engine started later in a job would import whatever the last
# call brought. Returns only when already in that copy.
from_copy() { # NAME ARGS...
  local src=/tmp/src034-$1
  shift
  if [ "$(pwd)" != "$src" ]; then
    rm -rf "$src" && mkdir -p "$src"
    tar --exclude='./.gpu034/part*' --exclude=./.git -cf - . | tar -xf - -C "$src"
    cd "$src" && exec bash scripts/gpu_vllm034.sh "$@"
  fi
}

# One chain step into OUT_DIR (its name is the step's).
chain_step() { # STEP OUT_DIR
  local step=$1 out=$2
  unset RESUME LOAD_RESUME WORKLOADS CONFIGS MAX_NUM_SEQS NATIVE_RETENTION
  case "$step" in
    load) OUT=$out MODEL=.gpu/model27b-vl bash "$0" load native,native-best,hybrid-prefix ;;
    mix) OUT=$out MODEL=.gpu/model27b-vl WORKLOADS=mix MAX_NUM_SEQS=256 \
      bash "$0" replay hybrid-prefix-host ;;
    load-bf16) OUT=$out MODEL=.gpu/model27b-vl-bf16 bash "$0" load native,hybrid-prefix ;;
    modules) bash "$0" modules "$out" ;;
    # `measure KIND DIR` writes into DIR/KIND, which is OUT_DIR for this step.
    disk) bash "$0" measure disk "$(dirname "$out")" ;;
    *) echo "unknown step '$step' (load, mix, load-bf16, modules, disk)" >&2; return 2 ;;
  esac
}

case "${1:-}" in
  tests)
    shift
    bash scripts/unpack_vllm034.sh smoke
    python3 -m pytest -q -p no:cacheprovider "$@" ;;
  replay)
    python3 benchmarks/replay.py --profile gpu --model "${MODEL:-.gpu/model27b-vl}" \
      --workloads "${WORKLOADS:-mix}" --configs "$2" --out "$OUT" ${RESUME:+--resume "$RESUME"} \
      ${MAX_NUM_SEQS:+--max-num-seqs "$MAX_NUM_SEQS"} ${NATIVE_RETENTION:+--native-retention "$NATIVE_RETENTION"} \
      "${@:3}" ;;
  load)
    python3 benchmarks/load.py --model "${MODEL:-.gpu/model27b-vl}" --configs "$2" --out "$OUT" \
      --budget-s 100000 ${LOAD_RESUME:+--resume "$LOAD_RESUME"} "${@:3}" ;;
  measure)
    from_copy "$2" measure "$2" "$3"
    mkdir -p "$3/$2"
    case "$2" in
      replay) OUT="$3/replay" WORKLOADS="${WORKLOADS:-mix,branching,agent loop}" \
        bash "$0" replay "${CONFIGS:-native,native-best,hybrid-prefix-host}" ;;
      load) OUT="$3/load" bash "$0" load "${CONFIGS:-native,native-best,hybrid-prefix}" ;;
      disk)
        tier=${DISK_DIR:-/tmp/hpc-disk} out=$3/disk failed=0
        kept() { [ -f "$1" ] && echo "$1" || true; }
        resume=$(kept "$out/gpu_disk_tier.json")
        # Each part has a cap (timeout kills its process group, engine cores included): on the
        # CPU a replay's disk engine once stepped forever without finishing a request.
        timeout -k 30 900 python3 benchmarks/gpu_disk_tier.py --model "${MODEL:-.gpu/model27b-vl}" \
          --max-num-seqs "${MAX_NUM_SEQS:-256}" --dir "$tier/restart" --out "$out" \
          ${resume:+--resume "$resume"} || failed=1
        rm -rf "$tier/restart" "$tier/load"  # a journal left there would serve the burst hits
        OUT="$out/load" LOAD_RESUME=$(kept "$out/load/load.json") timeout -k 30 900 \
          bash "$0" load native,hybrid-prefix \
          --workloads burst --disk-cache-dir "$tier/load" --disk-cache-gib "${LOAD_DISK_GIB:-16}" \
          || failed=1
        rm -rf "$tier/load"
        OUT="$out/replay" RESUME=$(kept "$out/replay/replay_gpu.json") WORKLOADS=mix \
          MAX_NUM_SEQS=${MAX_NUM_SEQS:-256} timeout -k 30 1200 \
          bash "$0" replay native,hybrid-prefix-host,hybrid-prefix-disk \
          ${MIX_SESSIONS:+--mix-sessions "$MIX_SESSIONS"} --host-cache-mib "${DISK_HOST_MIB:-2048}" \
          --disk-cache-dir "$tier" --disk-cache-gib "${DISK_GIB:-32}" || failed=1
        exit "$failed" ;;
      *) echo "measure replay|load|disk DIR" >&2; exit 2 ;;
    esac ;;
  modules)
    [ $# -eq 2 ] || { echo "modules DIR" >&2; exit 2; }
    dir=$(realpath -m "$2")
    from_copy modules modules "$dir"
    mkdir -p "$dir"
    summary=$dir/summary.txt
    echo "engine test modules on vLLM 0.34, sources $(git rev-parse --short HEAD 2>/dev/null || echo 'of a copy without .git'), $(date -u +%FT%TZ)" > "$summary"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$summary" 2>&1 || true
    bash scripts/unpack_vllm034.sh extras "${EXTRAS_WAIT_S:-600}" 2>&1 | tee -a "$summary" || true
    bash scripts/unpack_vllm034.sh preflight 2>&1 | tee -a "$summary"
    # Empty: vLLM 0.34's own GDN prefill choice (FlashInfer's on Hopper), what its users get.
    export VLLM_HPC_TEST_GDN_PREFILL_BACKEND=${MODULES_GDN_BACKEND-}
    echo "GDN prefill: ${VLLM_HPC_TEST_GDN_PREFILL_BACKEND:-the choice of vLLM}" >> "$summary"
    rc=0
    SPLIT=$MODULES_SPLIT PARALLEL=${MODULES_PARALLEL:-8} bash scripts/gpu_engine_modules.sh all \
      "${MODULES_LIMIT_S:-1200}" "$dir/tests" 0 > "$dir/groups.txt" 2>&1 || rc=$?
    { cat "$dir/groups.txt"; echo "modules: rc=$rc"; } | tee -a "$summary"
    exit $rc ;;
  chain)
    [ $# -ge 3 ] || { echo "chain DIR STEP..." >&2; exit 2; }
    dir=$(realpath -m "$2")
    shift 2
    from_copy chain chain "$dir" "$@"
    mkdir -p "$dir"
    echo "chain of $*; sources $(git rev-parse --short HEAD 2>/dev/null || echo 'of a copy without .git')" \
      | tee -a "$dir/chain.txt"
    for step in "$@"; do
      mkdir -p "$dir/$step"
      t0=$SECONDS
      echo "$(date +%T) $step: started" | tee -a "$dir/chain.txt"
      rc=0
      ( chain_step "$step" "$dir/$step" ) > "$dir/$step/step.log" 2>&1 || rc=$?
      echo "$(date +%T) $step: rc=$rc after $((SECONDS - t0)) s" | tee -a "$dir/chain.txt"
    done ;;
  *)
    echo "usage: bash scripts/gpu_vllm034.sh tests [PYTEST ARGS] | replay CONFIGS | load CONFIGS" \
      "| measure replay|load|disk DIR | modules DIR | chain DIR STEP..." >&2
    exit 2 ;;
esac
