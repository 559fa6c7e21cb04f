#!/usr/bin/env bash
# On the lent GPU machine (after ../shared/gpu's staging), make vLLM load vllm_hpc's plugin.
#
# There the checkout is only on PYTHONPATH, not installed, so vLLM finds no `vllm.general_plugins`
# entry point and silently serves `--kv-cache-manager hybrid-prefix` requests with its own caching
# (the tests' `running_llm` now fails on that). This writes a metadata-only distribution with
# the entry point into the staged site directory (default /tmp/site), beside vLLM.
#     source .gpu/env.sh && bash scripts/gpu_plugin.sh
set -euo pipefail
SITE=${1:-/tmp/site}
VERSION=$(python3 -c 'import vllm_hpc; print(vllm_hpc.__version__)')
INFO="$SITE/vllm_hpc-$VERSION.dist-info"
mkdir -p "$INFO"
printf 'Metadata-Version: 2.1\nName: vllm-hpc\nVersion: %s\n' "$VERSION" > "$INFO/METADATA"
printf '[vllm.general_plugins]\nvllm_hpc = vllm_hpc.plugin:register\n' > "$INFO/entry_points.txt"
python3 - <<'PY'
from importlib.metadata import entry_points
names = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "vllm_hpc" in names, names
print("vllm_hpc plugin entry point registered")
PY
