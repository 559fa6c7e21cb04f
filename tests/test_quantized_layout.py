"""The quantized tiny models' tensors, read back the way vLLM unpacks them: every quantized
layer dequantizes to its float weight within 4-bit round-to-nearest error, and every other
tensor is the float model's own. (`tests/test_quantized.py` runs them on the engine.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from vllm.model_executor.layers.quantization.auto_awq import _REVERSE_AWQ_PACK_ORDER
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    unpack_quantized_values_into_int32,
)
from vllm.scalar_type import scalar_types

from vllm_hpc.tiny_model import FP8_BLOCK, QUANT_GROUP_SIZE, tiny_model_path, tiny_quantized_path

MARKER = {"gptq": ".qweight", "awq": ".qweight", "fp8": ".weight_scale_inv"}
"""The tensor that only a quantized layer of each format has."""
ERROR = {"gptq": 0.15, "awq": 0.15, "fp8": 0.05}
"""Relative error bound of round-to-nearest: 4 bits in groups of 128, or e4m3 (3 mantissa bits)."""


def _awq_unpacked(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] in AWQ's order to [rows, cols], as vLLM's AWQ loader reads it."""
    nibbles = (packed.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 15
    return nibbles[:, :, _REVERSE_AWQ_PACK_ORDER].reshape(packed.shape[0], -1)


def _dequantized(method: str, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The [out, in] weight that vLLM's kernel computes with."""
    if method == "fp8":
        scale = tensors[f"{module}.weight_scale_inv"]
        scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        return tensors[f"{module}.weight"].float() * scale
    scales = tensors[f"{module}.scales"].float().repeat_interleave(QUANT_GROUP_SIZE, 0)
    qweight = tensors[f"{module}.qweight"]
    if method == "gptq":
        q = unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)
        return ((q - 8) * scales).T
    zeros = _awq_unpacked(tensors[f"{module}.qzeros"]).repeat_interleave(QUANT_GROUP_SIZE, 0)
    return ((_awq_unpacked(qweight) - zeros) * scales).T


@pytest.mark.parametrize("method", sorted(MARKER))
def test_quantized_layers_read_back_as_the_float_weights(method: str) -> None:
    float_model = load_file(str(tiny_model_path() / "model.safetensors"))
    tensors = load_file(str(tiny_quantized_path(method) / "model.safetensors"))
    marker = MARKER[method]
    quantized = {name.removesuffix(marker) for name in tensors if name.endswith(marker)}
    assert len(quantized) == 3 * 6 + 7  # 3 GDN layers (3 + MLP 3), 1 attention layer (4 + 3)
    for name, weight in float_model.items():
        module = name.removesuffix(".weight")
        if module in quantized:
            error = (_dequantized(method, tensors, module) - weight.float()).norm()
            assert error / weight.float().norm() < ERROR[method], name
        else:
            assert torch.equal(tensors[name], weight), name
