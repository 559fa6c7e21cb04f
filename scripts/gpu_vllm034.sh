#!/usr/bin/env bash
# On the lent GPU machine, after the last piece of scripts/unpack_vllm034.sh: the vLLM 0.34 runs
# of issue #47. The replay carries .gpu/model27b-vl (benchmarks/vision_model.py's 27B-shape config
# with the published float32 state and one MTP layer).
#   bash scripts/gpu_vllm034.sh tests [PYTEST ARGS]   FlashInfer's kernels once, then CUDA tests
#   bash scripts/gpu_vllm034.sh replay CONFIGS        the replay's workloads ($WORKLOADS, default
#                                                     mix) on the 27B VL shape, into $OUT;
#                                                     $RESUME (a carried JSON) keeps its configs
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
    python3 benchmarks/replay.py --profile gpu --model .gpu/model27b-vl \
      --workloads "${WORKLOADS:-mix}" --configs "$2" --out "$OUT" ${RESUME:+--resume "$RESUME"} ;;
  *)
    echo "usage: bash scripts/gpu_vllm034.sh tests [PYTEST ARGS] | replay CONFIGS" >&2; exit 2 ;;
esac
