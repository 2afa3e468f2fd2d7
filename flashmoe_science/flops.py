"""Floating-point operation counts: the one definition the dispatchers' size thresholds, the
benchmarks' TFLOP/s and the docs use."""
from __future__ import annotations

import torch

NO_WINDOW = (-1, -1)
# FLOPs per computed query-key pair and head, as (factor of the q/k head dim, factor of the v
# head dim): the forward's S = Q K^T and O = P V; the backward's recomputed S, dK and dQ (q/k) and
# dP and dV (v): 2.5x the forward's at equal head dims, forward and backward together 3.5x.
_ATTENTION_MODES = {"fwd": (2.0, 2.0), "bwd": (6.0, 4.0), "fwd+bwd": (8.0, 6.0)}
# SwiGLU experts: gate, up and down products, 2 FLOPs a multiply-add (6); the backward twice that.
_MOE_MODES = {"fwd": 6.0, "fwd+bwd": 18.0}


def attention_pairs(seqlen_q, seqlen_k, causal=False, window_size=NO_WINDOW) -> int:
    """Query-key pairs attention computes: those in the band of query i, keys c - left <= j <=
    c + right with c = i + Sk - Sq (bottom-right alignment; -1 unbounded; causal: right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return seqlen_q * seqlen_k
    c = torch.arange(seqlen_q, dtype=torch.float64) + (seqlen_k - seqlen_q)
    lo = (c - left).clamp(min=0) if left >= 0 else torch.zeros_like(c)
    hi = (c + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(c, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum().item())


def attention_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, causal=False, mode="fwd",
                    window_size=NO_WINDOW, head_dim_v=None) -> float:
    """4*B*Hq*D per computed pair (`attention_pairs`: only the unmasked ones) for the forward,
    2.5x that for the backward, 3.5x for both; with a v head dim of its own (MLA),
    2*B*Hq*(D + D_v) per pair for the forward (`_ATTENTION_MODES`)."""
    pairs = attention_pairs(seqlen_q, seqlen_k, causal, window_size)
    qk, v = _ATTENTION_MODES[mode]
    return batch * heads_q * pairs * (qk * head_dim + v * (head_dim if head_dim_v is None else head_dim_v))


def moe_flops(tokens, top_k, hidden, expert_dim, mode="fwd") -> float:
    """6*T*k*H*I for the forward of SwiGLU experts; 18*T*k*H*I forward+backward."""
    return _MOE_MODES[mode] * tokens * top_k * hidden * expert_dim
