"""Puts the repository root on sys.path so `vllm_hpc` and `tests.index.harness` import
without an installed package (pytest's default rootdir handling only adds tests/index)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
