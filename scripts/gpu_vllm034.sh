#!/usr/bin/env bash
# On the lent GPU machine, after the last piece of scripts/unpack_vllm034.sh: the vLLM 0.34 runs
# of issues #47 and #48. The replay carries .gpu/model27b-vl (benchmarks/vision_model.py's 27B-shape
# config with the published float32 state and one MTP layer); $MODEL names another (e.g. one built
# with --state-dtype bfloat16).
#   bash scripts/gpu_vllm034.sh tests [PYTEST ARGS]   FlashInfer's kernels once, then CUDA tests
#   bash scripts/gpu_vllm034.sh replay CONFIGS        the replay's workloads ($WORKLOADS, default
#                                                     mix) on the 27B VL shape, into $OUT;
#                                                     $RESUME (a carried JSON) keeps its configs
#   bash scripts/gpu_vllm034.sh load CONFIGS          load.py's burst and sessions on the same
#                                                     model, into $OUT ($LOAD_RESUME as $RESUME)
#   bash scripts/gpu_vllm034.sh measure replay|load DIR
#                                                     #47's comparison, one engine at a time,
#                                                     each of vLLM's defaults, native-best and
#                                                     hybrid-prefix: the replay (mix, branching,
#                                                     agent loop; $WORKLOADS: fewer) into
#                                                     DIR/replay, or load.py into DIR/load
#                                                     ($CONFIGS: fewer configurations); from a
#                                                     copy of the tree (start it detached with
#                                                     scripts/gpu_jobs.sh)
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
      ${MAX_NUM_SEQS:+--max-num-seqs "$MAX_NUM_SEQS"} ${NATIVE_RETENTION:+--native-retention "$NATIVE_RETENTION"} ;;
  load)
    python3 benchmarks/load.py --model "${MODEL:-.gpu/model27b-vl}" --configs "$2" --out "$OUT" \
      --budget-s 100000 ${LOAD_RESUME:+--resume "$LOAD_RESUME"} ;;
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
      *) echo "measure replay|load DIR" >&2; exit 2 ;;
    esac ;;
  *)
    echo "usage: bash scripts/gpu_vllm034.sh tests [PYTEST ARGS] | replay CONFIGS | load CONFIGS" \
      "| measure replay|load DIR" >&2
    exit 2 ;;
esac
