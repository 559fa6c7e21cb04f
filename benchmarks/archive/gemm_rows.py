"""A prefill step's linear layers at the row counts the two schedulers pick, GPU only.

Under a burst of cold prompts hybrid-prefix fills each step to `max_num_batched_tokens`
(16,384 rows), while vLLM's align mode cuts chunks at its 400-token blocks (about 16,200
rows). cuBLAS picks a GEMM kernel by shape, so the cost of a row can differ between the two
counts. This times the model's projections at each row count (bf16 `F.linear` with [N, K]
weights, as vLLM's unquantized layers call it: cuBLAS picks by the layout too) and prints the
step's GEMM time and its cost per row, the layers weighted by how many the model has.

    python3 benchmarks/archive/gemm_rows.py --model .gpu/model27b --rows 16208,16305,16336,16384
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def projections(config: dict) -> list[tuple[str, int, int, int]]:
    """(name, layers, K, N) of every linear layer of one decoder stack."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    types = config["layer_types"]
    gdn, full = types.count("linear_attention"), types.count("full_attention")
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["head_dim"]
    return [
        ("mlp gate_up", gdn + full, hidden, 2 * inter),
        ("mlp down", gdn + full, inter, hidden),
        ("gdn in_proj qkvz", gdn, hidden, 2 * key + 2 * value),
        ("gdn out_proj", gdn, value, hidden),
        ("attn qkv+gate", full, hidden, 2 * heads * dim + 2 * kv * dim),
        ("attn o_proj", full, heads * dim, hidden),
    ]


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a directory with config.json")
    ap.add_argument("--rows", default="16208,16305,16336,16384")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    config = config.get("text_config", config)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"| layer | {' | '.join(f'{m} rows (ms)' for m in rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    totals = dict.fromkeys(rows, 0.0)
    for name, layers, k, n in projections(config):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # [out, in], as vLLM
        cells = []
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.nn.functional.linear(x, weight)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                torch.nn.functional.linear(x, weight)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.repeats
            totals[m] += ms * layers
            cells.append(f"{ms:.3f}")
        print(f"| {name} (x{layers}) | {' | '.join(cells)} |")
    print(f"| step's GEMMs (ms) | {' | '.join(f'{totals[m]:.1f}' for m in rows)} |")
    print(f"| per row (us) | {' | '.join(f'{1e3 * totals[m] / m:.2f}' for m in rows)} |")


if __name__ == "__main__":
    main()
