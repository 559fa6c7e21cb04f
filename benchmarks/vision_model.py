"""A vision-language model directory for dummy weights: a text config (e.g. the 27B shape of
`../shared/gpu/models/qwen3_5-27b-shape`) inside `Qwen3_5ForConditionalGeneration`, with the
vision tower, the float32 recurrent state and the one MTP layer of the published Qwen3.5
checkpoints and the tiny vision-language model's processor and byte-level tokenizer (built
locally, no downloads).
`vision_chat.py` runs on it.

    python benchmarks/vision_model.py --text-config .gpu/model27b/config.json --out .gpu/model27b-vl
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vllm_hpc.tiny_model import VISION_RECIPE, tiny_model_path

VISION = {
    "model_type": "qwen3_5_vision",
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
}
"""The published checkpoints' vision tower; `out_hidden_size` is the text model's width."""
PROCESSOR_FILES = ("processor_config.json", "tokenizer.json", "tokenizer_config.json")


def build(text_config: Path, out: Path, state_dtype: str = "float32") -> None:
    text = json.loads(text_config.read_text())
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_text"
    rotary = int(text["head_dim"] * text.get("partial_rotary_factor", 1.0)) // 2
    sections = [rotary // 3 + (i < rotary % 3) for i in range(3)]  # 27B: [11, 11, 10]
    text["rope_parameters"] = {
        **text.get("rope_parameters", {}),
        "mrope_section": sections,
        "mrope_interleaved": True,
    }
    text["mamba_ssm_dtype"] = state_dtype  # the published configs ask float32
    text.setdefault("mtp_num_hidden_layers", 1)  # as published; used only with MTP speculation
    tiny = tiny_model_path(VISION_RECIPE)
    ids = json.loads((tiny / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {**VISION, "out_hidden_size": text["hidden_size"]},
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        **{k: ids[k] for k in ids if k.endswith("_token_id")},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in (*PROCESSOR_FILES, "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--state-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the recurrent state's dtype (mamba_ssm_dtype): the published float32, or bfloat16 "
        "to compare against (#48)",
    )
    args = parser.parse_args()
    build(args.text_config, args.out, args.state_dtype)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
