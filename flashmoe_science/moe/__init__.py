"""Fused mixture-of-experts: routing, GPU dispatch and the expert GEMMs in Triton kernels,
forward and backward."""
from . import ops  # registers the torch.library custom ops that autograd and torch.compile use
from .experts import fused_experts, fused_moe
from .routing import moe_route

__all__ = ["moe_route", "fused_experts", "fused_moe"]
