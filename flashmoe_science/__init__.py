"""FlashMoE-Science: fused Triton kernels for attention and mixture-of-experts layers."""
from .attention import flash_attention_forward, flash_attention_science

__version__ = "0.1.0"

__all__ = ["flash_attention_forward", "flash_attention_science", "__version__"]
