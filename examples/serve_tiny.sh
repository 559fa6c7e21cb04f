#!/usr/bin/env bash
# Serve the embedded tiny Qwen3.5 with the hybrid prefix cache and send it two turns over the
# OpenAI API (token-id prompts). Run from the repository root after scripts/install.sh.
set -euo pipefail
MODEL=$(.venv/bin/python -c 'from vllm_hpc.tiny_model import tiny_model_path; print(tiny_model_path())')
.venv/bin/vllm serve "$MODEL" --config configs/hybrid-prefix.yaml --skip-tokenizer-init \
  --enforce-eager --gpu-memory-utilization 0.2 --max-model-len 4096 --port 8011 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:8011/health >/dev/null; do sleep 1; done
PROMPT=$(.venv/bin/python -c 'import random; r = random.Random(0); print([r.randrange(4096) for _ in range(1200)])')
ask() { curl -s localhost:8011/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": $1, \"max_tokens\": 80, \"temperature\": 0, \"ignore_eos\": true, \"return_token_ids\": true}"; }
FIRST=$(ask "$PROMPT")
NEXT=$(echo "$FIRST" | .venv/bin/python -c "import json, sys; r = json.load(sys.stdin); print($PROMPT + r['choices'][0]['token_ids'] + [7] * 50)")
ask "$NEXT" | .venv/bin/python -c "import json, sys; print('cached tokens:', json.load(sys.stdin)['usage']['prompt_tokens_details']['cached_tokens'])"
curl -s localhost:8011/metrics | grep '^vllm:hpc_hit_tokens'
