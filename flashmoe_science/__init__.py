"""FlashMoE-Science: fused Triton kernels for attention and mixture-of-experts layers.

Public names are imported lazily, so that `flashmoe-science` (the command) can choose Triton's
CPU interpreter on a machine without a GPU before any kernel is defined.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "flash_attention_science": "flashmoe_science.attention",
    "flash_attention_forward": "flashmoe_science.attention",
    "flash_attention_backward": "flashmoe_science.attention",
    "flash_attention_varlen": "flashmoe_science.attention",
    "flash_attention_qkvpacked": "flashmoe_science.attention",
    "flash_attention_with_kvcache": "flashmoe_science.attention",
    "fp8_attention_inputs": "flashmoe_science.attention",
    "hadamard_rotate": "flashmoe_science.attention",
    "moe_route": "flashmoe_science.moe",
    "fused_experts": "flashmoe_science.moe",
    "fused_moe": "flashmoe_science.moe",
    "FlashMoELayer": "flashmoe_science.layers",
    "FlashMoEScienceAttention": "flashmoe_science.layers",
    "router_losses": "flashmoe_science.layers",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashmoe_science' has no attribute {name!r}")


def __dir__():
    return __all__
