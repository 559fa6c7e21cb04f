#!/usr/bin/env bash
# Build .gpu/partD.tar.xz: vLLM's MoE kernels (`vllm/_moe_C_stable_libtorch.abi3.so`, 45 MB,
# 36 MiB compressed), which ../shared/gpu/stage.sh leaves out of its three parcels for their
# size. With it the lent GPU runs Qwen3.5-MoE, quantized (FP8, GPTQ, AWQ) or not.
#     bash ../shared/gpu/stage.sh && bash scripts/gpu_moe_parcel.sh        # here, once
# On the device, one more call after `bash .gpu/unpack.sh C` (the project's tree travels too):
#     carry [".gpu/partD.tar.xz"], command: tar -xJf .gpu/partD.tar.xz -C /tmp/site
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KERNELS=vllm/_moe_C_stable_libtorch.abi3.so
wheels=(.gpu/cache/vllm-0.32.0-*.whl)
[ -f "${wheels[0]}" ] || { echo "no vLLM wheel in .gpu/cache: run ../shared/gpu/stage.sh first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "${wheels[0]}" "$KERNELS" -d "$work"
tar -C "$work" -cf - "$KERNELS" | xz -9 -T2 > .gpu/partD.tar.xz
du -h .gpu/partD.tar.xz
