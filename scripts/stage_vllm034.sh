#!/usr/bin/env bash
# Build the pieces that put vLLM 0.34.0 (CUDA build) and FlashInfer 0.7.4 onto the lent GPU machine.
#
# Run from the project root on the development machine (idempotent; the first run takes ~15 min,
# mostly xz; later runs reuse what is unchanged and leave unchanged pieces untouched):
#     bash scripts/stage_vllm034.sh
# It writes ./.gpu034/ (ignored through .git/info/exclude):
#     partA..partD        the base stream: vLLM's compiled core, FlashAttention-3, vLLM's Python
#                         code, the wheels the device image lacks (the OpenAI server's among them),
#                         FlashInfer and the CuTe DSL: one stream of concatenated .tar.xz
#                         components, cut into pieces of at most $CHUNK_MIB MiB (a device call
#                         carries 64 MiB with the project's tree, and vLLM's compiled core alone is
#                         ~56 MiB after xz, so pieces cut across files)
#     manifest            sha256, size and name of each base piece (carried with every base piece)
#     partE               the extras stream ($EXTRAS): what only the engine test modules need
#                         (vLLM's MoE kernels 24.5 MiB, Humming 0.4, Ray 21.3 after xz: one
#                         46 MiB piece), lettered after the base pieces
#     manifest-extras     the same for the extras pieces (carried with every extras piece)
#     cache/              downloads and per-component .tar.xz (reused when their inputs match)
# The device side is scripts/unpack_vllm034.sh (a file of the checkout, so it travels by itself).
#
# Device calls, back to back (a machine goes back 30 s after a call; each call carries one piece
# and the project's tree, ~10 MiB; `bash scripts/stage_vllm034.sh` prints the sizes):
#   1  carry [".gpu034/partA", ".gpu034/manifest"]   bash scripts/unpack_vllm034.sh A
#   2  carry [".gpu034/partB", ".gpu034/manifest"]   bash scripts/unpack_vllm034.sh B
#   3  carry [".gpu034/partC", ".gpu034/manifest"]   bash scripts/unpack_vllm034.sh C
#   4  carry [".gpu034/partD", ".gpu034/manifest", <ignored paths the job needs, e.g. ".gpu/model27b-vl">]
#         bash scripts/unpack_vllm034.sh D && bash scripts/gpu_jobs.sh start NAME scripts/gpu_vllm034.sh ... \
#           && bash scripts/gpu_jobs.sh wait $((570 - SECONDS))
#      (the last base piece unpacks everything into /tmp/site, writes .gpu034/env.sh and checks)
#   5  carry [".gpu034/partE", ".gpu034/manifest-extras"]   (the same for any later extras piece)
#         bash scripts/unpack_vllm034.sh E && bash scripts/gpu_jobs.sh wait $((570 - SECONDS))
#   6+ no carry: bash scripts/gpu_jobs.sh wait 570
# The extras pieces only need to arrive before the engine test modules start: call 5 is a call
# that waits on the job anyway. Their pieces are only kept there (/tmp/stage034x); the
# modules step (`scripts/gpu_vllm034.sh modules`) unpacks them, or `bash scripts/unpack_vllm034.sh
# extras` does by hand. A job that needs no extras (replay, load) needs calls 1-4 only.
# benchmarks/results/gpu_vllm034.md ("Next lease") gives the whole sequence of the next session.
#
# Knobs: CHUNK_MIB (48), WITH_CUTE_DSL (1: nvidia-cutlass-dsl, which FlashInfer's SM90 GDN prefill
# needs), EXTRAS ("moe humming ray"; "" builds no extras stream), VLLM_WHEEL (a local copy of the
# vLLM wheel, instead of downloading it), XZ_THREADS (0: all cores; this machine's are shared).
set -euo pipefail
VLLM_VERSION=0.34.0
FI_VERSION=0.7.4
CUTE_DSL_VERSION=4.8.0
CHUNK_MIB=${CHUNK_MIB:-48}
WITH_CUTE_DSL=${WITH_CUTE_DSL:-1}
EXTRAS=${EXTRAS-moe humming ray}
RAY_VERSION=2.60.0
HUMMING_VERSION=0.1.19
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
quiet() { local log; log=$(mktemp); if ! PIP_CONSTRAINT='' "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi; rm -f "$log"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
XZ=(xz -9 "-T${XZ_THREADS:-0}" --block-size=128MiB)   # blocks let the device decompress in parallel
TAR=(tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01)

# Wheels the device image lacks (its list: /work/.library/device/KINDS.md), for cp312 x86_64.
# The 0.32 list (../shared/gpu/device-requirements.txt) plus what 0.34 added, among them
# quack_kernels (vLLM 0.34's kernel warm-up imports it on CUDA for every model, through MiniMax
# M3's warm-up) and jsonschema with its needs (the vision-language class's processor). The OpenAI
# server needs nothing more (0.32's runs carried its wheels apart, `.gpu/srvwhl`): traced on the
# development machine (Python 3.11, its own versions), importing every module under
# vllm/entrypoints of the 0.34.0 wheel loads only packages that the image or this list holds,
# save the Cohere API's `cohere` SDK (which vLLM probes for) and the gRPC server's (vllm[grpc]).
# `bash scripts/unpack_vllm034.sh preflight` imports the server on the device itself.
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
# The extras' wheels. Ray: vLLM 0.34.0 declares none (no requirement, no extra; its RayExecutorV2
# uses Ray's core API: actors, placement groups, runtime_env, get_accelerator_ids, all in 2.60.0,
# the version the 0.32 runs used; only its sharded_rdt weight transfer asks for >= 2.56). Ray's
# own needs are in the image or in deps (jsonschema and its three). Humming: vLLM 0.34.0 requires
# humming-kernels and on SM90 ranks it ahead of Marlin for GPTQ/AWQ, linear and MoE (it compiles
# its kernels with NVRTC against the system CUDA at run time); without it vLLM takes Marlin.
EXTRA_REQS=()
for e in $EXTRAS; do
  case $e in
    moe) ;;
    ray) EXTRA_REQS+=("ray==$RAY_VERSION") ;;
    humming) EXTRA_REQS+=("humming_kernels==$HUMMING_VERSION") ;;
    *) echo "unknown extra '$e' (EXTRAS: moe humming ray)" >&2; exit 2 ;;
  esac
done
mkdir -p "$CACHE/extra"
[ ${#EXTRA_REQS[@]} -eq 0 ] || quiet pip download --no-deps "${PLATFORMS[@]}" "${EXTRA_REQS[@]}" -d "$CACHE/extra"

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
mapfile -t DEP_REQS < <(grep -v '^#' "$CACHE/requirements.txt")
want_whl "$CACHE/whl" "${DEP_REQS[@]}"; DEP_WHLS=("${WANT[@]}")
want_whl "$CACHE/fi" "${FI_REQS[@]}"; FI_WHLS=("${WANT[@]}")
DSL_WHLS=(); if [ "$WITH_CUTE_DSL" = 1 ]; then want_whl "$CACHE/dsl" "${DSL_REQS[@]}"; DSL_WHLS=("${WANT[@]}"); fi
RAY_WHLS=(); HUMMING_WHLS=()
for r in "${EXTRA_REQS[@]}"; do
  want_whl "$CACHE/extra" "$r"
  case $r in ray==*) RAY_WHLS=("${WANT[@]}") ;; humming*) HUMMING_WHLS=("${WANT[@]}") ;; esac
done

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
# The extras. MoE: vLLM's MoE kernels (Qwen3.5-MoE, quantized or not: moe_align_block_size,
# Marlin MoE, ...); vLLM imports them quietly when present, and without them a MoE model fails at
# its first forward. Humming: pure Python and a small launcher. Ray, trimmed (~200 MiB -> ~150):
# the Java jars, the dashboard's web client (the tests start Ray without the dashboard) and
# RLlib; its Python packages stay (Ray's dashboard agent, which runtime_env needs, imports from
# many of them).
comp_humming() { pip_target "${HUMMING_WHLS[@]}"; }
comp_ray() {
  pip_target "${RAY_WHLS[@]}"
  rm -rf ray/jars ray/dashboard/client/build ray/rllib
  find ray -name '*.js.map' -delete
}

echo "== components (xz -9; cached in $COMP)"
COMPS=(core fa3 vllmpy deps flashinfer)
build core "$(key_of r1 "$WHEEL")" comp_core
build fa3 "$(key_of r1 "$WHEEL")" comp_fa3
build vllmpy "$(key_of r1 "$WHEEL")" comp_vllmpy
build deps "$(key_of r1 "${DEP_WHLS[@]}")" comp_deps
build flashinfer "$(key_of r2 "${FI_WHLS[@]}")" comp_flashinfer
if [ "$WITH_CUTE_DSL" = 1 ]; then COMPS+=(cutedsl); build cutedsl "$(key_of r1 "${DSL_WHLS[@]}")" comp_cutedsl; fi
XCOMPS=()
for e in $EXTRAS; do
  XCOMPS+=("$e")
  case $e in
    moe) build moe "$(key_of r1 "$WHEEL")" comp_moe ;;
    humming) build humming "$(key_of r1 "${HUMMING_WHLS[@]}")" comp_humming ;;
    ray) build ray "$(key_of r1 "${RAY_WHLS[@]}")" comp_ray ;;
  esac
done

# A stream of components (xz and tar both read concatenated members: `xz -dc | tar -xi`), cut
# into pieces lettered from FIRST; left as it is when its components and cut are unchanged, so a
# re-run does not rewrite pieces that may be on their way to the device.
LETTERS=ABCDEFGHIJKLMNOPQRSTUVWXYZ
pieces_of() { [ -s "$OUT/$1" ] && cut -d' ' -f3 "$OUT/$1" || true; }
drop_stream() { # MANIFEST: delete its pieces, itself and its key
  local p
  for p in $(pieces_of "$1"); do rm -f "${OUT:?}/$p"; done
  rm -f "$OUT/$1" "$OUT/$1.key"
}
stream_intact() { # MANIFEST KEY
  [ -s "$OUT/$1" ] && [ "$(cat "$OUT/$1.key" 2>/dev/null)" = "$2" ] || return 1
  local size name
  while read -r _ size name; do [ "$(stat -c %s "$OUT/$name" 2>/dev/null)" = "$size" ] || return 1; done < "$OUT/$1"
}
cut_stream() { # MANIFEST FIRST-LETTER-INDEX COMPONENTS...: 0 when its pieces changed, else 1
  local man=$1 first=$2; shift 2
  local key c i f cutdir names=()
  key=$( { echo "$CHUNK_MIB $first $*"; for c in "$@"; do cat "$COMP/$c.key"; done; } | sha256sum | cut -c1-16)
  if stream_intact "$man" "$key"; then echo "   $man: unchanged"; return 1; fi
  cutdir=$(mktemp -d -p "$OUT")
  for c in "$@"; do cat "$COMP/$c.tar.xz"; done | split -b "${CHUNK_MIB}M" -a 2 -d - "$cutdir/p"
  i=$first
  for f in "$cutdir"/p*; do
    [ "$i" -lt 26 ] || { echo "more than 26 pieces" >&2; exit 1; }
    names+=("part${LETTERS:$i:1}"); mv "$f" "$cutdir/part${LETTERS:$i:1}"; i=$((i + 1))
  done
  ( cd "$cutdir" && for f in "${names[@]}"; do echo "$(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f") $f"; done ) > "$cutdir/manifest"
  if stream_intact "$man" "$(cat "$OUT/$man.key" 2>/dev/null)" && cmp -s "$cutdir/manifest" "$OUT/$man"; then
    rm -rf "$cutdir"; echo "$key" > "$OUT/$man.key"; echo "   $man: unchanged"; return 1
  fi
  drop_stream "$man"
  for c in manifest manifest-extras; do   # the other stream, where it holds one of these names
    [ "$c" != "$man" ] && pieces_of "$c" | grep -qxF -f <(printf '%s\n' "${names[@]}") && drop_stream "$c"
  done
  for f in "${names[@]}"; do mv "$cutdir/$f" "$OUT/$f"; done
  mv "$cutdir/manifest" "$OUT/$man"; rmdir "$cutdir"
  echo "$key" > "$OUT/$man.key"
  return 0
}
echo "== pieces of at most $CHUNK_MIB MiB"
cut_stream manifest 0 "${COMPS[@]}" || true
NBASE=$(pieces_of manifest | wc -l)
if [ ${#XCOMPS[@]} -gt 0 ]; then cut_stream manifest-extras "$NBASE" "${XCOMPS[@]}" || true
else drop_stream manifest-extras; fi

TREE=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for man in manifest manifest-extras; do
  [ -s "$OUT/$man" ] || continue
  while read -r _ size name; do
    echo "   $name  $(mib "$size") MiB  (+ project tree $(mib "$TREE") MiB = $(mib $((size + TREE))) of 64)"
    [ $((size + TREE)) -lt $((62 * 1048576)) ] || echo "   WARNING: $name and the tree come near the 64 MiB limit; lower CHUNK_MIB" >&2
  done < "$OUT/$man"
done

mapfile -t PARTS < <(pieces_of manifest)
mapfile -t XPARTS < <(pieces_of manifest-extras)
N=${#PARTS[@]}
echo
echo "Staged. On the device, calls back to back (the machine stays warm only ~30 s between calls):"
for i in "${!PARTS[@]}"; do
  p=${PARTS[$i]}; l=${p#part}
  if [ $((i + 1)) -lt "$N" ]; then
    printf '  call %d: carry [".gpu034/%s", ".gpu034/manifest"]  command: bash scripts/unpack_vllm034.sh %s\n' $((i + 1)) "$p" "$l"
  else
    printf '  call %d: carry [".gpu034/%s", ".gpu034/manifest", <ignored paths your job needs>]\n' $((i + 1)) "$p"
    printf '          command: bash scripts/unpack_vllm034.sh %s && bash scripts/gpu_jobs.sh start NAME scripts/gpu_vllm034.sh ... \\\n' "$l"
    # shellcheck disable=SC2016  # printed for the device's shell
    printf '                   && bash scripts/gpu_jobs.sh wait $((570 - SECONDS))\n'
  fi
done
for i in "${!XPARTS[@]}"; do
  p=${XPARTS[$i]}; l=${p#part}
  printf '  call %d: carry [".gpu034/%s", ".gpu034/manifest-extras"]  (extras: %s)\n' $((N + i + 1)) "$p" "${XCOMPS[*]}"
  # shellcheck disable=SC2016  # printed for the device's shell
  printf '          command: bash scripts/unpack_vllm034.sh %s && bash scripts/gpu_jobs.sh wait $((570 - SECONDS))\n' "$l"
done
cat <<EOF
  then, while the job runs: no carry, command: bash scripts/gpu_jobs.sh wait 570
The extras pieces are only kept there; 'scripts/gpu_vllm034.sh modules' unpacks them into /tmp/site
(by hand: 'bash scripts/unpack_vllm034.sh extras'). Commands of your own after the last base piece:
'source .gpu034/env.sh' first (recreate it with 'bash scripts/unpack_vllm034.sh env' if the re-laid
tree lost it). If /tmp/site/vllm is gone, the machine went cold: start again at call 1.
'bash scripts/unpack_vllm034.sh smoke' runs FlashInfer's Gemma RMSNorm and SM90 GDN prefill once on
the GPU against references.
vLLM there: env.sh sets VLLM_USE_FLASHINFER_SAMPLER=0. On Hopper vLLM now takes FlashInfer's GDN
prefill (CuTe DSL, compiled on first use; additional_config={"gdn_prefill_backend": "triton"} keeps
0.32's Triton path); pass enable_flashinfer_autotune=False to skip FlashInfer's warm-up autotuning.
JIT caches (FlashInfer, CuTe DSL, Triton) live in /tmp/jitcache, shared by every process of a
machine: none are staged, so a fresh machine's first engines compile them. 'bash
scripts/unpack_vllm034.sh savejit' writes them to \$OUT; copy those files into .gpu034/jit/ here and
carry ".gpu034/jit" with a call whose piece leaves room for them, to start warm.
EOF
