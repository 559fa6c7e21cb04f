#!/usr/bin/env bash
# Scrape the tiny-model server with a real Prometheus (prometheus.yml beside this script, its
# target moved to the server's port) and evaluate the dashboard's "Hit rate" panel over a
# conversation of four turns. Needs a `prometheus` binary on PATH (Debian: apt-get install
# prometheus). Run from the repository root after scripts/install.sh.
set -euo pipefail
HERE=examples/observability
PORT=8011
PROM_PORT=9099
WORK=$(mktemp -d)
MODEL=$(.venv/bin/python -c 'from vllm_hpc.tiny_model import tiny_model_path; print(tiny_model_path())')
.venv/bin/vllm serve "$MODEL" --config configs/hybrid-prefix.yaml --skip-tokenizer-init \
  --enforce-eager --gpu-memory-utilization 0.2 --max-model-len 4096 --port $PORT \
  >"$WORK/server.log" 2>&1 &
SERVER=$!
sed "s/localhost:8000/127.0.0.1:$PORT/" $HERE/prometheus.yml >"$WORK/prometheus.yml"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address=127.0.0.1:$PROM_PORT >"$WORK/prometheus.log" 2>&1 &
PROM=$!
trap 'kill $SERVER $PROM; wait; rm -rf "$WORK"' EXIT
prometheus --version | head -1
until curl -sf localhost:$PORT/health >/dev/null; do sleep 1; done
# Four turns of one conversation as token ids: each resends the history and a new message.
.venv/bin/python - "$MODEL" $PORT <<'PY'
import json, random, sys, urllib.request
model, port = sys.argv[1], sys.argv[2]
rng = random.Random(0)
history = [rng.randrange(4000) for _ in range(1000)]
for turn in range(4):
    prompt = history + [rng.randrange(4000) for _ in range(150)]
    body = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"http://localhost:{port}/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(request))
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"turn {turn + 1}: {len(prompt)} prompt tokens, {cached} cached")
    history = prompt + answer["choices"][0]["token_ids"]
PY
sleep 15  # a few scrapes after the last turn
# The panel's first expression, with Grafana's variables given values Prometheus accepts.
EXPR=$(.venv/bin/python -c '
import json, sys
panel = next(p for p in json.load(open(sys.argv[1]))["panels"] if p["title"] == "Hit rate")
print(panel["targets"][0]["expr"].replace("$__rate_interval", "5m").replace("$model", ".*"))
' $HERE/grafana-hybrid-prefix.json)
echo "query: $EXPR"
curl -s "localhost:$PROM_PORT/api/v1/targets" | .venv/bin/python -c '
import json, sys
for target in json.load(sys.stdin)["data"]["activeTargets"]:
    print("target", target["scrapeUrl"], target["health"], target["lastError"])
'
curl -s "localhost:$PROM_PORT/api/v1/query" --data-urlencode "query=$EXPR" | .venv/bin/python -c '
import json, sys
answer = json.load(sys.stdin)
assert answer["status"] == "success" and answer["data"]["result"], answer
print("hit rate (Prometheus):", round(float(answer["data"]["result"][0]["value"][1]), 3))
'
