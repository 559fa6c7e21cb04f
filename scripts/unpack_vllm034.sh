#!/usr/bin/env bash
# Device-side half of scripts/stage_vllm034.sh. Runs on the lent GPU machine, in the project root.
#   bash scripts/unpack_vllm034.sh A   keep piece A (carried as .gpu034/partA) in /tmp/stage034
#   bash scripts/unpack_vllm034.sh B   the same for each later piece; the last base piece also
#                                      unpacks everything into /tmp/site, writes .gpu034/env.sh
#                                      and checks
#   bash scripts/unpack_vllm034.sh E   an extras piece (listed in .gpu034/manifest-extras, carried
#                                      with it): kept in /tmp/stage034x, nothing unpacked
#   bash scripts/unpack_vllm034.sh extras [WAIT_S]
#                                      unpack the kept extras into /tmp/site once they are all
#                                      there, waiting up to WAIT_S seconds (default 0) for the
#                                      calls that carry them; exit 4 if they did not come
#   bash scripts/unpack_vllm034.sh env     write .gpu034/env.sh again (the tree is re-laid per call)
#   bash scripts/unpack_vllm034.sh check   versions and imports
#   bash scripts/unpack_vllm034.sh preflight  what the engine test modules import, one line each
#   bash scripts/unpack_vllm034.sh smoke   run FlashInfer's Gemma RMSNorm and SM90 GDN prefill once
#   bash scripts/unpack_vllm034.sh savejit write the JIT caches (/tmp/jitcache) to $OUT/jit034.partN
#   bash scripts/unpack_vllm034.sh loadjit unpack carried .gpu034/jit/jit034.part* into /tmp/jitcache
#                                          (piece calls do this too when .gpu034/jit is carried)
# Each base piece call carries .gpu034/partX and .gpu034/manifest (sha256, size, name of each
# piece); each extras piece call .gpu034/partX and .gpu034/manifest-extras.
set -euo pipefail
SITE=/tmp/site
STAGE=/tmp/stage034
XSTAGE=/tmp/stage034x    # the extras' pieces, kept after they are unpacked (a re-staged base
XMARK=$SITE/.extras034   # replaces /tmp/site); XMARK holds the manifest they were unpacked from
JIT=/tmp/jitcache        # FlashInfer's nvcc JIT, CuTe DSL and Triton caches, kept together
D=.gpu034

cold() { echo "$*: the machine went cold between calls (or a piece was skipped); start again at 'bash scripts/unpack_vllm034.sh A'" >&2; exit 3; }

write_env() {
  mkdir -p "$D"
  local nvcc inc
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc 2>/dev/null | head -1 || true)
  [ -z "$nvcc" ] || nvcc=$(readlink -f "$nvcc")
  {
    # dsl_packages: nvidia-cutlass-dsl's .pth does this, but .pth files are not read from PYTHONPATH.
    echo "export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:\$(pwd)\${PYTHONPATH:+:\$PYTHONPATH}"
    echo "export PYTHONUNBUFFERED=1"
    # vLLM's own sampler; FlashInfer's would JIT-compile its sampling kernels with nvcc first.
    echo "export VLLM_USE_FLASHINFER_SAMPLER=0"
    # JIT caches under one folder, so that savejit can send them back through \$OUT.
    echo "export FLASHINFER_WORKSPACE_BASE=$JIT CUTE_DSL_CACHE_DIR=$JIT/cute_dsl TRITON_CACHE_DIR=$JIT/triton"
    # FlashInfer's nvcc JIT (and vLLM's has_flashinfer()) need nvcc, and ninja on PATH.
    if [ -n "$nvcc" ] && ! command -v nvcc >/dev/null; then
      echo "export CUDA_HOME=$(dirname "$(dirname "$nvcc")") PATH=$(dirname "$nvcc"):\$PATH"
    fi
    if ! command -v ninja >/dev/null; then
      b=$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null || true)
      [ -n "$b" ] && echo "export PATH=\$PATH:$b"
    fi
    # FlashInfer's CUDA headers include cublasLt.h; take it from torch's nvidia-cublas wheel when
    # the toolkit beside nvcc lacks it (the development machine's CUDA 13.0 does).
    if [ -n "$nvcc" ] && [ ! -f "$(dirname "$(dirname "$nvcc")")/include/cublasLt.h" ]; then
      inc=$(python3 -c 'import os, sys
for p in sys.path:
    for d in ("nvidia/cu13/include", "nvidia/cublas/include"):
        if os.path.isfile(os.path.join(p, d, "cublasLt.h")): print(os.path.join(p, d)); raise SystemExit' 2>/dev/null || true)
      [ -n "$inc" ] && echo "export CPATH=$inc\${CPATH:+:\$CPATH}"
    fi
  } > "$D/env.sh"
}

loadjit() {
  compgen -G "$D/jit/jit034.part*" >/dev/null || return 0
  mkdir -p "$JIT"
  cat "$D"/jit/jit034.part* | xz -dc | tar -xf - -C /tmp
  echo "JIT caches from $D/jit unpacked into $JIT ($(du -sh "$JIT" | cut -f1))"
}

check() {
  # shellcheck disable=SC1091
  source "$D/env.sh"
  python3 - <<'EOF'
import time
t = time.time()
import vllm
print("vllm", vllm.__version__, f"({time.time() - t:.1f} s)")
t = time.time()
import flashinfer
print("flashinfer", flashinfer.__version__, f"({time.time() - t:.1f} s)")
import flashinfer.norm  # noqa: F401  (Qwen3.5's Gemma RMSNorm)
print("import flashinfer.norm: ok")
import flashinfer.comm  # noqa: F401  (vLLM imports it with the Qwen3.5 model, for TP>1 fusions)
print("import flashinfer.comm: ok")
try:
    import cutlass
except ImportError:  # staged with WITH_CUTE_DSL=0
    print("no CuTe DSL: FlashInfer's SM90 GDN prefill is unavailable; run vLLM with "
          "additional_config={'gdn_prefill_backend': 'triton'} (norms fall back to nvcc JIT)")
else:
    print("cutlass-dsl", getattr(cutlass, "__version__", "?"))
    import flashinfer.gdn_prefill as g  # vLLM's GDN prefill on SM90
    assert g.chunk_gated_delta_rule_sm90 is not None, "SM90 GDN prefill kernel unavailable"
    print("import flashinfer.gdn_prefill: ok (SM90 CuTe-DSL kernel present)")
EOF
  echo "nvcc: $(command -v nvcc || echo missing)  ninja: $(command -v ninja || echo missing)"
  echo "what the engine test modules import (MISSING extras are fine before their pieces came):"
  preflight || echo "preflight stopped (rc $?); the checks above stand"
}

smoke() {
  # shellcheck disable=SC1091
  source "$D/env.sh"
  python3 - <<'EOF'
import time, torch
import torch.nn.functional as F
dev = "cuda"
torch.manual_seed(0)
# Gemma RMSNorm: out = x / rms(x) * (1 + w)
from flashinfer.norm import gemma_rmsnorm, gemma_fused_add_rmsnorm
x = torch.randn(7, 5120, device=dev, dtype=torch.bfloat16)
w = torch.randn(5120, device=dev, dtype=torch.bfloat16) * 0.1
t = time.time(); y = gemma_rmsnorm(x, w, 1e-6); torch.cuda.synchronize()
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.float())).bfloat16()
print(f"gemma_rmsnorm: max|diff| {(y.float() - ref.float()).abs().max().item():.4f} (first call {time.time() - t:.1f} s)")
r = torch.randn_like(x); x2, r2 = x.clone(), r.clone()
gemma_fused_add_rmsnorm(x2, r2, w, 1e-6)
s = (x.float() + r.float())
ref2 = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.float())).bfloat16()
print(f"gemma_fused_add_rmsnorm: max|diff| {(x2.float() - ref2.float()).abs().max().item():.4f}")
# GDN prefill, as vLLM calls it on SM90 (FlashInfer takes exp(g)), against vLLM's Triton/FLA kernel.
import importlib.util
if importlib.util.find_spec("cutlass") is None:
    raise SystemExit("no CuTe DSL staged: skipping the GDN prefill check")
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import fi_chunk_gated_delta_rule
from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule as fla
T, HV, K = 300, 4, 128
q = torch.randn(1, T, HV, K, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, T, HV, K, device=dev, dtype=torch.bfloat16)
v = torch.randn(1, T, HV, K, device=dev, dtype=torch.bfloat16)
g = F.logsigmoid(torch.randn(1, T, HV, device=dev, dtype=torch.float32))
beta = torch.rand(1, T, HV, device=dev, dtype=torch.float32).sigmoid()
h0 = torch.zeros(1, HV, K, K, device=dev, dtype=torch.float32)
cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
o_ref, s_ref = fla(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
t = time.time()
o_fi, s_fi = fi_chunk_gated_delta_rule(q, k, v, torch.exp(g), beta, h0.clone(), True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
torch.cuda.synchronize()
print(f"flashinfer GDN prefill: out max|diff| vs FLA {(o_fi.float() - o_ref.float()).abs().max().item():.4f}, "
      f"state max|diff| {(s_fi.float() - s_ref.float()).abs().max().item():.4f} (first call {time.time() - t:.1f} s)")
EOF
  du -sh "$JIT" 2>/dev/null || true
}

preflight() {
  # shellcheck disable=SC1091
  source "$D/env.sh"
  python3 - <<'EOF'
import importlib, importlib.util, os, time
def probe(what, module, attr=None):
    t = time.time()
    try:
        m = importlib.import_module(module)
        v = getattr(m, attr or "__version__", "") if attr != "" else ""
        print(f"  ok       {what}: {module} {v} ({time.time() - t:.1f} s)")
    except Exception as e:  # noqa: BLE001
        print(f"  MISSING  {what}: {module}: {type(e).__name__}: {str(e)[:200]}")
probe("vLLM", "vllm")
probe("OpenAI server (test_server, test_vision, ...)", "vllm.entrypoints.openai.api_server", "")
probe("its routers (Anthropic Messages, SageMaker)", "vllm.entrypoints.launchers.api_server.routers", "")
probe("SageMaker standards (the server's LoRA routes)", "model_hosting_container_standards.sagemaker", "")
probe("KV events (test_kv_events)", "zmq")
probe("FlashInfer", "flashinfer")
probe("CuTe DSL", "cutlass")
probe("MoE kernels (test_moe, *-moe)", "vllm._moe_C_stable_libtorch", "")
probe("Humming (GPTQ/AWQ on SM90)", "humming", "")
probe("Ray (test_ray_executor)", "ray")
EOF
}

extras() {
  local wait_s=${1:-0} begin=$SECONDS missing n want
  [ -d "$SITE/vllm" ] || cold "no vLLM in $SITE"
  while :; do
    missing=()
    if [ -f "$XSTAGE/manifest" ]; then
      cmp -s "$XSTAGE/manifest" "$XMARK" 2>/dev/null && { echo "extras already unpacked into $SITE"; return 0; }
      while read -r _ want n; do
        [ "$(stat -c %s "$XSTAGE/$n" 2>/dev/null || echo 0)" = "$want" ] || missing+=("${n#part}")
      done < "$XSTAGE/manifest"
      [ ${#missing[@]} -gt 0 ] || break
    else
      missing=("(all: none carried with .gpu034/manifest-extras yet)")
    fi
    if [ $((SECONDS - begin)) -ge "$wait_s" ]; then
      echo "extras not unpacked: pieces ${missing[*]} did not come within ${wait_s} s"
      return 4
    fi
    sleep 10
  done
  ( cd "$XSTAGE" && while read -r sum _ n; do echo "$sum  $n"; done < manifest | sha256sum -c --quiet ) \
    || { echo "a kept extras piece is damaged: carry it again" >&2; return 3; }
  local t0=$SECONDS
  # Into the live site directory (the extras add files, they replace none), gently: a measurement
  # may be running beside this.
  while read -r _ _ n; do cat "$XSTAGE/$n"; done < "$XSTAGE/manifest" | nice -n 19 xz -dc -T2 | tar -xif - -C "$SITE"
  cp "$XSTAGE/manifest" "$XMARK"
  echo "unpacked the extras ($(cut -d' ' -f3 "$XSTAGE/manifest" | tr '\n' ' ')) into $SITE in $((SECONDS - t0)) s"
}

case "${1:-}" in
  [A-Z])
    L=$1
    # An extras piece: listed in the carried manifest-extras (with the carried piece's checksum).
    if [ -f "$D/part$L" ] && [ -f "$D/manifest-extras" ] && xline=$(grep " part$L\$" "$D/manifest-extras") \
        && [ "$(sha256sum "$D/part$L" | cut -d' ' -f1)" = "${xline%% *}" ]; then
      mapfile -t XNAMES < <(cut -d' ' -f3 "$D/manifest-extras")
      if [ "part$L" = "${XNAMES[0]}" ] || ! cmp -s "$D/manifest-extras" "$XSTAGE/manifest" 2>/dev/null; then
        rm -rf "$XSTAGE"; mkdir -p "$XSTAGE"; cp "$D/manifest-extras" "$XSTAGE/manifest"
      fi
      cp "$D/part$L" "$XSTAGE/part$L"
      loadjit
      left=()
      for n in "${XNAMES[@]}"; do [ -f "$XSTAGE/$n" ] || left+=("${n#part}"); done
      echo "kept extras piece $L in $XSTAGE ($(du -sh "$XSTAGE" | cut -f1));" \
        "${left[*]:-none} to come; 'bash scripts/unpack_vllm034.sh extras' (or the modules step) unpacks them"
      exit 0
    fi
    L=$1
    [ -f "$D/manifest" ] || { echo "$D/manifest was not carried" >&2; exit 2; }
    mapfile -t NAMES < <(cut -d' ' -f3 "$D/manifest")
    LAST=${NAMES[-1]}
    line=$(grep " part$L\$" "$D/manifest") || { echo "no part$L in the manifest (pieces: ${NAMES[*]})" >&2; exit 2; }
    [ -f "$D/part$L" ] || { echo "$D/part$L was not carried" >&2; exit 2; }
    [ "$(sha256sum "$D/part$L" | cut -d' ' -f1)" = "${line%% *}" ] || { echo "part$L does not match the manifest" >&2; exit 2; }
    if [ "$L" = A ]; then rm -rf "$STAGE"; mkdir -p "$STAGE"; cp "$D/manifest" "$STAGE/manifest"; fi
    cmp -s "$D/manifest" "$STAGE/manifest" 2>/dev/null || cold "no pieces of this staging in $STAGE"
    for n in "${NAMES[@]}"; do        # every piece before this one must be in place
      [ "$n" = "part$L" ] && break
      want=$(grep " $n\$" "$D/manifest" | cut -d' ' -f2)
      [ "$(stat -c %s "$STAGE/$n" 2>/dev/null || echo 0)" = "$want" ] || cold "$n is missing"
    done
    cp "$D/part$L" "$STAGE/part$L"
    loadjit
    if [ "part$L" != "$LAST" ]; then
      for i in "${!NAMES[@]}"; do [ "${NAMES[$i]}" = "part$L" ] && next=${NAMES[$((i + 1))]}; done
      echo "kept part$L in $STAGE ($(du -sh "$STAGE" | cut -f1) so far); next: ${next#part}"
      exit 0
    fi
    ( cd "$STAGE" && while read -r sum _ n; do echo "$sum  $n"; done < manifest | sha256sum -c --quiet ) \
      || cold "a kept piece is damaged"
    t0=$(date +%s)
    rm -rf "$SITE.new"; mkdir -p "$SITE.new"
    # Components are concatenated .tar.xz streams: -i reads past each tar's end-of-archive blocks.
    for n in "${NAMES[@]}"; do cat "$STAGE/$n"; done | xz -dc -T0 | tar -xif - -C "$SITE.new"
    rm -rf "$SITE" "$STAGE"; mv "$SITE.new" "$SITE"
    echo "unpacked ${#NAMES[@]} pieces into $SITE ($(du -sh "$SITE" | cut -f1), $(( $(date +%s) - t0 )) s)"
    write_env
    check ;;
  env) write_env; cat "$D/env.sh" ;;
  check) check ;;
  preflight) preflight ;;
  extras) extras "${2:-0}" ;;
  smoke) smoke ;;
  loadjit) loadjit ;;
  savejit)
    [ -n "${OUT:-}" ] && [ -d "$JIT" ] || { echo "needs \$OUT and $JIT" >&2; exit 2; }
    # $OUT takes at most 8 files of 16 MiB: pieces of 15 MiB.
    tar -C /tmp -cf - "$(basename "$JIT")" | xz -6 -T0 | split -b 15M -d -a 1 - "$OUT/jit034.part"
    ls -la "$OUT"/jit034.part*
    echo "copy them into .gpu034/jit/ on the development machine and carry \".gpu034/jit\"" ;;
  *) echo "usage: bash scripts/unpack_vllm034.sh A|B|...|extras [WAIT_S]|env|check|preflight|smoke|savejit|loadjit" >&2; exit 2 ;;
esac
