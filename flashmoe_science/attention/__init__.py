"""Fused attention: forward and backward Triton kernels with flash-attn semantics."""
from . import ops  # registers the torch.library custom ops that autograd and torch.compile use
from .decode import flash_attention_with_kvcache
from .fp8 import fp8_attention_inputs, hadamard_matrix, hadamard_rotate
from .interface import flash_attention_backward, flash_attention_forward, flash_attention_science
from .packed import flash_attention_qkvpacked
from .reference import attention_reference, varlen_attention_reference
from .varlen import flash_attention_varlen

__all__ = ["flash_attention_backward", "flash_attention_forward", "flash_attention_qkvpacked",
           "flash_attention_science", "flash_attention_varlen", "flash_attention_with_kvcache", "attention_reference",
           "varlen_attention_reference", "fp8_attention_inputs", "hadamard_matrix", "hadamard_rotate"]
