"""`FlashMoEScienceAttention`: multi-head (grouped-query) self-attention on `flash_attention_qkvpacked`."""
from __future__ import annotations

import torch
from torch import nn

from ..attention import flash_attention_qkvpacked


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")


class FlashMoEScienceAttention(nn.Module):
    """Self-attention: fused QKV projection, `flash_attention_qkvpacked`, output projection.

    Args:
        dim: model width; a multiple of n_heads, with head_dim = dim / n_heads from 16 to 256.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention; default n_heads); must divide
            n_heads. K and V are never repeated in memory.
        causal: mask future positions (query i sees keys j <= i).
        bias: biases on both projections.
        dtype, device: of the parameters.

    Parameters:
        qkv: Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim): its output, viewed as
            (B, S, n_heads + 2 * n_kv_heads, head_dim), holds the query heads, then the key
            heads, then the value heads.
        out: Linear(n_heads * head_dim, dim).

    forward(x: (B, S, dim)) -> (B, S, dim). q, k and v reach the kernel as (B, H, S, head_dim)
    views of the projection's output (no copies); the attention output comes back in the
    (B, S, H, head_dim) memory order, so the output projection reads it without a copy either,
    and the backward writes dq, dk and dv into one gradient of the projection's output.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, causal: bool = False,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        _check_positive_int("dim", dim)
        _check_positive_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _check_positive_int("n_kv_heads", n_kv_heads)
        if dim % n_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        head_dim = dim // n_heads
        if not 16 <= head_dim <= 256:
            raise ValueError(f"head_dim = dim / n_heads = {head_dim} must be between 16 and 256")
        for name, flag in (("causal", causal), ("bias", bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.causal = dim, n_heads, n_kv_heads, head_dim, causal
        factory = dict(dtype=dtype, device=device)
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=bias, **factory)
        self.out = nn.Linear(n_heads * head_dim, dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (batch, seqlen, dim = {self.dim}), got shape {tuple(x.shape)}")
        batch, seqlen, _ = x.shape
        heads, kv_heads = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(batch, seqlen, heads + 2 * kv_heads, self.head_dim)
        attended = flash_attention_qkvpacked(qkv, causal=self.causal, num_kv_heads=kv_heads)
        return self.out(attended.reshape(batch, seqlen, heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}")
