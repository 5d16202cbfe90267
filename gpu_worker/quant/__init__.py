"""Quantized weights: what a checkpoint's ``quantization_config`` or ``--quantization`` asks for
(``config``), the FP8 linear method a quantized projection multiplies through (``fp8``), FP8
MoE experts (``fp8_experts``), their torch arithmetic (``fp8_math``) and loading (``load``).
The kernels are ``kernels/fp8_*.py`` and ``kernels/moe*.py``."""

from gpu_worker.quant.config import QUANTIZATION_METHODS, Fp8Format, parse_checkpoint_format, resolve_format
from gpu_worker.quant.fp8 import Fp8LinearMethod
from gpu_worker.quant.load import QuantLoad, fp8_weight_names
from gpu_worker.quant.load import prepare as prepare_quant

__all__ = ["QUANTIZATION_METHODS", "Fp8Format", "Fp8LinearMethod", "QuantLoad", "fp8_weight_names",
           "parse_checkpoint_format", "prepare_quant", "resolve_format"]
