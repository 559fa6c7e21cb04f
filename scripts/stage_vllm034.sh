#!/usr/bin/env bash
# Build the pieces that put vLLM 0.34.0 (CUDA build) and FlashInfer 0.7.4 onto the lent GPU machine.
#
# Run from the project root on the development machine (idempotent; the first run takes ~15 min,
# mostly xz; later runs reuse what is unchanged):
#     bash scripts/stage_vllm034.sh
# It writes ./.gpu034/ (ignored through .git/info/exclude):
#     partA, partB, ...   one stream of concatenated .tar.xz components, cut into pieces of at most
#                         $CHUNK_MIB MiB: a device call carries 64 MiB with the project's tree, and
#                         vLLM's compiled core alone is ~56 MiB after xz, so pieces cut across files
#     manifest            sha256, size and name of each piece (carried with every piece)
#     cache/              downloads and per-component .tar.xz (reused when their inputs match)
# The device side is scripts/unpack_vllm034.sh (a file of the checkout, so it travels by itself).
# Knobs: CHUNK_MIB (48), WITH_CUTE_DSL (1: nvidia-cutlass-dsl, which FlashInfer's SM90 GDN prefill
# needs), WITH_MOE (0: vLLM's MoE kernels, not needed for dense models), VLLM_WHEEL (a local copy
# of the vLLM wheel, instead of downloading it).
set -euo pipefail
VLLM_VERSION=0.34.0
FI_VERSION=0.7.4
CUTE_DSL_VERSION=4.8.0
CHUNK_MIB=${CHUNK_MIB:-48}
WITH_CUTE_DSL=${WITH_CUTE_DSL:-1}
WITH_MOE=${WITH_MOE:-0}
# Bump a component's tag below (r1, r2, ...) when its rules change, so its cached .tar.xz is rebuilt.
RULES=4

ROOT=$(pwd)
[ -d "$ROOT/.git" ] && [ -f "$ROOT/pyproject.toml" ] || { echo "run from the project root" >&2; exit 2; }
OUT="$ROOT/.gpu034"
CACHE="$OUT/cache"
COMP="$CACHE/comp"
mkdir -p "$CACHE/whl" "$COMP"
grep -qx '/.gpu034/' .git/info/exclude 2>/dev/null || echo '/.gpu034/' >> .git/info/exclude

# Run a command quietly; show its output only if it fails. (PIP_CONSTRAINT: this machine's pip
# config pins versions for the host venv, which must not apply to the device's wheels.)
quiet() { local log; log=$(mktemp); if ! PIP_CONSTRAINT= "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi; rm -f "$log"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
XZ=(xz -9 -T0 --block-size=128MiB)   # blocks let the device decompress in parallel
TAR=(tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01)

# Wheels the device image lacks (its list: /work/.library/device/KINDS.md), for cp312 x86_64.
# The 0.32 list (../shared/gpu/device-requirements.txt) plus what 0.34 added, among them
# quack_kernels (vLLM 0.34's kernel warm-up imports it on CUDA for every model, through MiniMax
# M3's warm-up) and jsonschema with its needs (the vision-language class's processor).
cat > "$CACHE/requirements.txt" <<'EOF'
annotated_doc==0.0.7
annotated_types==0.8.0
anthropic==2.14.0
apache_tvm_ffi==0.1.15.post2
astor==0.8.1
blake3==1.0.11
cachetools==8.0.2
cbor2==6.3.0
compressed_tensors==0.17.0
depyf==0.20.0
dill==0.4.1
distro==1.9.0
dnspython==2.9.2
docstring_parser==0.18.0
email_validator==2.4.0
fastapi==0.136.3
googleapis_common_protos==1.76.0
httpcore2==2.16.2
httpx2==2.16.2
idna==3.20
ijson==3.6.0
importlib_metadata==10.2.0
interegular==0.3.3
jiter==0.19.0
jmespath==1.1.0
jsonschema==4.26.0
jsonschema_specifications==2025.9.1
lark==1.2.2
llguidance==1.7.6
lm_format_enforcer==0.11.3
loguru==0.7.3
mcp==2.3.0
mcp_types==2.3.0
mistral_common==1.13.1
model_hosting_container_standards==0.1.16
msgspec==0.23.0
openai==3.57.0
opentelemetry_api==1.45.2
opentelemetry_exporter_http_transport==0.66b2
opentelemetry_exporter_otlp==1.45.2
opentelemetry_exporter_otlp_common==0.66b2
opentelemetry_exporter_otlp_proto_common==1.45.2
opentelemetry_exporter_otlp_proto_grpc==1.45.2
opentelemetry_exporter_otlp_proto_http==1.45.2
opentelemetry_proto==1.45.2
opentelemetry_sdk==1.45.2
opentelemetry_semantic_conventions==0.66b2
opentelemetry_semantic_conventions_ai==0.5.1
orjson==3.13.0
oss_harmony==0.0.11
outlines_core==0.2.14
partial_json_parser==0.2.1.1.post7
prometheus_fastapi_instrumentator==8.1.0
pybase64==1.5.1
pycountry==26.2.16
pydantic==2.14.4
pydantic_core==2.50.5
pydantic_extra_types==2.11.1
python_json_logger==4.2.0
python_multipart==0.0.34
pyzmq==27.3.0
quack_kernels==0.6.5
referencing==0.37.0
rpds_py==2026.9.1
setproctitle==1.3.8
sniffio==1.3.1
starlette==1.10.0
supervisor==4.3.0
tokenizers==0.23.3
truststore==0.10.5
typing_inspection==0.4.5
uvicorn==0.54.0
watchfiles==1.3.0
xgrammar==0.2.8
zipp==4.1.2
EOF
# FlashInfer and the CuTe DSL get their own components (trimmed). FlashInfer's other declared
# needs are left out on purpose: cuda-python is a meta package (the device has cuda-bindings,
# cuda-core, cuda-pathfinder); cuda-tile (cuTile GEMM/attention backends), nccl4py and
# nccl-extensions (MoE expert-parallel comms) and nvidia-cudnn-frontend (cuDNN backends) are
# imported only inside guarded or lazy paths that vLLM does not take for a dense model on one GPU.
FI_REQS=("flashinfer_python==$FI_VERSION")
DSL_REQS=("nvidia_cutlass_dsl==$CUTE_DSL_VERSION" "nvidia_cutlass_dsl_libs_core==$CUTE_DSL_VERSION"
          "nvidia_cutlass_dsl_libs_base==$CUTE_DSL_VERSION" "nvidia_cutlass_dsl_libs_cu13==$CUTE_DSL_VERSION")

PLATFORMS=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any --platform manylinux2014_x86_64)
for n in 17 24 26 27 28 31 34 35 38 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

echo "== downloads (cached in $CACHE)"
WHEEL="$CACHE/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl"
if [ ! -s "$WHEEL" ]; then
  if [ -n "${VLLM_WHEEL:-}" ]; then cp "$VLLM_WHEEL" "$WHEEL"
  else quiet pip download --no-deps "vllm==$VLLM_VERSION" -d "$CACHE"; fi
fi
quiet pip download --no-deps "${PLATFORMS[@]}" -r "$CACHE/requirements.txt" -d "$CACHE/whl"
mkdir -p "$CACHE/fi" "$CACHE/dsl"
quiet pip download --no-deps "${PLATFORMS[@]}" "${FI_REQS[@]}" -d "$CACHE/fi"
[ "$WITH_CUTE_DSL" = 1 ] && quiet pip download --no-deps "${PLATFORMS[@]}" "${DSL_REQS[@]}" -d "$CACHE/dsl"

# Pick exactly one wheel per requirement (a stale second version in the cache would stop pip).
want_whl() { # dir, requirements -> WANT=(wheel files)
  local dir=$1 r f; shift; WANT=()
  shopt -s nocaseglob
  for r in "$@"; do
    f=("$dir/${r%%==*}-${r#*==}-"*.whl)
    [ -f "${f[0]}" ] || { echo "no wheel for $r in $dir" >&2; exit 1; }
    WANT+=("${f[0]}")
  done
  shopt -u nocaseglob
}
want_whl "$CACHE/whl" $(grep -v '^#' "$CACHE/requirements.txt"); DEP_WHLS=("${WANT[@]}")
want_whl "$CACHE/fi" "${FI_REQS[@]}"; FI_WHLS=("${WANT[@]}")
DSL_WHLS=(); if [ "$WITH_CUTE_DSL" = 1 ]; then want_whl "$CACHE/dsl" "${DSL_REQS[@]}"; DSL_WHLS=("${WANT[@]}"); fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Key of a component: its rules tag and the names+sizes of its input files.
key_of() { local tag=$1; shift; { echo "$RULES $tag"; for f in "$@"; do stat -c '%n %s' "$f"; done; } | sha256sum | cut -c1-16; }
# build NAME KEY FUNCTION: run FUNCTION in an empty dir that becomes /tmp/site there, tar+xz it.
build() {
  local name=$1 key=$2 fn=$3
  if [ -s "$COMP/$name.tar.xz" ] && [ "$(cat "$COMP/$name.key" 2>/dev/null)" = "$key" ]; then
    echo "   $name: cached ($(mib "$(stat -c %s "$COMP/$name.tar.xz")") MiB)"; return
  fi
  local d="$WORK/$name"; rm -rf "$d"; mkdir -p "$d"
  ( cd "$d"; "$fn" )
  [ -n "$(ls -A "$d")" ] || { echo "component $name came out empty" >&2; exit 1; }
  find "$d" -name __pycache__ -type d -prune -exec rm -rf {} +
  local raw; raw=$(du -sb "$d" | cut -f1)
  ( cd "$d" && "${TAR[@]}" -cf - . ) | "${XZ[@]}" > "$COMP/$name.tar.xz.tmp"
  mv "$COMP/$name.tar.xz.tmp" "$COMP/$name.tar.xz"; echo "$key" > "$COMP/$name.key"
  rm -rf "$d"
  echo "   $name: $(mib "$raw") MiB -> $(mib "$(stat -c %s "$COMP/$name.tar.xz")") MiB"
}
pip_target() { quiet pip install --no-deps --no-compile --no-index "${PLATFORMS[@]}" --target . "$@"; rm -rf bin; }

# vLLM: the compiled core, FlashAttention-3 (Hopper's attention backend for head_dim 256 and the
# ViT), and the Python code. Left out: FA2 (only used off Hopper), the MoE kernels (dense models),
# vllm-rs (Rust front end), FlashKDA/DeepSelect/FlashMLA (other models), DeepGEMM's extension and the
# C++/CUDA headers under third_party (JIT sources for Blackwell paths). third_party's .py stay.
comp_core() { unzip -q "$WHEEL" 'vllm/_C_stable_libtorch.abi3.so'; }
comp_fa3() { unzip -q "$WHEEL" 'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so'; }
comp_moe() { unzip -q "$WHEEL" 'vllm/_moe_C_stable_libtorch.abi3.so'; }
comp_vllmpy() {
  unzip -q "$WHEEL" -x 'vllm/_C_stable_libtorch.abi3.so' 'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so' \
    'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so' \
    'vllm/vllm-rs' 'vllm/_flashkda_C.abi3.so' 'vllm/_deepselect_C.abi3.so' 'vllm/_flashmla_C.abi3.so' \
    'vllm/third_party/*.so' 'vllm/third_party/*.hpp' 'vllm/third_party/*.h' 'vllm/third_party/*.cuh' \
    'vllm/third_party/*.cu' 'vllm/third_party/*.cpp' 'vllm/third_party/*.inl'
}
comp_deps() { pip_target "${DEP_WHLS[@]}"; }

# FlashInfer 0.7.4 ships no compiled kernels: its CUDA kernels are compiled with nvcc on first use
# (sources under flashinfer/data) and its CuTe-DSL kernels (the norms, SM90 GDN prefill) are
# compiled by the CuTe DSL at run time. Trimmed (~700 MiB -> ~190 MiB before xz):
#  - data/csrc/<subdir>/ except nv_internal/: nvcc sources of kernels vLLM does not call here
#    (Cake FMHA/MoE/GDN for SM100+, KDA, fused MoE, XQA, FMHA-v2, SM120 paths); the top-level
#    data/csrc files, data/include, cutlass, cccl and spdlog stay, so nvcc JIT of the generic
#    modules (norm, sampling, top-k, rope, page) still works as a fallback.
#  - C/C++/CUDA sources and docs inside the Python tree (*.cu *.cuh *.c *.cc *.cpp *.h *.hpp *.inl
#    *.inc *.ptx *.md): JIT sources of Cake training kernels, experimental and MoE-EP modules.
# The Python files all stay: `import flashinfer` imports ~600 of them, and vLLM reaches others
# indirectly (e.g. the top-level `b12x` package loads flashinfer/experimental/b12x by path).
comp_flashinfer() {
  pip_target "${FI_WHLS[@]}"
  local fi=flashinfer
  find "$fi/data/csrc" -mindepth 1 -maxdepth 1 -type d ! -name nv_internal -exec rm -rf {} +
  find "$fi" -path "$fi/data" -prune -o -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.c' \
    -o -name '*.cc' -o -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.inl' -o -name '*.inc' \
    -o -name '*.ptx' -o -name '*.md' \) -print0 | xargs -0 rm -f
  find "$fi" -type d -empty -delete
}
# CuTe DSL (nvidia-cutlass-dsl 4.8.0, CUDA 13 flavor only: the device's driver and torch are CUDA
# 13). Its .pth is not read from PYTHONPATH, so env.sh puts dsl_packages on PYTHONPATH instead.
# Left out: the cu12 flavor (libs-cu12, ~92 MiB) and the aarch64/QNX stub libraries.
comp_cutedsl() {
  pip_target "${DSL_WHLS[@]}"
  rm -rf nvidia_cutlass_dsl/cu13/lib/stubs
}

echo "== components (xz -9; cached in $COMP)"
COMPS=(core fa3 vllmpy deps flashinfer)
build core "$(key_of r1 "$WHEEL")" comp_core
build fa3 "$(key_of r1 "$WHEEL")" comp_fa3
build vllmpy "$(key_of r1 "$WHEEL")" comp_vllmpy
build deps "$(key_of r1 "${DEP_WHLS[@]}")" comp_deps
build flashinfer "$(key_of r2 "${FI_WHLS[@]}")" comp_flashinfer
if [ "$WITH_CUTE_DSL" = 1 ]; then COMPS+=(cutedsl); build cutedsl "$(key_of r1 "${DSL_WHLS[@]}")" comp_cutedsl; fi
if [ "$WITH_MOE" = 1 ]; then COMPS+=(moe); build moe "$(key_of r1 "$WHEEL")" comp_moe; fi

# One stream (xz and tar both read concatenated members: `xz -dc | tar -xi`), cut into pieces.
echo "== pieces of at most $CHUNK_MIB MiB"
rm -f "$OUT"/part? "$OUT/manifest"
for c in "${COMPS[@]}"; do cat "$COMP/$c.tar.xz"; done | split -b "${CHUNK_MIB}M" -a 1 - "$OUT/part"
for f in "$OUT"/part?; do mv "$f" "$OUT/part$(basename "$f" | cut -c5 | tr a-z A-Z)"; done
( cd "$OUT" && for f in part?; do echo "$(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f") $f"; done ) > "$OUT/manifest"

TREE=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mapfile -t PARTS < <(cut -d' ' -f3 "$OUT/manifest")
N=${#PARTS[@]}
while read -r _ size name; do
  echo "   $name  $(mib "$size") MiB  (+ project tree $(mib "$TREE") MiB = $(mib $((size + TREE))) of 64)"
  [ $((size + TREE)) -lt $((62 * 1048576)) ] || echo "   WARNING: $name and the tree come near the 64 MiB limit; lower CHUNK_MIB" >&2
done < "$OUT/manifest"

echo
echo "Staged. On the device, $N calls back to back (the machine stays warm only ~30 s between calls):"
for i in "${!PARTS[@]}"; do
  p=${PARTS[$i]}; l=${p#part}
  if [ $((i + 1)) -lt "$N" ]; then
    printf '  call %d: carry [".gpu034/%s", ".gpu034/manifest"]  command: bash scripts/unpack_vllm034.sh %s\n' $((i + 1)) "$p" "$l"
  else
    printf '  call %d: carry [".gpu034/%s", ".gpu034/manifest", <ignored paths your command needs>]\n' $((i + 1)) "$p"
    printf '          command: bash scripts/unpack_vllm034.sh %s && source .gpu034/env.sh && <your command>\n' "$l"
  fi
done
cat <<EOF
Later calls on the same warm machine: 'source .gpu034/env.sh' (recreate it with
'bash scripts/unpack_vllm034.sh env' if the re-laid tree lost it). If /tmp/site/vllm is gone, the
machine went cold: start again at call 1. 'bash scripts/unpack_vllm034.sh smoke' runs FlashInfer's
Gemma RMSNorm and SM90 GDN prefill once on the GPU against references.
vLLM there: env.sh sets VLLM_USE_FLASHINFER_SAMPLER=0. On Hopper vLLM now takes FlashInfer's GDN
prefill (CuTe DSL, compiled on first use; additional_config={"gdn_prefill_backend": "triton"} keeps
0.32's Triton path); pass enable_flashinfer_autotune=False to skip FlashInfer's warm-up autotuning.
JIT caches (FlashInfer, CuTe DSL, Triton) live in /tmp/jitcache: 'bash scripts/unpack_vllm034.sh
savejit' writes them to \$OUT; copy those files into .gpu034/jit/ here and carry ".gpu034/jit" with
call 1 (or any later call) to start warm.
EOF
