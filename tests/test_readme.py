"""The README's options table names every option of `vllm_hpc.options`, each with its flag and
its `additional_config` key, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_hpc.options import OPTION_SPECS

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_options() -> list[tuple[str, str]]:
    """(flag, key) of each row of the README's options table, in its order."""
    return re.findall(r"^\| `(--[a-z-]+)` / `([a-z_]+)` \|", README.read_text(), re.MULTILINE)


def test_the_readme_lists_every_option_with_its_flag_and_key() -> None:
    listed = readme_options()
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == {(spec.flag, spec.key) for spec in OPTION_SPECS}
