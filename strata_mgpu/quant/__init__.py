"""GGML block formats: sizes, layouts and host dequantization."""

from strata_mgpu.quant.dequant import dequantize, dequantize_rows
from strata_mgpu.quant.formats import SUPPORTED_TYPES, BlockFormat, block_format, parse_type

__all__ = ["SUPPORTED_TYPES", "BlockFormat", "block_format", "dequantize", "dequantize_rows", "parse_type"]
