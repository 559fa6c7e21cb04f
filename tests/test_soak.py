"""The soak's short version (`benchmarks/soak.py`, run as a user runs it): a minute of random
sessions against one server under device and host pressure, its engine auditing the cache at
every step; then nothing failed, leaked or changed an answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def test_a_minute_of_random_sessions(tiny_model_dir: Any, tmp_path: Path) -> None:
    command = [sys.executable, str(SOAK), "--seconds", "60", "--exact-sample", "8"]
    run = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True)
    print(run.stdout[-3000:], run.stderr[-3000:])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert not result["failures"], result["failures"]
    assert not result["mismatches"], result["mismatches"]
    assert result["rss_growth_mib"] <= result["rss_bound_mib"]
    assert result["answered"] > 0 and result["sessions"].get("cancel", 0) > 0
    assert run.returncode == 0  # the soak's own verdict, on the same figures
    print((tmp_path / "soak.md").read_text())
