"""The embedded default model: a tiny random-weight Qwen3.5, built locally, no downloads.

Tests, examples and the README's demo run on it. It has the real architecture
(`Qwen3_5ForCausalLM`: Gated DeltaNet layers plus a full-attention layer), so every cache path
runs vLLM's real kernels, and it is small enough that a CPU engine starts in seconds.

Why the output head is scaled: at the default initialisation scale the logits of a random
model are nearly flat (median top-1 margin 0.06 nat), so a change of kernel shape (another
prefill chunking) can flip greedy tokens. Scaled by 16 (a power of two, so greedy choices are
unchanged bit for bit), the median margin is 1 nat, enough that with one request in flight the
greedy tokens do not depend on the prefill chunking and a fresh engine repeats every run
(`docs/results.md`, "Reliability and exactness"). When several requests share engine steps, the
batch composition changes the kernels' shapes and a greedy token can flip at a near-tie;
exactness tests therefore run the requests they compare alone.

A word-level tokenizer with a ChatML chat template comes with it, so the chat path (and the tap
hints derived from the template's special tokens) can run too.

The model is built once per machine into a cache directory keyed by its recipe, and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

CACHE_ENV = "VLLM_HPC_CACHE_DIR"


@dataclass(frozen=True)
class TinyQwen35Recipe:
    """Everything that determines the built model's bytes; its hash names the directory."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    # Three Gated DeltaNet layers, then one full-attention layer (Qwen3.5's 3:1 pattern).
    layer_types: tuple[str, ...] = (
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    )
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    # vLLM's CPU GDN kernel accepts linear key/value head dims of 128 only.
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    max_position_embeddings: int = 32768
    # Mixture of experts (Qwen3.5-MoE) when num_experts > 0; dense (Qwen3.5) otherwise.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    seed: int = 0
    # Multiplier of the output head after the standard initialisation (module docstring).
    lm_head_scale: float = 16.0
    dtype: str = "bfloat16"
    # Recurrent state kept in float32 between steps, as the released Qwen3.5 checkpoints ask.
    mamba_ssm_dtype: str = "float32"
    # A vision tower of this many blocks makes it the vision-language class every published
    # Qwen3.5 checkpoint declares (`Qwen3_5ForConditionalGeneration`); 0: text-only.
    vision_depth: int = 0
    recipe_version: int = 3

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


DEFAULT_RECIPE = TinyQwen35Recipe()
MOE_RECIPE = TinyQwen35Recipe(num_experts=8)
"""The same, with its MLPs as mixtures of 8 experts (top 2) plus a shared expert."""
VISION_RECIPE = TinyQwen35Recipe(vision_depth=1)
"""The same text model inside the vision-language wrapper, with a one-block vision tower, an
image and video processor (16-pixel patches merged 2x2: one placeholder token per 32x32
pixels) and a chat template that renders image and video parts."""


def cache_root() -> Path:
    """Where built models live: $VLLM_HPC_CACHE_DIR, else ~/.cache/vllm_hpc."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vllm_hpc"


def tiny_model_path(recipe: TinyQwen35Recipe = DEFAULT_RECIPE) -> Path:
    """Return the directory of the built model, building it first if needed."""
    return _built(f"tiny-qwen3_5-{recipe.digest()}", "config.json", partial(_build, recipe))


def tiny_lora_path(seed: int, recipe: TinyQwen35Recipe = DEFAULT_RECIPE, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT format) for the tiny model, built once per seed.

    It adapts the full-attention layers' query and value projections and every layer's MLP, so
    it changes both the attention KV and the recurrent states that later layers compute.
    """
    digest = hashlib.sha256(f"{recipe.digest()}-{seed}-{rank}".encode()).hexdigest()[:12]
    build = partial(_build_lora, recipe, seed, rank)
    return _built(f"tiny-lora-{digest}", "adapter_config.json", build)


def _built(name: str, last_file: str, build: Callable[[Path], None]) -> Path:
    """The directory ``name`` under the cache root, built by ``build`` unless it holds
    ``last_file`` (written last) already.

    The build writes into a temporary directory and renames it into place, so concurrent
    callers (two test processes, a test and the demo) never see a half-written one.
    """
    target = cache_root() / "models" / name
    if (target / last_file).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / last_file).exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_lora(recipe: TinyQwen35Recipe, seed: int, rank: int, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    hidden, mlp = recipe.hidden_size, recipe.intermediate_size
    shapes = {
        "self_attn.q_proj": (2 * recipe.num_attention_heads * recipe.head_dim, hidden),
        "self_attn.v_proj": (recipe.num_key_value_heads * recipe.head_dim, hidden),
        "mlp.gate_proj": (mlp, hidden),
        "mlp.up_proj": (mlp, hidden),
        "mlp.down_proj": (hidden, mlp),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, kind in enumerate(recipe.layer_types):
        for module, (rows, cols) in shapes.items():
            if module.startswith("self_attn") and kind != "full_attention":
                continue
            name = f"base_model.model.model.layers.{layer}.{module}"
            for part, shape in (("lora_A", (rank, cols)), ("lora_B", (rows, rank))):
                weight = torch.randn(shape, generator=generator) * 0.05
                tensors[f"{name}.{part}.weight"] = weight.to(getattr(torch, recipe.dtype))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({m.split(".")[1] for m in shapes}),
        "base_model_name_or_path": str(tiny_model_path(recipe)),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))


def _build(recipe: TinyQwen35Recipe, out_dir: Path) -> None:
    import torch
    import transformers

    moe = recipe.num_experts > 0
    config_cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    moe_fields = (
        {
            "num_experts": recipe.num_experts,
            "num_experts_per_tok": recipe.num_experts_per_tok,
            "moe_intermediate_size": recipe.moe_intermediate_size,
            "shared_expert_intermediate_size": recipe.moe_intermediate_size,
        }
        if moe
        else {}
    )
    text = config_cls(
        **moe_fields,
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=len(recipe.layer_types),
        layer_types=list(recipe.layer_types),
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim,
        linear_num_key_heads=recipe.linear_num_key_heads,
        linear_num_value_heads=recipe.linear_num_value_heads,
        linear_key_head_dim=recipe.linear_key_head_dim,
        linear_value_head_dim=recipe.linear_value_head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        dtype=recipe.dtype,
        mamba_ssm_dtype=recipe.mamba_ssm_dtype,
    )
    config: Any = text
    if recipe.vision_depth:
        config, model_cls = _vision_language(recipe, text, moe)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(recipe.seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.lm_head.weight.mul_(recipe.lm_head_scale)
    model.to(getattr(torch, recipe.dtype)).save_pretrained(out_dir)
    if recipe.vision_depth:
        _write_processor(recipe.vocab_size, out_dir)
    else:
        _write_tokenizer(recipe.vocab_size, out_dir)
    (out_dir / "vllm_hpc_recipe.json").write_text(json.dumps(asdict(recipe), indent=1))


def _vision_language(recipe: TinyQwen35Recipe, text: Any, moe: bool) -> tuple[Any, Any]:
    """The vision-language config around ``text``, and its model class."""
    import transformers

    vision = transformers.Qwen3_5VisionConfig(
        depth=recipe.vision_depth,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=recipe.hidden_size,
        patch_size=PATCH_PIXELS,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        num_position_embeddings=256,
    )
    ids = {
        token: recipe.vocab_size - len(SPECIAL_TOKENS) - len(VISION_TOKENS) + i
        for i, token in enumerate(VISION_TOKENS)
    }
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_cls(
        text_config={**text.to_dict(), "rope_parameters": MROPE},
        vision_config=vision.to_dict(),
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=False,
    )
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    return config, model_cls


MROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [3, 3, 2],
    "mrope_interleaved": True,
}
"""Multimodal rotary positions (time, height, width) as the published checkpoints interleave
them, over the tiny model's 16 rotary dimensions: positions after an image depend on it."""
PATCH_PIXELS = 16
MERGE = 2
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The vision-language variant's extra special tokens, just before `SPECIAL_TOKENS`."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""ChatML as Qwen3.5 renders it, without tools and thinking."""
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""The same with image and video parts, each a vision span as Qwen3.5's template writes it."""


def _write_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A word-level tokenizer over the whole vocabulary, so the chat path runs on the tiny model.

    Qwen3.5's special tokens and role names are words of their own, a newline is one token, and
    the remaining ids are filler words ``w0``, ``w1``, ...; text splits at newlines and spaces.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "\n", *ROLES, "<think>", "</think>"]
    fillers = vocab_size - len(words) - len(SPECIAL_TOKENS)
    vocab = [*words, *(f"w{i}" for i in range(fillers)), *SPECIAL_TOKENS]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Split(" ", behavior="removed"),
        ]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "[UNK]",
        "model_max_length": 32768,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _write_processor(vocab_size: int, out_dir: Path) -> None:
    """Qwen3-VL's processor: images and videos resized to whole 32-pixel tiles (one placeholder
    token a tile, 4 to 64 an image), and a byte-level tokenizer.

    A checkpoint of the vision-language type loads its tokenizer as Qwen3.5's byte-level BPE
    whatever its tokenizer config names, so this one is that class with no merges: every byte
    of text is one token (ids 0-255), then unused ids, then the special tokens at the top.
    """
    import transformers
    from tokenizers import pre_tokenizers

    specials = [*VISION_TOKENS, *SPECIAL_TOKENS]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    unused = vocab_size - len(vocab) - len(specials)
    vocab.update({f"<|unused{i}|>": len(vocab) for i in range(unused)})
    vocab.update({token: vocab_size - len(specials) + i for i, token in enumerate(specials)})
    tokenizer = transformers.Qwen3_5Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    tile = PATCH_PIXELS * MERGE
    pixels = {"shortest_edge": 4 * tile * tile, "longest_edge": 64 * tile * tile}
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(
            patch_size=PATCH_PIXELS, merge_size=MERGE, temporal_patch_size=2, size=pixels
        ),
        tokenizer=tokenizer,
        video_processor=transformers.Qwen3VLVideoProcessor(
            patch_size=PATCH_PIXELS, merge_size=MERGE, temporal_patch_size=2, size=pixels
        ),
        chat_template=VISION_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)


@dataclass(frozen=True)
class TinyMTPRecipe:
    """The tiny model with one Qwen3.5 multi-token-prediction (MTP) layer whose drafts get
    accepted (`tiny_mtp_path`); its hash names the directory."""

    base: TinyQwen35Recipe = DEFAULT_RECIPE
    embed_rms: float = 0.1
    """RMS of every embedding row (0.02 in the tiny model). Above the token mixers' outputs the
    current token weighs more in the next one, which a drafter without the context can then
    guess. Measured with K = 2 drafts on 1,300-token prompts (vLLM without caching): at 0.25,
    60 of 66 drafts accepted, but two prompts that share only their last token got the same 32
    tokens (the context no longer mattered, so a wrong state would not show); at 0.1, 50 of 90
    accepted and those prompts' answers differ from the first token."""
    mixer_scale: float = 1.0
    """Multiplier of every token mixer's output projection (the GDN layers', the attention's)."""
    recipe_version: int = 1

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


MTP_RECIPE = TinyMTPRecipe()
MOE_MTP_RECIPE = TinyMTPRecipe(base=MOE_RECIPE)
"""The same on the tiny MoE model: its MTP layer's MLP is layer 0's mixture of experts, as in
Qwen3.5-MoE's checkpoints (vLLM's `Qwen3_5MoeMTP`)."""


def tiny_mtp_path(recipe: TinyMTPRecipe = MTP_RECIPE) -> Path:
    """The tiny model with one MTP layer (`mtp.*` weights, ``mtp_num_hidden_layers: 1``, the
    names vLLM's `Qwen3_5MTP.load_weights` reads), built once from the float model's weights.

    A random MTP layer drafts tokens that are almost never accepted, so the speculative paths a
    test wants (several tokens committed in one step, rollback of a partly accepted run) would
    not run. Here the target's next token depends mostly on its current one: embedding rows
    are rescaled to `TinyMTPRecipe.embed_rms` and only layer 0 keeps its MLP. The MTP layer
    computes the same function of the token it is given: ``fc = [I, 0]`` passes the embedding
    of token t + 1 (its normed hidden input is dropped), its attention is layer 3's (scaled
    like the target's mixers, so its KV still shapes drafts) and its MLP is layer 0's. The
    output head keeps the tiny model's power-of-two scale, so greedy choices stay off ties.
    """
    digest = recipe.digest()
    build = partial(_build_mtp, tiny_model_path(recipe.base), recipe)
    return _built(f"tiny-mtp-{digest}", "config.json", build)


def _build_mtp(source: Path, recipe: TinyMTPRecipe, out_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    embed = tensors["model.embed_tokens.weight"].float()
    rms = embed.pow(2).mean(-1, keepdim=True).sqrt()
    tensors["model.embed_tokens.weight"] = embed * (recipe.embed_rms / rms)
    for layer in range(1, config["num_hidden_layers"]):
        mlp = f"model.layers.{layer}.mlp."
        for name in tensors:  # the dense MLP's, or every expert's and the shared expert's
            if name.startswith(mlp) and name.endswith("down_proj.weight"):
                tensors[name].zero_()
    for name in tensors:
        if name.endswith(("linear_attn.out_proj.weight", "self_attn.o_proj.weight")):
            tensors[name] = tensors[name].float() * recipe.mixer_scale
    attention = config["layer_types"].index("full_attention")
    hidden = config["hidden_size"]
    mtp = {
        "mtp.fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),  # Gemma-style: scale 1
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.norm.weight": tensors["model.norm.weight"].clone(),
    }
    sources = {
        "input_layernorm": f"model.layers.{attention}.input_layernorm",
        "self_attn": f"model.layers.{attention}.self_attn",
        "post_attention_layernorm": "model.layers.0.post_attention_layernorm",
        "mlp": "model.layers.0.mlp",
    }
    for name, tensor in list(tensors.items()):
        for part, prefix in sources.items():
            if name.startswith(prefix + "."):
                mtp[f"mtp.layers.0.{part}{name[len(prefix) :]}"] = tensor.clone()
    dtype = getattr(torch, config["dtype"])
    tensors.update(mtp)
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    config["mtp_num_hidden_layers"] = 1
    _write_variant(source, out_dir, tensors, config)


QUANT_GROUP_SIZE = 128
"""Input columns per scale in the quantized variants: the published checkpoints' group, one
that vLLM's CPU kernel (`CPUWNA16LinearKernel`: even groups, input and output sizes multiples of
32) and its GPTQ config (groups of -1, 32, 64 or 128) accept, and that divides the tiny model's
input sizes (256 and 512)."""
FP8_BLOCK = 128
"""Rows and columns per scale in the FP8 variant, as in the published FP8 checkpoints."""
FP8_MAX = 448.0
"""The largest finite float8 e4m3 magnitude."""
QUANTIZED_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The linear layers written quantized. Everything else stays in float: the embeddings, the output
head, the norms, the GDN convolution (vLLM builds it without a quantization config), A_log and
dt_bias, and the GDN gates `FLOAT_LINEAR`, whose 4 output rows (one per value head) are no
multiple of 32, which the CPU kernel requires."""
FLOAT_LINEAR = ("in_proj_b", "in_proj_a")
"""The linear layers of this model that stay in float (named in the AWQ config)."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's order within an int32: nibble ``i`` (bits 4i..4i+3) holds output column AWQ_ORDER[i]
of its eight; GPTQ's nibble ``i`` holds element ``i``."""


def tiny_quantized_path(method: str, recipe: TinyQwen35Recipe = DEFAULT_RECIPE) -> Path:
    """The tiny model with `QUANTIZED_MODULES` round-to-nearest quantized, in the checkpoint
    layout of ``method``: "gptq" (4 bits, symmetric) or "awq" (4 bits, with zero points), groups
    of `QUANT_GROUP_SIZE`, or "fp8" (e4m3 in 128x128 blocks with a float32 scale each, the
    layout of the published Qwen3.5 FP8 checkpoints); built once from the float model's own
    random weights."""
    writer = {"gptq": _gptq_tensors, "awq": _awq_tensors, "fp8": _fp8_tensors}[method]
    layout = f"{method}-{QUANT_GROUP_SIZE}-{FP8_BLOCK}-1"
    digest = hashlib.sha256(f"{recipe.digest()}-{layout}".encode())
    build = partial(_build_quantized, tiny_model_path(recipe), method, writer)
    return _built(f"tiny-{method}-{digest.hexdigest()[:12]}", "config.json", build)


def _build_quantized(
    source: Path, method: str, writer: Callable[[Any], dict[str, Any]], out_dir: Path
) -> None:
    from safetensors.torch import load_file

    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in QUANTIZED_MODULES:
            tensors.update({f"{module}.{k}": v for k, v in writer(tensor).items()})
        else:
            tensors[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(method, config["layer_types"])
    _write_variant(source, out_dir, tensors, config)


def _write_variant(
    source: Path, out_dir: Path, tensors: dict[str, Any], config: dict[str, Any]
) -> None:
    """A variant of the model in ``source``: its ``tensors``, the source's other files (tokenizer,
    processor, recipe) and its ``config`` written last, which marks it built (`_built`)."""
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "model.safetensors"))
    for file in source.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, out_dir / file.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))


def _quantization_config(method: str, layer_types: list[str]) -> dict[str, Any]:
    if method == "fp8":
        # vLLM matches FP8's list by whole layer names; the GDN gates' 4 rows fill no 128-row
        # block, which vLLM's block-FP8 layers require of every part of a merged layer.
        gates = [
            f"model.layers.{i}.linear_attn.{name}"
            for i, kind in enumerate(layer_types)
            if kind == "linear_attention"
            for name in FLOAT_LINEAR
        ]
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": gates,
        }
    common = {"quant_method": method, "bits": 4, "group_size": QUANT_GROUP_SIZE}
    if method == "gptq":
        return {**common, "sym": True, "desc_act": False, "lm_head": False}
    # vLLM matches these names as substrings of its layers' names. Left out, vLLM infers the list
    # from the weights' dtypes, and it then holds each GDN layer itself (A_log and dt_bias are
    # its own float parameters): every GDN projection would be built unquantized, with no place
    # for its packed weights (checked with vLLM 0.32's `is_layer_skipped`).
    skip = list(FLOAT_LINEAR)
    return {**common, "zero_point": True, "version": "gemm", "modules_to_not_convert": skip}


def _groups(weight: Any) -> Any:
    """``weight`` [out, in] as float32 [out, in / group, group]."""
    rows, cols = weight.shape
    return weight.float().reshape(rows, cols // QUANT_GROUP_SIZE, QUANT_GROUP_SIZE)


def _pack(values: Any, order: tuple[int, ...] = tuple(range(8))) -> Any:
    """4-bit ``values`` [..., n] as int32 [..., n / 8]: nibble ``i`` of each word holds
    element ``order[i]`` of its eight."""
    import torch

    eight = values.long().reshape(*values.shape[:-1], -1, 8)[..., list(order)]
    words = (eight << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_tensors(weight: Any) -> dict[str, Any]:
    """Symmetric: w = (q - 8) * scale, q in 0..15. ``qweight`` [in / 8, out] is packed along the
    input; ``scales`` and ``qzeros`` have one row per group (vLLM's GPTQ path reads no zeros for
    symmetric checkpoints; they hold 8 - 1 as GPTQ's original format writes it)."""
    import torch

    groups = _groups(weight)
    scales = groups.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 7
    q = (groups / scales).round().clamp(-8, 7) + 8
    rows, cols = weight.shape
    zeros = torch.full((cols // QUANT_GROUP_SIZE, rows), 7)
    return {
        "qweight": _pack(q.reshape(rows, cols)).T.contiguous(),
        "qzeros": _pack(zeros),
        "scales": scales.squeeze(-1).T.contiguous().to(torch.float16),
        "g_idx": (torch.arange(cols) // QUANT_GROUP_SIZE).to(torch.int32),
    }


def _fp8_tensors(weight: Any) -> dict[str, Any]:
    """w = q * weight_scale_inv per 128x128 block, q in float8 e4m3 scaled so that the block's
    largest magnitude is e4m3's largest (448); ``weight_scale_inv`` [out / 128, in / 128]."""
    import torch

    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q.reshape(rows, cols), "weight_scale_inv": scale}


def _awq_tensors(weight: Any) -> dict[str, Any]:
    """Asymmetric: w = (q - zero) * scale, q and zero in 0..15. ``qweight`` [in, out / 8] and
    ``qzeros`` [in / group, out / 8] are packed along the output in `AWQ_ORDER`."""
    import torch

    groups = _groups(weight)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-8)
    zeros = (-low / scales).round().clamp(0, 15)
    q = ((groups / scales).round() + zeros).clamp(0, 15)
    rows, cols = weight.shape
    return {
        "qweight": _pack(q.reshape(rows, cols).T, AWQ_ORDER),
        "qzeros": _pack(zeros.squeeze(-1).T, AWQ_ORDER),
        "scales": scales.squeeze(-1).T.contiguous().to(torch.float16),
    }


def llm_kwargs(model_dir: Path | None = None, **overrides: object) -> dict[str, object]:
    """Keyword arguments for `vllm.LLM` that run the tiny model on this machine.

    Token-id prompts (no tokenizer; ``skip_tokenizer_init=False`` loads the model's word-level
    tokenizer and chat template), eager mode (fast start-up), and a memory fraction that fits the
    24 GiB development machines (on CPU vLLM reads it as a fraction of RAM).
    """
    kwargs: dict[str, object] = {
        "model": str(model_dir or tiny_model_path()),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.2,
        "seed": 0,
        "disable_log_stats": False,
    }
    kwargs.update(overrides)
    return kwargs
