#!/usr/bin/env bash
# Build .gpu/ray/: Ray 2.60.0 for the lent GPU (cp312), which neither its image nor the staged
# vLLM holds, for `tests/test_ray_executor.py`. Ray's wheel (76 MiB) is over one device call's
# 64 MiB, so it travels in two halves, joined there; its one dependency the image lacks,
# jsonschema (with its own three), travels with the second half.
#     bash scripts/gpu_ray_parcel.sh                                   # here, once
# On the device, after the staging's three calls, two more:
#     carry [".gpu/ray/half1"], command: cp .gpu/ray/half1 /tmp/ray.half1
#     carry [".gpu/ray/half2", ".gpu/ray/deps"], command:
#       cat /tmp/ray.half1 .gpu/ray/half2 > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl && \
#       python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#         /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .gpu/ray/deps/*.whl
# For vLLM 0.32's staging (../shared/gpu). vLLM 0.34: scripts/stage_vllm034.sh carries Ray 2.60.0
# among its extras (xz'd to 21 MiB, one piece with the MoE kernels), beside the pinned jsonschema
# its deps already hold; this parcel's unpinned deps would sit beside those. vLLM 0.34.0 declares
# no Ray requirement at all (0.32.0 wanted ray[cgraph]>=2.48.0 for its compiled-graph executor);
# its RayExecutorV2 uses Ray's core API only, which 2.60.0 has.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=.gpu/ray
mkdir -p "$OUT/deps"
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
download "$OUT" ray==2.60.0
download "$OUT/deps" jsonschema jsonschema-specifications referencing rpds-py
wheel=$OUT/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
head -c "$half" "$wheel" > "$OUT/half1"
tail -c +"$((half + 1))" "$wheel" > "$OUT/half2"
cat "$OUT/half1" "$OUT/half2" | cmp - "$wheel"
rm "$wheel"
du -h "$OUT/half1" "$OUT/half2" "$OUT/deps"
