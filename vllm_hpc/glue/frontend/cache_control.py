"""Anthropic `cache_control` blocks as exact taps (§7.1, priority 1) on vLLM's Messages API.

vLLM 0.32.0 parses a Messages request into content-block models without a `cache_control`
field, so the marks are gone before the chat template runs. For models served by hybrid-prefix
the plugin reads them from the request's raw body, renders the request cut just after each
marked block (tools, then system, then messages: Anthropic's prefix order), and takes the
longest common prefix of that rendering's token ids with the whole prompt's as the breakpoint.
The breakpoints reach the scheduler the way OpenAI clients' `vllm_xargs.cache_breakpoints` do.
Like Anthropic, more than four marked blocks, or a malformed mark, is a 400 naming the field.

The streamed `message_start` event carries vLLM's first chunk's usage. On vLLM 0.32.0 it has
no cached tokens yet (vLLM fills `prompt_tokens_details` in the last chunk only), and the plugin
adds the request's cached tokens there, so `cache_read_input_tokens` is reported from the first
event; 0.34.0 does so itself (`versions.anthropic_stream_reports_cached_tokens`).
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.architecture import ARCHITECTURES
from vllm_hpc.glue.sampling import BREAKPOINTS_KEY
from vllm_hpc.glue.versions import anthropic_stream_reports_cached_tokens

MAX_MARKS = 4
"""Anthropic's limit on blocks with `cache_control` in one request."""
TTLS = ("5m", "1h")
EMPTY_USER = {"role": "user", "content": ""}
"""Closes a cut that holds no user message, which Qwen3's templates refuse to render; its
header may join the common prefix, which stays a prefix of the real prompt."""


class CacheControlError(ValueError):
    """A malformed or excess `cache_control`; the message names the field."""


@dataclass(frozen=True, slots=True)
class CacheMark:
    """One block marked with `cache_control`: where it is, and the request body cut after it."""

    field: str
    cut: dict[str, Any]


def _check_mark(value: Any, field: str) -> None:
    if not isinstance(value, dict):
        raise CacheControlError(f"{field}: must be an object such as {{'type': 'ephemeral'}}")
    if value.get("type") != "ephemeral":
        raise CacheControlError(f"{field}.type: must be 'ephemeral'")
    if "ttl" in value and value["ttl"] not in TTLS:
        raise CacheControlError(f"{field}.ttl: must be one of {', '.join(TTLS)}")
    extra = sorted(set(value) - {"type", "ttl"})
    if extra:
        raise CacheControlError(f"{field}.{extra[0]}: extra inputs are not permitted")


def _with_user(messages: list[Any]) -> list[Any]:
    has_user = any(isinstance(m, dict) and m.get("role") == "user" for m in messages)
    return messages if has_user else [*messages, EMPTY_USER]


def _marked(block: Any, field: str, cut: dict[str, Any]) -> list[CacheMark]:
    """The mark of ``block`` (none when it has no `cache_control`), checked."""
    if not isinstance(block, dict) or "cache_control" not in block:
        return []
    _check_mark(block["cache_control"], f"{field}.cache_control")
    return [CacheMark(f"{field}.cache_control", cut)]


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def find_marks(body: Any) -> list[CacheMark]:
    """The marked blocks of a Messages request body, in prompt order; CacheControlError for a
    malformed mark or more than `MAX_MARKS`. What vLLM's schema refuses is left to it."""
    if not isinstance(body, dict):
        return []
    base = {key: value for key, value in body.items() if key != "system"}
    base["stream"] = False
    tools, system, messages = (_listed(body.get(k)) for k in ("tools", "system", "messages"))
    marks: list[CacheMark] = []
    for i, tool in enumerate(tools):
        cut = {**base, "tools": tools[: i + 1], "messages": [EMPTY_USER]}
        marks += _marked(tool, f"tools.{i}", cut)
    for i, block in enumerate(system):
        cut = {**base, "system": system[: i + 1], "messages": [EMPTY_USER]}
        marks += _marked(block, f"system.{i}", cut)
    for m, message in enumerate(messages):
        content = _listed(message.get("content")) if isinstance(message, dict) else []
        for i, block in enumerate(content):
            cut_messages = [*messages[:m], {**message, "content": content[: i + 1]}]
            cut = {**base, "system": body.get("system"), "messages": _with_user(cut_messages)}
            marks += _marked(block, f"messages.{m}.content.{i}", cut)
    if len(marks) > MAX_MARKS:
        raise CacheControlError(
            f"cache_control: a maximum of {MAX_MARKS} blocks with cache_control may be "
            f"provided; found {len(marks)}"
        )
    return marks


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def merged_breakpoints(vllm_xargs: Any, positions: Sequence[int]) -> dict[str, Any]:
    """``vllm_xargs`` with ``positions`` past the first token added to its breakpoints; a
    client's malformed value is kept as it is, for the request check to refuse naming it."""
    xargs = dict(vllm_xargs or {})
    given = xargs.get(BREAKPOINTS_KEY, [])
    if isinstance(given, list) and all(type(p) is int for p in given):
        xargs[BREAKPOINTS_KEY] = sorted({*given, *(p for p in positions if p > 1)})
    return xargs


_PENDING: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "vllm_hpc_cache_marks", default=None
)
"""The marked cuts (as Messages requests) of the request `create_messages` is serving, read by
its one `render_chat_request` call."""


def _cached_tokens_into_first_chunk(item: str, cached: int | None) -> str:
    """vLLM's first streamed chat chunk with ``cached`` tokens in its usage."""
    if cached is None or not item.startswith("data:"):
        return item
    chunk = json.loads(item[5:])
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return item
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return f"data: {json.dumps(chunk)}\n\n"


@InstallOnce
def install_cache_control() -> None:
    """Wrap the Messages API handler's `create_messages`, `render_chat_request` and stream
    generator, acting only for models served by hybrid-prefix."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    ours = set(ARCHITECTURES.values())
    original_create = AnthropicServingMessages.create_messages
    original_render = AnthropicServingMessages.render_chat_request
    original_stream = AnthropicServingMessages.chat_completion_stream_generator

    async def create_messages(self: Any, request: Any, raw_request: Any = None) -> Any:
        if raw_request is None or self.model_config.architecture not in ours:
            return await original_create(self, request, raw_request)
        try:
            marks = find_marks(await raw_request.json())
            cuts = [AnthropicMessagesRequest.model_validate(mark.cut) for mark in marks]
        except CacheControlError as error:
            return self.create_error_response(str(error), err_type="invalid_request_error")
        if not cuts:
            return await original_create(self, request, raw_request)
        token = _PENDING.set(cuts)
        try:
            return await original_create(self, request, raw_request)
        finally:
            _PENDING.reset(token)

    async def render_chat_request(self: Any, request: Any) -> Any:
        result = await original_render(self, request)
        cuts = _PENDING.get()
        if not cuts or not isinstance(result, tuple):
            return result
        _PENDING.set(None)
        _, (engine_input,) = result
        prompt = self._extract_prompt_components(engine_input).token_ids
        positions = []
        for cut in cuts:
            chat = self.to_chat_completion_request(
                cut, merge_inline_system=self._merge_inline_system
            )
            chat.add_generation_prompt = False
            chat.reasoning_effort = request.reasoning_effort  # as probed for thinking disabled
            rendered = await self.online_renderer.render_chat(chat)
            if isinstance(rendered, tuple):
                _, (cut_input,) = rendered
                ids = self._extract_prompt_components(cut_input).token_ids
                positions.append(common_prefix(prompt, ids))
        request.vllm_xargs = merged_breakpoints(request.vllm_xargs, positions)
        return result

    async def stream_generator(
        self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> AsyncGenerator[str, None]:
        if not self.enable_prompt_tokens_details or self.model_config.architecture not in ours:
            async for item in original_stream(self, request, result_generator, *args, **kwargs):
                yield item
            return
        cached: list[int] = []

        async def outputs() -> AsyncIterator[Any]:
            async for output in result_generator:
                if not cached and output.num_cached_tokens is not None:
                    cached.append(output.num_cached_tokens)
                yield output

        first = True
        async for item in original_stream(self, request, outputs(), *args, **kwargs):
            if first:
                item = _cached_tokens_into_first_chunk(item, cached[0] if cached else None)
                first = False
            yield item

    AnthropicServingMessages.create_messages = create_messages
    AnthropicServingMessages.render_chat_request = render_chat_request
    if not anthropic_stream_reports_cached_tokens():
        AnthropicServingMessages.chat_completion_stream_generator = stream_generator
