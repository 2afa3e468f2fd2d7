"""Plain PyTorch references of the MoE forward: the formula of the issue, step by step.

They run in whatever dtype they are given (tests upcast to float64 for the reference and keep
the input precision to measure PyTorch's own rounding error), and loop over experts the way
most model code does, so the benchmark also uses `fused_experts_torch` as its "naive" path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .configs import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT


def moe_route_torch(router_logits, top_k, *, renormalize=True, scoring="softmax"):
    """(topk_weights (T, k), topk_ids (T, k) int64): softmax or sigmoid of the logits in at least
    fp32 (float64 stays float64), the k largest, optionally divided by their sum."""
    logits = router_logits if router_logits.dtype == torch.float64 else router_logits.float()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def gated_activation_torch(gate, up, activation="silu"):
    """silu(gate) * up (SwiGLU), gelu_tanh(gate) * up (GeGLU) or gpt-oss's clamped SwiGLU
    ("swiglu_oai", as transformers' GptOssExperts computes it)."""
    if activation == "swiglu_oai":
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def fused_experts_torch(hidden_states, w1, w2, topk_weights, topk_ids, *, activation="silu", w1_bias=None,
                        w2_bias=None, gate_up_interleaved=False):
    """out[t] = sum_j w[t, j] * (w2[e] @ act(gate, up) + b2[e]), [gate, up] = w1[e] @ x_t + b1[e],
    e = ids[t, j], computed per expert in hidden_states' dtype (ids outside [0, E) contribute
    nothing); gate rows [0, I) and up rows [I, 2I) of w1 (and b1), or alternating (interleaved)."""
    inter = w1.shape[1] // 2
    gate_rows, up_rows = ((slice(0, None, 2), slice(1, None, 2)) if gate_up_interleaved
                          else (slice(0, inter), slice(inter, None)))
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)
    for e in range(w1.shape[0]):
        tokens, slots = torch.where(topk_ids == e)
        if tokens.numel() == 0:
            continue
        x = hidden_states[tokens]
        gate_up = x @ w1[e].T + (w1_bias[e] if w1_bias is not None else 0)
        h = gated_activation_torch(gate_up[:, gate_rows], gate_up[:, up_rows], activation)
        y = h @ w2[e].T + (w2_bias[e] if w2_bias is not None else 0)
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def fused_moe_torch(hidden_states, w1, w2, router_logits, top_k, *, renormalize=True, activation="silu",
                    scoring="softmax"):
    """Routing by `moe_route_torch`, then `fused_experts_torch`."""
    weights, ids = moe_route_torch(router_logits, top_k, renormalize=renormalize, scoring=scoring)
    return fused_experts_torch(hidden_states, w1, w2, weights, ids, activation=activation)


def fused_moe_grouped_mm(x, w1, w2, router_logits, top_k):
    """`fused_moe_torch` the way torchtitan and transformers' grouped_mm experts compute it: sort
    the token-expert pairs by expert, then torch._grouped_mm for both expert matmuls (SiLU)."""
    E, two_i, _ = w1.shape
    weights, ids = moe_route_torch(router_logits, top_k)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(E, device=x.device), right=True).to(torch.int32)
    tokens = order // top_k
    h = torch._grouped_mm(x[tokens], w1.transpose(1, 2), offs=ends)
    a = gated_activation_torch(h[:, : two_i // 2], h[:, two_i // 2:])
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=ends) * weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


def _rowwise_fp8(a):
    """(a in float8_e4m3fn, its dequantisation scales (rows,)): one scale per row, max |a| / 448."""
    scale = (a.abs().amax(dim=-1).float() / 448.0).clamp_min(1e-12)
    return (a.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def fused_moe_scaled_grouped_mm(x, w1q, w1_scale, w2q, w2_scale, router_logits, top_k, group_align: int = 16):
    """PyTorch's FP8 MoE path: `fused_moe_grouped_mm` with torch._scaled_grouped_mm, weights in
    FP8 with per-output-channel scales (E, N), tokens and the intermediate quantised per row on
    the fly, each expert's rows padded to a multiple of `group_align` (the FP8 grouped GEMM's
    alignment, as torchao and torchtitan pad them) within a buffer sized for the most padding
    any routing needs, so nothing is read back to the host and the call can be captured in a
    CUDA graph."""
    E, two_i, _ = w1q.shape
    weights, ids = moe_route_torch(router_logits, top_k)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + group_align - 1) // group_align * group_align
    ends = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    rows = (ends - padded)[sorted_experts] + rank
    tokens = order // top_k
    capacity = -(-(flat.numel() + E * (group_align - 1)) // group_align) * group_align
    a = x.new_zeros(capacity, x.shape[1]).index_copy(0, rows, x[tokens])
    aq, a_scale = _rowwise_fp8(a)
    offs = ends.to(torch.int32)
    h = torch._scaled_grouped_mm(aq, w1q.transpose(1, 2), a_scale, w1_scale, offs=offs, out_dtype=x.dtype)
    hq, h_scale = _rowwise_fp8(gated_activation_torch(h[:, : two_i // 2], h[:, two_i // 2:]))
    y = torch._scaled_grouped_mm(hq, w2q.transpose(1, 2), h_scale, w2_scale, offs=offs, out_dtype=x.dtype)
    y = y[rows] * weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)
