"""Replays the GPU mix's requests through the pure-Python cache runtime, with the geometry the
H100 engine had, to see which taps of a long prompt exist when the next request looks them up.

Question (#47, `benchmarks/results/gpu_vllm034.md`, "Where the hits differ"): on vLLM 0.34 with
the 27B VL shape's float32 state, turn 6.1 resumed 15,808 tokens of turn 6.0's 24,000, where the
plan had deeper taps. The runtime here is the engine's own (`HybridPrefixCache`, built by
`derived.runtime_config` as the glue builds it); what stands in for vLLM is a small model of its
async scheduler: a step is scheduled before the previous step's output is processed, commits
count non-final prefill chunks in flight (vLLM adds output placeholders only for steps that
sample), and a host write batch lands ``--write-lag`` steps after the step that issued it.

The prompts are the mix's own (`workloads.mix` with the report's profile and vocabulary), each
turn fed the answer the JSON recorded, so the digests match. Requests arrive at their session's
start time and follow each other within a session; steps take a time proportional to their
tokens (roughly the H100's), which only orders the sessions' overlaps.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/archive/deep_edit_slots.py \
        --config .gpu/model27b-vl/config.json [--slots N] [--write-lag L] [--trace 6.1]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import admit_head
from workloads import Shape, mix

from vllm_hpc.derived import runtime_config
from vllm_hpc.glue.row_layout import Span, aligned_state_bytes, plan_rows
from vllm_hpc.index import BLOCK_TOKENS
from vllm_hpc.options import PluginOptions
from vllm_hpc.runtime.cache import HybridPrefixCache, RequestInfo
from vllm_hpc.runtime.lane import Lane

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "benchmarks/results/gpu_vllm034_mix.json"
CONFIG = ROOT / ".gpu/model27b-vl/config.json"
SIDE = "hybrid-prefix-host"

STEP_S = 0.018
"""A decode-only step's time on the H100 (the report: 8 tokens in about 0.14 s)."""
TOKEN_S = 0.70 / 8192
"""A prefill token's (the report: a 24,000-token prompt's three chunks in about 2.1 s)."""


@dataclass(frozen=True)
class Geometry:
    page_bytes: int
    image_bytes: int
    row_pages: int
    device_pages: int


def geometry(config_path: Path, num_blocks: int) -> Geometry:
    """What the glue derives from the model and vLLM's KV cache (`state_rows`, `StatePool`):
    attention pages of 64 tokens over the full-attention layers (bf16 KV), one GDN state per
    linear-attention layer (bf16 conv window, the config's ``mamba_ssm_dtype`` recurrent state)."""
    text = json.loads(config_path.read_text())
    text = text.get("text_config", text)
    kinds = text["layer_types"]
    attention, gdn = kinds.count("full_attention"), kinds.count("linear_attention")
    layer_page = BLOCK_TOKENS * text["num_key_value_heads"] * text["head_dim"] * 2 * 2
    conv_dim = (
        2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
        + text["linear_num_value_heads"] * text["linear_value_head_dim"]
    )
    conv = conv_dim * (text["linear_conv_kernel_dim"] - 1) * 2
    ssm_width = 4 if text.get("mamba_ssm_dtype") == "float32" else 2
    ssm = (
        text["linear_num_value_heads"]
        * text["linear_value_head_dim"]
        * text["linear_key_head_dim"]
        * ssm_width
    )
    spans = [Span(i * layer_page, layer_page) for i in range(attention)]  # layer-outer
    layout = plan_rows(spans, aligned_state_bytes([conv, ssm]), gdn, num_blocks - 1)
    return Geometry(layer_page * attention, gdn * (conv + ssm), layout.row_pages, num_blocks - 1)


def blocks_from_report(kv_tokens: int, max_model_len: int, groups: int) -> int:
    """vLLM's KV blocks from the capacity it logged: ``kv_tokens`` is
    ``num_blocks / blocks_per_request * max_model_len`` (vLLM 0.34's
    `get_max_concurrency_for_kv_cache_config`), a request taking ``max_model_len / 64`` pages
    and one block in each of ``groups`` GDN groups."""
    per_request = max_model_len // BLOCK_TOKENS + groups
    blocks = kv_tokens * per_request // max_model_len
    while int(blocks * max_model_len / per_request) < kv_tokens:
        blocks += 1
    assert int(blocks * max_model_len / per_request) == kv_tokens, "no block count gives it"
    return blocks


@dataclass
class Request:
    session: int
    turn: int
    tokens: list[int]
    answer: list[int]
    recorded: int
    """Tokens the GPU run served from the cache."""
    lane: Lane | None = None
    computed: int = 0
    outputs: int = 0
    placeholders: int = 0
    frontier: int | None = None
    taps: list[int] = field(default_factory=list)
    skipped_before: int = 0
    skipped: int = 0
    """Taps skipped for want of a slot while it ran (its own, and those of requests beside it)."""
    done: bool = False

    @property
    def name(self) -> str:
        return f"{self.session}.{self.turn}"

    @property
    def n(self) -> int:
        return len(self.tokens)

    def info(self) -> RequestInfo:
        tokens = self.tokens + self.answer[: self.outputs]
        return RequestInfo(self.name, tokens, self.n)


def sessions(report: dict, config: Path) -> list[tuple[float, list[Request]]]:
    """The mix's sessions as the GPU run sent them: each turn's prompt rebuilt from its
    workload with the answer the run recorded, checked against the recorded digest."""
    from replay import digest

    profile = report["profile"]
    vocab = json.loads(config.read_text())["text_config"]["vocab_size"]
    shape, branch = Shape(vocab, profile["scale"]), Shape(vocab, profile["branch_scale"])
    records = {
        (r["session"], r["turn"]): r
        for r in report["configs"][SIDE]["workloads"]["mix"]["requests"]
    }
    out = []
    for index, session in enumerate(
        mix(shape, profile["rate"], profile["mix_sessions"], branch=branch)
    ):
        turns: list[Request] = []
        prompt = next(session.turns)
        for turn in range(len(records)):
            record = records.get((index, turn))
            if record is None:
                break
            assert digest(prompt) == record["prompt_digest"], f"{index}.{turn}: other prompt"
            turns.append(Request(index, turn, prompt, record["answer"], record["cached_tokens"]))
            try:
                prompt = session.turns.send(record["answer"])
            except StopIteration:
                break
        out.append((session.start_s, turns))
    return out


class Engine:
    """vLLM's async scheduler around the cache, as far as taps and commits go."""

    def __init__(self, cache: HybridPrefixCache, budget: int, write_lag: int) -> None:
        self.cache = cache
        self.budget = budget
        self.write_lag = write_lag
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.in_flight: list[tuple[int, list[tuple[Request, int, bool]], list[int]]] = []
        self.step = 0
        self.landing: list[tuple[int, list[int]]] = []
        self.finished: list[Request] = []

    def schedule(self) -> float:
        """One `schedule()`: running requests first, then the waiting queue's head onwards."""
        cache = self.cache
        cache.new_step()
        budget = self.budget
        scheduled: list[tuple[Request, int, bool]] = []
        for request in self.running:
            if budget <= 0:
                break
            if request.computed < request.n:
                size = cache.chunk_limit(
                    request.lane.taps,
                    request.computed,
                    min(budget, request.n - request.computed),
                    request.n,
                )
                if size == 0:
                    continue
            elif request.outputs + request.placeholders < len(request.answer):
                size = 1
            else:
                continue
            start = request.computed
            assert cache.grow(request.lane, start + size) is not None
            self._scheduled(request, start, size, scheduled)
            budget -= size
        while self.waiting and budget > 0:
            request = self.waiting[0]
            lookup, lane, size = admit_head(cache, request.info(), budget)
            if lane is None:
                break
            self.waiting.pop(0)
            request.lane, request.frontier = lane, lookup.frontier
            request.taps = [t.position for t in lookup.taps]
            request.computed = lookup.frontier
            request.skipped_before = cache.index.stats.taps_skipped_no_slot
            self.running.append(request)
            self._scheduled(request, lookup.frontier, size, scheduled)
            budget -= size
        plan = cache.take_plan()
        batches = [w.batch for w in plan.host_writes]
        self.in_flight.append((self.step, scheduled, batches))
        self.step += 1
        tokens = self.budget - budget
        return STEP_S + TOKEN_S * tokens if scheduled else 0.0

    def _scheduled(self, request: Request, start: int, size: int, out: list) -> None:
        tokens = request.tokens + request.answer[: request.outputs]
        end = min(start + size, len(tokens))
        if end > start:
            self.cache.on_scheduled(request.lane, tokens, start, end)
        request.computed = start + size
        samples = request.computed >= request.n
        if samples:
            request.placeholders += 1
        out.append((request, size, samples))

    def update(self) -> None:
        """`update_from_output` of the oldest step in flight."""
        step, scheduled, batches = self.in_flight.pop(0)
        self.landing.append((step + self.write_lag, batches))
        landed = [b for s, bs in self.landing if s <= step for b in bs]
        self.landing = [(s, bs) for s, bs in self.landing if s > step]
        self.cache.complete_writes(landed)
        for request, _, samples in scheduled:
            if samples:
                request.placeholders -= 1
                request.outputs += 1
            if request.done:
                continue
            tokens = request.tokens + request.answer[: request.outputs]
            if request.outputs >= len(request.answer):
                request.done = True
                self.running.remove(request)
                self.cache.finish(request.lane, tokens, request.computed - request.placeholders)
                request.skipped = (
                    self.cache.index.stats.taps_skipped_no_slot - request.skipped_before
                )
                self.finished.append(request)
            else:
                self.cache.commit(request.lane, tokens, request.computed - request.placeholders)

    def idle(self) -> bool:
        return not (self.running or self.waiting or self.in_flight)


def snapshots_on(cache: HybridPrefixCache, request: Request) -> list[str]:
    """The snapshots on the request's prompt path, with where their images are."""
    prompt = cache.admission._prompt(request.info())
    match = cache.index.match(prompt)
    out = []
    for s in match.candidates:
        where = "+".join(sorted(m.name.lower() for m in s.media))
        mark = "S" if s.superseded else ""
        out.append(f"{s.frontier}{mark}({where})")
    return out


def run(args: argparse.Namespace) -> tuple[list[Request], HybridPrefixCache]:
    report = json.loads(REPORT.read_text())
    engine_record = report["configs"][SIDE]["engine"]
    kwargs = engine_record["kwargs"]
    blocks = blocks_from_report(engine_record["kv_tokens"], kwargs["max_model_len"], args.groups)
    geo = geometry(args.config, blocks)
    extra = dict(kwargs["additional_config"])
    if args.slots is not None:
        extra["device_snapshot_slots"] = args.slots
    if args.taps is not None:
        extra["cache_taps_per_request"] = args.taps
    options = PluginOptions.from_additional_config(extra)
    config = runtime_config(
        options,
        device_pages=geo.device_pages,
        row_pages=geo.row_pages,
        page_bytes=geo.page_bytes,
        image_bytes=geo.image_bytes,
        max_seqs=kwargs["max_num_seqs"],
        max_model_len=kwargs["max_model_len"],
        chunk=engine_record["chunk"],
        in_pass=True,
    )
    print(
        f"geometry: {blocks} blocks, {geo.device_pages} pages of {geo.page_bytes >> 20} MiB, "
        f"image {geo.image_bytes / 2**20:.1f} MiB, rows of {geo.row_pages} pages: "
        f"{geo.device_pages // geo.row_pages} rows; device snapshot slots "
        f"{config.index.snapshot_slots}; host {config.index.host_budget_bytes >> 20} MiB; "
        f"taps {config.tap_policy}"
    )
    cache = HybridPrefixCache(config)
    engine = Engine(cache, engine_record["chunk"], args.write_lag)
    plays = sessions(report, args.config)
    queues: list[Iterator[Request]] = [iter(turns) for _, turns in plays]
    pending = [(start, index) for index, (start, _) in enumerate(plays)]
    current: dict[int, Request] = {}
    now = 0.0
    while pending or current or not engine.idle():
        for start, index in [p for p in pending if p[0] <= now]:
            pending.remove((start, index))
            nxt = next(queues[index], None)
            if nxt is not None:
                current[index] = nxt
                engine.waiting.append(nxt)
        if args.trace is not None:
            for request in engine.waiting:
                if request.name == args.trace and request.frontier is None:
                    print(f"  at {request.name}'s arrival: {snapshots_on(cache, request)}")
        took = engine.schedule() if (engine.running or engine.waiting) else 0.0
        if len(engine.in_flight) > 1 or (engine.in_flight and not took):
            engine.update()
        for request in list(engine.finished):
            engine.finished.remove(request)
            current.pop(request.session)
            pending.append((now + took, request.session))
        now += took if took else 0.05
    return [r for _, turns in plays for r in turns], cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, help="--device-snapshot-slots (default: derived)")
    parser.add_argument("--taps", type=int, help="--cache-taps-per-request (default: derived)")
    parser.add_argument("--write-lag", type=int, default=1, help="steps until a write lands")
    parser.add_argument("--groups", type=int, default=3, help="vLLM's GDN KV cache groups")
    parser.add_argument("--trace", help="print the snapshots on this request's path (6.1)")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the model's config.json")
    args = parser.parse_args()
    rows, cache = run(args)
    print(f"{'req':>4} {'n':>6} {'GPU':>6} {'sim':>6}  skipped  planned taps")
    for r in rows:
        taps = ",".join(str(t) for t in r.taps)
        print(f"{r.name:>4} {r.n:6} {r.recorded:6} {r.frontier:6}  {r.skipped:7}  {taps}")
    print(f"hit tokens: GPU {sum(r.recorded for r in rows)}, here {sum(r.frontier for r in rows)}")
    stats = cache.index.stats
    print(
        f"taps skipped for want of a slot (vllm:hpc_taps_skipped): {stats.taps_skipped_no_slot}; "
        f"snapshots published: {stats.snapshots_published}"
    )


if __name__ == "__main__":
    sys.exit(main())
