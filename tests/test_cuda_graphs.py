"""hybrid-prefix under vLLM's default configuration on CUDA: torch.compile and CUDA graphs
(CUDA only; CPU runs `tests/test_compiled.py`).

Every `cudagraph_mode` a user can choose must start (vLLM's V2 warm-up runs made-up requests
through the GDN layers) and serve exactly. Under FULL_AND_PIECEWISE the resume paths are checked
one by one against a cold run (a tap with a tail, an endpoint, a deep edit, a host-only restore,
sessions resumed together), and then one batch sequence mixes
decodes, resumed prefills, host restores (one of them a one-token resume, which vLLM replays as
a FULL decode graph, where no layer wait runs) and aborts; every answer is checked against a
cold run. The GDN prefill kernels were tuned on whole prompts before vLLM's warm-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    assert_same_up_to_near_tie,
    cache_of,
    cold_reference,
    greedy,
    greedy_params,
    pages_with_states,
    random_prompt,
    resume_from_a_tap_an_endpoint_and_the_host,
    running_llm,
    settle_and_audit,
    tokens,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEFAULTS = {"enforce_eager": False, "max_model_len": 4096}
HOSTED = {
    "kv_cache_manager": "hybrid-prefix",
    "host_cache_mib": 64,
    "device_snapshot_slots": 3,
    "cache_taps_per_request": 4,
}
ANSWER = 24


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(**DEFAULTS) as llm:
        yield llm


@pytest.fixture(scope="module")
def graphs(tiny_model_dir: Any) -> Iterator[Any]:
    """FULL_AND_PIECEWISE (vLLM's default), a device pool small enough to push work to the host."""
    with running_llm(
        in_process=True,
        additional_config=HOSTED,
        num_gpu_blocks_override=pages_with_states(80, snapshot_rows=3),
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        **DEFAULTS,
    ) as llm:
        mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
        assert mode.name == "FULL_AND_PIECEWISE"
        yield llm


@pytest.mark.parametrize(
    ("mode", "runner"),
    [
        ("NONE", "V2"),
        ("PIECEWISE", "V2"),
        ("FULL", "V2"),
        ("FULL_DECODE_ONLY", "V2"),
        ("FULL_AND_PIECEWISE", "V1"),
    ],
)
def test_every_cudagraph_mode_starts_and_resumes_exactly(
    mode: str, runner: str, cold: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On vLLM's V2 model runner (what CUDA uses) and on the V1 runner (what vLLM 0.32 falls back
    to where V2 lacks a feature; selected here with VLLM_USE_V2_MODEL_RUNNER=0). The first turn
    decodes three requests together: a FULL graph runs them padded to its captured size 4.
    vLLM 0.34 removed the V1 runner (and refuses VLLM_USE_V2_MODEL_RUNNER=0); there the graphs
    fixture's tests run FULL_AND_PIECEWISE on V2."""
    from vllm_hpc.glue.versions import has_v1_model_runner

    if runner == "V1" and not has_v1_model_runner():
        pytest.skip("this vLLM has no V1 model runner (0.34 removed it)")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "V2" else "0")
    config = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 0}
    with running_llm(
        additional_config=config, compilation_config={"cudagraph_mode": mode}, **DEFAULTS
    ) as llm:
        prompts = [random_prompt(seed=1 + k, length=1300 - 100 * k) for k in range(3)]
        firsts = greedy(llm, prompts, ANSWER)
        turn = prompts[0] + tokens(firsts[0]) + random_prompt(seed=9, length=65)
        second = greedy(llm, [turn], ANSWER)[0]
        print(f"{mode} {runner}: second turn cached {second.num_cached_tokens}")
        assert second.num_cached_tokens >= 1024
        for out, asked in (*zip(firsts, prompts, strict=True), (second, turn)):
            assert_same_up_to_near_tie(out, cold, asked, ANSWER)


def _tuned_shapes(worker: Any) -> list[tuple[Any, ...]]:
    from vllm_hpc.glue.worker.kernel_tuning import tuned_shapes

    return sorted(tuned_shapes, key=str)


def test_the_gdn_prefill_kernels_are_tuned_on_whole_prompts(graphs: Any) -> None:
    """vLLM's warm-up tunes FLA's kernels on one 64-token chunk; the plugin's GDN layers tune
    them on a few 1,024-token prompts first, once for the model's one GDN shape."""
    model = graphs.llm_engine.vllm_config.model_config
    text = model.hf_text_config
    assert graphs.collective_rpc(_tuned_shapes)[0] == [
        (
            text.linear_num_key_heads,
            text.linear_num_value_heads,
            text.linear_key_head_dim,
            text.linear_value_head_dim,
            model.dtype,
        )
    ]


def test_resume_paths_under_full_and_piecewise_match_cold_runs(graphs: Any, cold: Any) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(graphs, cold, seed=100)


def test_a_client_breakpoint_inside_a_block_under_graphs(graphs: Any, cold: Any) -> None:
    """The breakpoint becomes a Boundary snapshot with a 24-token tail page."""
    first = random_prompt(seed=200, length=1000)
    out = greedy(graphs, [first], ANSWER, breakpoints=[600])[0]
    assert_same_up_to_near_tie(out, cold, first, ANSWER)
    edited = first[:700] + random_prompt(seed=201, length=300)
    resumed = greedy(graphs, [edited], ANSWER)[0]
    assert resumed.num_cached_tokens == 600
    assert_same_up_to_near_tie(resumed, cold, edited, ANSWER)
    settle_and_audit(graphs)


def test_a_deep_edit_under_graphs(graphs: Any, cold: Any) -> None:
    """An edit at 1500 of a 3000-token prompt resumes from a ladder tap below it."""
    prompt = random_prompt(seed=210, length=3000)
    out = greedy(graphs, [prompt], ANSWER)[0]
    assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
    edited = prompt[:1500] + random_prompt(seed=211, length=300)
    resumed = greedy(graphs, [edited], ANSWER)[0]
    print("deep edit: cached", resumed.num_cached_tokens)
    assert 512 <= resumed.num_cached_tokens <= 1500
    assert_same_up_to_near_tie(resumed, cold, edited, ANSWER)
    settle_and_audit(graphs)


def test_sessions_resumed_together_under_graphs(graphs: Any, cold: Any) -> None:
    """Four conversations' next turns arrive together: each resumes from its own endpoint and
    they prefill and decode in the same batches (FULL decode graphs once all are decoding)."""
    answer = 96  # 64+ tokens past the prompt-tail tap: the endpoint is kept
    firsts = [random_prompt(seed=220 + k, length=500 + 40 * k) for k in range(4)]
    outs = [greedy(graphs, [p], answer)[0] for p in firsts]
    turns = [
        p + tokens(o) + random_prompt(seed=230 + k, length=90)
        for k, (p, o) in enumerate(zip(firsts, outs, strict=True))
    ]
    resumed = greedy(graphs, turns, answer)
    for first, turn, out in zip(firsts, turns, resumed, strict=True):
        assert out.num_cached_tokens == len(first) + answer - 1
        assert_same_up_to_near_tie(out, cold, turn, answer)
    settle_and_audit(graphs)


def _finished(outputs: list[Any]) -> dict[str, Any]:
    return {out.request_id: out for out in outputs if out.finished}


def test_mixed_batches_under_full_and_piecewise_match_cold_runs(graphs: Any, cold: Any) -> None:
    cache = cache_of(graphs)
    # Histories that later requests resume: one pushed to the host, two kept on the device.
    host_prompt = random_prompt(seed=10, length=64 * 20 + 1)  # a retry resumes at n - 1
    kept = [random_prompt(seed=11 + k, length=900) for k in range(2)]
    answers = {tuple(p): tokens(greedy(graphs, [p], ANSWER)[0]) for p in [host_prompt, *kept]}
    for seed in range(30, 34):  # other traffic pushes the first history off the device
        greedy(graphs, [random_prompt(seed=seed, length=1500)], 4)
    decoding = [random_prompt(seed=50 + k, length=100) for k in range(3)]
    retry = list(host_prompt)  # restored from the host with one prompt token left: beside the
    # decodes only, vLLM replays that step as a FULL decode graph
    turns = [
        p + answers[tuple(p)] + random_prompt(seed=40 + k, length=200) for k, p in enumerate(kept)
    ]
    doomed = [random_prompt(seed=60 + k, length=700) for k in range(2)]
    prompts = [*decoding, retry, *turns, *doomed]
    before = cache.admissions.hit_tokens_host
    engine = graphs.llm_engine
    waves = [[0, 1, 2], [3], [4, 5, 6, 7]]
    finished: dict[str, Any] = {}
    for k, wave in enumerate(waves):
        for i in wave:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy_params(ANSWER))
        for _ in range(2 if k == 0 else 1):
            finished.update(_finished(engine.step()))
    engine.abort_request(["6", "7"])  # mid-prefill
    while engine.has_unfinished_requests():
        finished.update(_finished(engine.step()))
    assert cache.admissions.hit_tokens_host > before  # the retry came back from the host
    print("mixed: cached", {k: v.num_cached_tokens for k, v in sorted(finished.items())})
    assert finished["3"].num_cached_tokens >= 1024
    for i, prompt in enumerate(prompts[:6]):
        assert_same_up_to_near_tie(finished[str(i)], cold, prompt, ANSWER)
    settle_and_audit(graphs)
