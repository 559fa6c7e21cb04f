"""Does a model's greedy answer depend on how vLLM chunks the prefill, with no cache at all?

On the H200 `tests/test_quantized.py[awq-moe]` parted from its cold reference in its first
request, before anything was cached (token 19, cold margin 1.0): the test engine prefills in
512-token chunks, the reference in one. This runs the test's prompt (seed 400, 1,500 tokens,
96 greedy tokens) four ways, each engine in a process of its own, all at once: vLLM with prefix
caching off and hybrid-prefix (the test's small pool), each with 512-token chunks and in one
chunk. Each answer is compared with vLLM's in one chunk (the test's reference): where it parts,
and the reference's top-1 margin there. A parting of vLLM's own 512-token run says the cache is
not the cause. Writes chunked_prefill_parting_<variant>.md and .json.

    python3 benchmarks/archive/chunked_prefill_parting.py --variant awq-moe --out DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

PROMPT_SEED, PROMPT_TOKENS, ANSWER = 400, 1500, 96
RUNS = {
    "native, one chunk": ("native", 2048),
    "native, 512-token chunks": ("native", 512),
    "hybrid-prefix, one chunk": ("hybrid-prefix", 2048),
    "hybrid-prefix, 512-token chunks": ("hybrid-prefix", 512),
}
REFERENCE = "native, one chunk"


def one_run(variant: str, manager: str, chunk: int, out: Path) -> None:
    """One engine, one request: its tokens and top-2 logprobs, as JSON in ``out``."""
    from engine_support import (
        RESUME_PATHS,
        greedy_params,
        quantized_model,
        random_prompt,
        running_llm,
    )

    engine: dict[str, Any] = {"max_model_len": 2048, "max_num_batched_tokens": chunk}
    if manager == "native":
        engine["enable_prefix_caching"] = False
    else:
        engine["additional_config"] = RESUME_PATHS
    prompt = random_prompt(seed=PROMPT_SEED, length=PROMPT_TOKENS)
    with running_llm(model=quantized_model(variant), **engine) as llm:
        params = greedy_params(ANSWER, logprobs=2)
        answer = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    result = answer.outputs[0]
    logprobs = [{str(t): e.logprob for t, e in step.items()} for step in result.logprobs]
    out.write_text(json.dumps({"tokens": list(result.token_ids), "logprobs": logprobs}))


def parting_row(name: str, run: dict[str, Any], reference: dict[str, Any]) -> str:
    from vllm_hpc.exactness import first_parting

    margins = []
    for step in reference["logprobs"]:
        best = sorted(step.values(), reverse=True)
        margins.append(best[0] - best[1])
    parting = first_parting(run["tokens"], reference["tokens"], margins)
    return f"| {name} | {'same' if parting is None else parting.describe()} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="awq-moe", help="e.g. awq-moe, gptq, fp8-moe")
    ap.add_argument("--out", type=Path, required=True, help="directory for the report")
    ap.add_argument("--one", nargs=3, metavar=("MANAGER", "CHUNK", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        one_run(args.variant, args.one[0], int(args.one[1]), Path(args.one[2]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    children = {}
    for name, (manager, chunk) in RUNS.items():
        path = args.out / f"run_{manager}_{chunk}.json"
        command = [sys.executable, __file__, "--variant", args.variant, "--out", str(args.out)]
        log = (args.out / f"run_{manager}_{chunk}.log").open("w")
        children[name] = (
            path,
            subprocess.Popen(
                [*command, "--one", manager, str(chunk), str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
        )
    failed = [name for name, (_, child) in children.items() if child.wait() != 0]
    if failed:
        print(f"failed: {failed}; see the run_*.log files in {args.out}", file=sys.stderr)
        return 1
    runs = {name: json.loads(path.read_text()) for name, (path, _) in children.items()}
    rows = [parting_row(name, run, runs[REFERENCE]) for name, run in runs.items()]
    report = [
        f"# Prefill chunking and the greedy answer: {args.variant}",
        "",
        "Command: `python3 benchmarks/archive/chunked_prefill_parting.py "
        f"--variant {args.variant}`, "
        f"{time.monotonic() - t0:.0f} s. Prompt: seed {PROMPT_SEED}, {PROMPT_TOKENS} tokens, "
        f"{ANSWER} greedy tokens; eager; no request cached anything.",
        "",
        f"| run | against {REFERENCE} |",
        "|---|---|",
        *rows,
    ]
    (args.out / f"chunked_prefill_parting_{args.variant}.md").write_text("\n".join(report) + "\n")
    (args.out / f"chunked_prefill_parting_{args.variant}.json").write_text(json.dumps(runs))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
