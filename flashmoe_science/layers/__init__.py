"""nn.Modules built on the fused kernels: a mixture-of-experts layer and an attention layer.

Both train (autograd through the kernels' backward) and trace under torch.compile without a
graph break (the kernels are torch.library custom ops).
"""
from .attention import FlashMoEScienceAttention
from .moe import FlashMoELayer, router_losses, router_statistics

__all__ = ["FlashMoELayer", "FlashMoEScienceAttention", "router_losses", "router_statistics"]
