"""The identity of an engine's cached bytes: what a prefix cache file must match to be loaded.

A saved KV page or GDN state is valid only for the same weights, the same dtypes of
activations, KV and states, the same block size, the same tensor-parallel split and the same
code that laid the bytes out. The model's weights are named by their files' names, sizes and
modification times (hashing gigabytes at every start would cost more than the load saves).
The rank is not part of it: one file holds a section per rank (`vllm_hpc.persistence`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import vllm_hpc
from vllm_hpc.index import BLOCK_TOKENS

MODEL_FILES = ("*.json", "*.safetensors", "*.bin", "*.pt", "*.gguf")
"""The configuration and weight files that make a model's identity."""


def engine_fingerprint(vllm_config: Any) -> dict[str, Any]:
    import vllm

    model, cache = vllm_config.model_config, vllm_config.cache_config
    return {
        "model": str(model.model),
        "model_files": model_files_digest(str(model.model), model.revision),
        "dtype": str(model.dtype),
        "quantization": model.quantization,
        "kv_cache_dtype": str(cache.cache_dtype),
        "state_dtypes": [str(cache.mamba_cache_dtype), str(cache.mamba_ssm_cache_dtype)],
        "block_tokens": BLOCK_TOKENS,
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "vllm": vllm.__version__,
        "vllm_hpc": vllm_hpc.__version__,
    }


def model_files_digest(model: str, revision: str | None) -> str:
    """A digest of the model's configuration and weight files (name, size, mtime): its local
    directory, or the hub snapshot vLLM downloaded; "unknown" when neither is found."""
    directory = Path(model)
    if not directory.is_dir():
        located = _hub_snapshot(model, revision)
        if located is None:
            return "unknown"
        directory = located
    entries = []
    for pattern in MODEL_FILES:
        for path in directory.glob(pattern):
            stat = path.stat()  # follows the hub cache's symlinks to the blobs
            entries.append((path.name, stat.st_size, stat.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded: the name alone identifies it
        return None
