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
bash scripts/unpack_vllm034.sh env >/dev/null
source .gpu034/env.sh
bash scripts/gpu_plugin.sh >/dev/null
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
    # From a private copy: each device call lays the checkout out again, and an engine started
    # later in this job would import whatever the last call brought.
    src=/tmp/src034-$2
    if [ "$(pwd)" != "$src" ]; then
      rm -rf "$src" && mkdir -p "$src"
      tar --exclude='./.gpu034/part*' --exclude=./.git -cf - . | tar -xf - -C "$src"
      cd "$src" && exec bash scripts/gpu_vllm034.sh measure "$2" "$3"
    fi
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
  *)
    echo "usage: bash scripts/gpu_vllm034.sh tests [PYTEST ARGS] | replay CONFIGS | load CONFIGS" \
      "| measure replay|load|disk DIR" >&2
    exit 2 ;;
esac
