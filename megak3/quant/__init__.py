"""Quantization: OCP MX formats (mx.py), K3's MXFP4-expert QAT (qat.py), FP8 dense linears (te.py)."""
from .config import QuantConfig
from .mx import dequantize, fake_quant, quantize
from .qat import apply_quantization

__all__ = ["QuantConfig", "apply_quantization", "dequantize", "fake_quant", "quantize"]
