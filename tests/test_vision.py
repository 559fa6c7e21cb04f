"""The vision-language class every published Qwen3.5 checkpoint declares, on the real engine.

`VISION_RECIPE` is the tiny model inside `Qwen3_5ForConditionalGeneration`, with a one-block
vision tower and Qwen3-VL's processor. Its tokenizer is byte-level (one token a character), so
the prompts here are text: letters, and an image span where an image goes. Each answer is
compared with a cold run of the same class (no prefix caching), and the cache is audited after
each scenario. What the cache must do with an image (`vllm_hpc.glue.scheduler.cache_key`,
`vllm_hpc.index.prompt.resume_floor`): key every block the image touches by vLLM's hash of it,
never resume inside it or with it in a snapshot's tail, and resume past it without running the
vision encoder for it again.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import cache_of, running_llm
from PIL import Image
from server_support import model_id, post, running_server

from vllm_hpc.exactness import first_parting, top1_margins
from vllm_hpc.tiny_model import VISION_RECIPE, tiny_model_path

pytestmark = pytest.mark.engine

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TILE_PIXELS = 32
"""One placeholder token per 32x32 pixels (16-pixel patches merged 2x2)."""
ANSWER = 16
ENGINE = {
    "skip_tokenizer_init": False,  # images need the processor, and it the tokenizer
    "max_model_len": 4096,
    "limit_mm_per_prompt": {"image": 2, "video": 1},
}
HYBRID = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 0}


@pytest.fixture(scope="module")
def vision_model() -> str:
    return str(tiny_model_path(VISION_RECIPE))


@pytest.fixture(scope="module")
def llm(vision_model: str) -> Iterator[Any]:
    with running_llm(
        in_process=True, model=vision_model, additional_config=HYBRID, **ENGINE
    ) as engine:
        assert engine.llm_engine.vllm_config.model_config.uses_mrope  # as the checkpoints do
        engine.apply_model(_count_encoder_runs)
        yield engine


@pytest.fixture(scope="module")
def cold(vision_model: str) -> Iterator[Any]:
    with running_llm(model=vision_model, enable_prefix_caching=False, **ENGINE) as engine:
        yield engine


def _count_encoder_runs(model: Any) -> None:
    """Count the vision encoder's runs in the worker (the model's own method, wrapped)."""
    encode = model.embed_multimodal
    model.hpc_encoder_runs = 0

    def counted(**kwargs: Any) -> Any:
        model.hpc_encoder_runs += 1
        return encode(**kwargs)

    model.embed_multimodal = counted


def encoder_runs(llm: Any) -> int:
    return sum(llm.apply_model(lambda model: model.hpc_encoder_runs))


def image(seed: int, tiles: tuple[int, int] = (3, 4)) -> Image.Image:
    """A random RGB image of whole tiles: rows x columns placeholder tokens."""
    rng = random.Random(seed)
    height, width = tiles[0] * TILE_PIXELS, tiles[1] * TILE_PIXELS
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def text(seed: int, length: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))


def generate(
    llm: Any,
    prompt: str,
    images: list[Image.Image],
    logprobs: int | None = None,
    breakpoints: list[int] | None = None,
    video: Any = None,
) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=ANSWER,
        temperature=0.0,
        ignore_eos=True,
        logprobs=logprobs,
        extra_args={"cache_breakpoints": breakpoints} if breakpoints else None,
    )
    request: dict[str, Any] = {"prompt": prompt}
    media: dict[str, Any] = {}
    if images:
        media["image"] = images if len(images) > 1 else images[0]
    if video is not None:
        media["video"] = video
    if media:
        request["multi_modal_data"] = media
    return llm.generate([request], params, use_tqdm=False)[0]


def clip(seed: int, frames: int = 4) -> tuple[Any, dict[str, Any]]:
    """A random 64x64 video and the metadata vLLM's video processing asks for."""
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 255, (frames, 64, 64, 3), dtype=np.uint8)
    metadata = {
        "total_num_frames": frames,
        "fps": 2.0,
        "duration": frames / 2.0,
        "frames_indices": list(range(frames)),
        "video_backend": "opencv",
    }
    return pixels, metadata


def assert_like_cold(
    out: Any, cold: Any, prompt: str, images: list[Image.Image], video: Any = None
) -> None:
    ref = generate(cold, prompt, images, logprobs=2, video=video)
    assert ref.prompt_token_ids == out.prompt_token_ids
    parting = first_parting(
        out.outputs[0].token_ids, ref.outputs[0].token_ids, top1_margins(ref.outputs[0].logprobs)
    )
    assert parting is None or parting.near_tie, parting.describe()


def token_id(name: str) -> int:
    """A vision token's id, as the model's config gives it to vLLM."""
    config = json.loads((tiny_model_path(VISION_RECIPE) / "config.json").read_text())
    return int(config[name])


def image_span(out: Any) -> tuple[int, int]:
    """[begin, end) of the (first) image's placeholder tokens in the prompt."""
    ids = out.prompt_token_ids
    pad = token_id("image_token_id")
    begin = ids.index(pad)
    end = begin
    while end < len(ids) and ids[end] == pad:
        end += 1
    return begin, end


def audit(llm: Any) -> None:
    generate(llm, text(999, 80), [])  # lands the last step's copies
    cache_of(llm).audit()


def test_text_prompts_are_served_as_by_the_text_class(llm: Any, cold: Any) -> None:
    prompt = text(1, 900)
    first = generate(llm, prompt, [])
    assert first.num_cached_tokens == 0
    longer = prompt + text(2, 80)
    second = generate(llm, longer, [])
    assert second.num_cached_tokens == 896  # the prompt-tail tap of the first
    for out, asked in ((first, prompt), (second, longer)):
        assert_like_cold(out, cold, asked, [])
    audit(llm)


def test_the_same_image_resumes_past_it_without_the_encoder(llm: Any, cold: Any) -> None:
    prompt = text(10, 100) + IMAGE + text(11, 700)
    picture = image(10)
    runs = encoder_runs(llm)
    first = generate(llm, prompt, [picture])
    assert encoder_runs(llm) == runs + 1
    again = generate(llm, prompt, [picture])
    _, end = image_span(again)
    assert again.num_cached_tokens > end
    assert encoder_runs(llm) == runs + 1, "the vision encoder ran again for a cached image"
    for out in (first, again):
        assert_like_cold(out, cold, prompt, [picture])
    audit(llm)


def test_another_image_with_the_same_placeholders_misses(llm: Any, cold: Any) -> None:
    prompt = text(20, 200) + IMAGE + text(21, 600)
    generate(llm, prompt, [image(20)])
    other = generate(llm, prompt, [image(21)])  # same size: identical prompt token ids
    begin, _ = image_span(other)
    assert other.num_cached_tokens <= begin
    assert_like_cold(other, cold, prompt, [image(21)])
    audit(llm)


def test_an_edit_after_an_image_resumes_between_them(llm: Any, cold: Any) -> None:
    """Breakpoints inside the image (moved to its start) and between it and the edit."""
    head = text(30, 150) + IMAGE + text(31, 500)
    picture = image(30, tiles=(5, 6))
    first = generate(llm, head + text(32, 400), [picture], breakpoints=[160, 400])
    begin, end = image_span(first)
    assert (begin, end) == (151, 181)  # 150 letters and <|vision_start|>, then 30 tiles
    edited = head + text(33, 400)
    out = generate(llm, edited, [picture])
    assert out.num_cached_tokens == 400
    assert_like_cold(out, cold, edited, [picture])
    other = generate(llm, edited, [image(31, tiles=(5, 6))])
    assert other.num_cached_tokens == begin  # the breakpoint at 160, moved to the image start
    assert_like_cold(other, cold, edited, [image(31, tiles=(5, 6))])
    audit(llm)


def test_two_images_and_a_repeat_of_the_second(llm: Any, cold: Any) -> None:
    first, second = image(40, tiles=(2, 2)), image(41, tiles=(4, 2))
    prompt = text(40, 90) + IMAGE + text(41, 300) + IMAGE + text(42, 300)
    out = generate(llm, prompt, [first, second])
    swapped = generate(llm, prompt, [second, first])  # same text, images in the other order
    assert swapped.num_cached_tokens <= image_span(swapped)[0]
    again = generate(llm, prompt, [first, second])
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 64
    for result, images in ((out, [first, second]), (swapped, [second, first])):
        assert_like_cold(result, cold, prompt, images)
    assert_like_cold(again, cold, prompt, [first, second])
    audit(llm)


def test_a_video_is_keyed_as_an_image_is(llm: Any, cold: Any) -> None:
    prompt = text(70, 150) + VIDEO + text(71, 500)
    first = generate(llm, prompt, [], video=clip(70))
    again = generate(llm, prompt, [], video=clip(70))
    pad = token_id("video_token_id")
    end = len(again.prompt_token_ids) - again.prompt_token_ids[::-1].index(pad)
    assert again.num_cached_tokens >= end
    other = generate(llm, prompt, [], video=clip(71))
    assert other.num_cached_tokens <= again.prompt_token_ids.index(pad)
    for out, video in ((first, clip(70)), (again, clip(70)), (other, clip(71))):
        assert_like_cold(out, cold, prompt, [], video)
    audit(llm)


def test_language_model_only_serves_text(vision_model: str) -> None:
    """`--language-model-only`: vLLM leaves the vision tower unloaded; text is cached as ever."""
    engine = {**ENGINE, "language_model_only": True}
    with running_llm(model=vision_model, additional_config=HYBRID, **engine) as llm:
        prompt = text(50, 700)
        generate(llm, prompt, [])
        assert generate(llm, prompt + text(51, 60), []).num_cached_tokens >= 640


def _data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(base: str, words: str, url: str, cold_salt: str | None = None) -> tuple[int, Any]:
    body: dict[str, Any] = {
        "model": model_id(base),
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": words[:120]},
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": words[120:]},
                ],
            }
        ],
        "max_tokens": ANSWER,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if cold_salt is not None:
        body.update(cache_salt=cold_salt, logprobs=True, top_logprobs=2)
    return post(base, body, "chat/completions")


def _cached(body: Any) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_image_urls_over_the_openai_chat_api(
    vision_model: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Data URLs through vLLM's own media loading; a corrupt image is vLLM's 4xx and leaves the
    cache as it was. The server audits the cache at every engine step."""
    log = tmp_path_factory.mktemp("vision-server") / "server.log"
    limits = '{"image": 2, "video": 0}'
    options = ("--limit-mm-per-prompt", limits, "--gpu-memory-utilization", "0.2")
    with running_server(Path(vision_model), log, *options) as (base, _):
        words = text(60, 700)
        picture = _data_url(image(60, tiles=(4, 4)))
        status, first = _chat(base, words, picture)
        assert status == 200, first
        status, again = _chat(base, words, picture)
        assert status == 200, again
        assert _cached(again) > 140, "the second request did not resume past the image"
        status, other = _chat(base, words, _data_url(image(61, tiles=(4, 4))))
        assert status == 200, other
        assert _cached(other) <= 128  # the image starts after 120 letters and the template
        broken = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
        status, body = _chat(base, words, broken)
        assert 400 <= status < 500, body
        status, after = _chat(base, words, picture)
        assert status == 200 and _cached(after) == _cached(again), after
        status, cold = _chat(base, words, picture, cold_salt="cold")
        assert status == 200 and _cached(cold) == 0, cold
        margins = []
        for step in cold["choices"][0]["logprobs"]["content"]:
            best = sorted((t["logprob"] for t in step["top_logprobs"]), reverse=True)
            margins.append(best[0] - best[1])
        for body in (first, again, after):
            tokens = body["choices"][0]["token_ids"]
            parting = first_parting(tokens, cold["choices"][0]["token_ids"], margins)
            assert parting is None or parting.near_tie, parting.describe()
