"""The soak's short version (`benchmarks/soak.py`): a minute of random sessions against one
server under device and host pressure, its engine auditing the cache at every step; then
nothing failed, leaked or changed an answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import soak

pytestmark = pytest.mark.engine


def test_a_minute_of_random_sessions(tiny_model_dir: Any, tmp_path: Path) -> None:
    result = soak.main(["--seconds", "60", "--exact-sample", "8", "--out", str(tmp_path)])
    assert not result["failures"], result["failures"]
    assert not result["mismatches"], result["mismatches"]
    assert result["rss_growth_mib"] <= result["rss_bound_mib"]
    assert result["answered"] > 0 and result["sessions"].get("cancel", 0) > 0
    print((tmp_path / "soak.md").read_text())
