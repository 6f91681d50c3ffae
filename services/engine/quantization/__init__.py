"""Quantized serving: FP8 (e4m3) and INT4 weight-only (AWQ, GPTQ) linear layers, applied to the
plain model from outside (``apply.quantize_model``)."""

from services.engine.quantization.apply import (
    dummy_quantized,
    fuse_fp8_inputs,
    quantize_loaded,
    quantize_model,
    quantized_modules,
)
from services.engine.quantization.base import QuantLinear
from services.engine.quantization.config import QuantConfig, resolve_quantization

__all__ = [
    "QuantConfig",
    "QuantLinear",
    "dummy_quantized",
    "fuse_fp8_inputs",
    "quantize_loaded",
    "quantize_model",
    "quantized_modules",
    "resolve_quantization",
]
