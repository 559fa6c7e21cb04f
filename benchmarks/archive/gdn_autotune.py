"""The GDN output kernel's autotuned configurations at the warm-up's length and a step's, GPU only.

vLLM autotunes FLA's `chunk_fwd_kernel_o` once per process, on its 64-token warm-up call
(`_warmup_prefill_kernels`), keyed on heads and head dims only: whichever configuration times
best on one chunk is kept for 16,000-token prefill steps. The burst's prefill profiles found the
kernel at 62-100 ms over three steps on the same shapes, changing from one engine start to the
next. This times every configuration on the model's GDN shapes at the warm-up's 64 tokens and at
a saturated step's chunks, then lets the autotuner pick several times at the warm-up's length, as an
engine start does, and at longer ones, and prints what each pick costs at the step's length.

    python3 benchmarks/archive/gdn_autotune.py --model .gpu/model27b --tokens 16320 \\
      --tune-at 64,1024,4096
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def main() -> None:
    import torch
    from triton.testing import do_bench
    from vllm.third_party.flash_linear_attention.ops.chunk_o import chunk_fwd_kernel_o, chunk_fwd_o
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a directory with config.json")
    ap.add_argument("--tokens", type=int, default=16320, help="a saturated step's prefill rows")
    ap.add_argument("--prompt", type=int, default=1024, help="tokens of each prompt in the step")
    ap.add_argument("--picks", type=int, default=4, help="autotuner picks at each length")
    ap.add_argument("--tune-at", default="64,1024,4096", help="lengths the autotuner picks at")
    args = ap.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    config = config.get("text_config", config)
    hg, h = config["linear_num_key_heads"], config["linear_num_value_heads"]
    k_dim, v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]

    def inputs(tokens: int) -> dict:
        lengths = [args.prompt] * (tokens // args.prompt) + [tokens % args.prompt]
        bounds = [0]
        for n in (n for n in lengths if n):
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
        chunks = prepare_chunk_indices(cu, FLA_CHUNK_SIZE)
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        return dict(
            q=torch.randn(1, tokens, hg, k_dim, **bf16),
            k=torch.randn(1, tokens, hg, k_dim, **bf16),
            v=torch.randn(1, tokens, h, v_dim, **bf16),
            h=torch.randn(1, len(chunks), h, k_dim, v_dim, **bf16),
            g=-torch.rand(1, tokens, h, device="cuda", dtype=torch.float32).cumsum(1) * 0.01,
            cu_seqlens=cu,
            chunk_indices=chunks,
        )

    def run(x: dict, cfg: Any) -> None:
        if cfg is None:
            chunk_fwd_o(**x)
            return
        nt = len(x["chunk_indices"])
        grid = (-(-v_dim // cfg.kwargs["BV"]), nt, h)
        o = torch.empty_like(x["v"])
        tuner.fn[grid](
            x["q"],
            x["k"],
            x["v"],
            x["h"],
            x["g"],
            o,
            x["cu_seqlens"],
            x["chunk_indices"],
            k_dim**-0.5,
            T=x["q"].shape[1],
            H=h,
            Hg=hg,
            K=k_dim,
            V=v_dim,
            BT=FLA_CHUNK_SIZE,
            USE_G=True,
            IS_VARLEN=True,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **cfg.kwargs,
        )

    tuner = chunk_fwd_kernel_o  # heuristics outside, then the autotuner, then the kernel
    while not hasattr(tuner, "configs"):
        tuner = tuner.fn
    # vLLM's warm-up is one chunk long.
    small, large = inputs(FLA_CHUNK_SIZE), inputs(args.tokens)
    name = {}
    print(f"| configuration | {FLA_CHUNK_SIZE} tokens (us) | {args.tokens} tokens (ms) |")
    print("|---|---|---|")
    cost = {}
    for cfg in tuner.configs:
        label = f"BK {cfg.kwargs['BK']} BV {cfg.kwargs['BV']} w{cfg.num_warps} s{cfg.num_stages}"
        name[str(cfg)] = label
        try:
            t_small = do_bench(lambda c=cfg: run(small, c), warmup=25, rep=100) * 1e3
            t_large = do_bench(lambda c=cfg: run(large, c), warmup=25, rep=200)
        except Exception as error:  # a configuration out of shared memory
            print(f"| {label} | failed: {type(error).__name__} | |")
            continue
        cost[str(cfg)] = t_large
        print(f"| {label} | {t_small:.1f} | {t_large:.3f} |")
    print()
    print("| autotuned at (tokens) | pick | its cost at the step's length (ms) | fastest there |")
    print("|---|---|---|---|")
    best = min(cost.values())
    for length in (int(n) for n in args.tune_at.split(",")):
        x = inputs(length)
        for _ in range(args.picks):
            tuner.cache.clear()
            run(x, None)
            torch.cuda.synchronize()
            picked = str(tuner.best_config)
            label = name.get(picked, picked)
            print(f"| {length} | {label} | {cost.get(picked, float('nan')):.3f} | {best:.3f} |")


if __name__ == "__main__":
    main()
