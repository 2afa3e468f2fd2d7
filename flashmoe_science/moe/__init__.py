"""Fused mixture-of-experts forward: routing, GPU dispatch and the expert GEMMs in Triton kernels."""
from .experts import fused_experts, fused_moe
from .routing import moe_route

__all__ = ["moe_route", "fused_experts", "fused_moe"]
