"""FP8 experts (w8a8, e4m3) for inference: weight quantisation helpers and the FP8 path of
`fused_experts` / `fused_moe`.

Weights: `torch.float8_e4m3fn` with float32 scales, either per 128 x 128 block
(`block_shape=(128, 128)`, scales (E, N / 128, K / 128): DeepSeek-V3's and vLLM's format) or per
output channel (`block_shape=None`, scales (E, N) or (E, N, 1)); the value is q * scale.
Activations are quantised on the fly per token and group of 128 columns (fp32 scales): the
tokens by one small kernel before the gate/up GEMM, the intermediate in the gate/up GEMM's
epilogue. Products are FP8 x FP8 with fp32 accumulation; the output is in hidden_states' dtype.
H and I must be multiples of 128. Needs FP8 tensor cores (compute capability 8.9 or newer), or
Triton's CPU interpreter.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from ..dependent_launch import launch_options
from ..device import info_for
from ..float8 import FP8_DTYPE, FP8_MAX, check_fp8_device
from ..launch import KernelLauncher, PlanCache
from ..tensor_facts import TensorFacts
from ..tma import addressable, unchecked_descriptor
from . import configs, routing
from ._kernels.fp8 import down_fp8_kernel, gate_up_fp8_kernel, gather_rows_kernel, quantize_groups_kernel
from ._kernels import fp8_gluon
from ._kernels.fp8_gluon import down_fp8_gluon_kernel, gate_up_fp8_gluon_kernel

GROUP = configs.FP8_GROUP
_MIN_SCALE = 1e-12

_QUANTIZE = KernelLauncher("moe_fp8_quantize", quantize_groups_kernel)
_GATE_UP = KernelLauncher("moe_fp8_gate_up", gate_up_fp8_kernel)
_DOWN = KernelLauncher("moe_fp8_down", down_fp8_kernel)
_GATHER_ROWS = KernelLauncher("moe_fp8_gather_rows", gather_rows_kernel)
_GATE_UP_GLUON = KernelLauncher("moe_fp8_gate_up_gluon", gate_up_fp8_gluon_kernel)
_DOWN_GLUON = KernelLauncher("moe_fp8_down_gluon", down_fp8_gluon_kernel)
PLANS = PlanCache()  # checked calls' plans, by the call's key (experts._fp8_experts)


def quantize_fp8_blockwise(w: torch.Tensor, block=(GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): w (..., N, K) in FP8 e4m3 with one fp32 scale per block x block tile,
    scales (..., cdiv(N, 128), cdiv(K, 128)); w ~= q * scale of its tile (DeepSeek-V3's format)."""
    if tuple(block) != (GROUP, GROUP):
        raise ValueError(f"block must be (128, 128), the blocks the kernels read; got {tuple(block)}")
    _check_weight_to_quantize(w)
    *lead, N, K = w.shape
    nb, kb = -(-N // GROUP), -(-K // GROUP)
    padded = torch.zeros(*lead, nb * GROUP, kb * GROUP, dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = w
    tiles = padded.view(*lead, nb, GROUP, kb, GROUP)
    scales = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (tiles / scales[..., :, None, :, None]).to(FP8_DTYPE).view(*lead, nb * GROUP, kb * GROUP)
    return q[..., :N, :K].contiguous(), scales


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): w (..., N, K) in FP8 e4m3 with one fp32 scale per output channel (row),
    scales (..., N)."""
    _check_weight_to_quantize(w)
    scales = (w.float().abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (w.float() / scales[..., None]).to(FP8_DTYPE), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, block_shape=None) -> torch.Tensor:
    """q * scales in float32, for block scales (block_shape (128, 128)) or per-channel scales."""
    if block_shape is None:
        return q.float() * scales.reshape(*q.shape[:-1], 1)
    expanded = scales.repeat_interleave(GROUP, -2).repeat_interleave(GROUP, -1)
    return q.float() * expanded[..., :q.shape[-2], :q.shape[-1]]


def _check_weight_to_quantize(w) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        raise TypeError("w must be a tensor of at least 2 dimensions (..., N, K)")
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise TypeError(f"w must be float16, bfloat16 or float32 to quantise, got {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError("w has NaN or infinite entries: they have no FP8 scale")


def _check_scales(name: str, scales, weight: torch.Tensor, block_shape) -> None:
    E, N, K = weight.shape
    expected = (E, N // GROUP, K // GROUP) if block_shape is not None else (E, N)
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor of shape {expected}, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scales.dtype}")
    shape = tuple(scales.shape)
    if block_shape is None and shape == (E, N, 1):
        shape = (E, N)
    if shape != expected:
        kind = "per 128 x 128 block" if block_shape is not None else "per output channel"
        raise ValueError(f"{name} has shape {tuple(scales.shape)}; scales {kind} of a weight {tuple(weight.shape)} "
                         f"must be {expected}")
    if scales.device != weight.device:
        raise ValueError(f"{name} is on {scales.device}; it must be on its weight's device ({weight.device})")


def check_fp8_args(hidden_states, w1, w2, w1_scale, w2_scale, block_shape, activation) -> None:
    """The FP8 path's argument checks (shapes, dtypes, devices, scales, the GPU)."""
    from .experts import _check_tensor

    _check_tensor("hidden_states", hidden_states, 2, "(T, H)")
    _check_tensor("w1", w1, 3, "(E, 2*I, H)")
    _check_tensor("w2", w2, 3, "(E, H, I)")
    if hidden_states.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"with FP8 weights hidden_states must be float16 or bfloat16, got {hidden_states.dtype}")
    if w1.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 experts need w1 and w2 both in torch.float8_e4m3fn, got {w1.dtype} and {w2.dtype}")
    if block_shape is not None and tuple(block_shape) != (GROUP, GROUP):
        raise ValueError(f"block_shape must be None (per-channel scales) or (128, 128), got {block_shape!r}")
    T, H = hidden_states.shape
    E, two_i, w1_h = w1.shape
    I = two_i // 2
    if w1_h != H or two_i % 2 or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} must be (E, 2*I, H) and (E, H, I) with "
                         f"H = {H} (hidden_states)")
    if H % GROUP or I % GROUP or H == 0 or I == 0:
        raise ValueError(f"FP8 experts need H ({H}) and I ({I}) to be positive multiples of {GROUP}")
    if not 1 <= E <= configs.MAX_EXPERTS:
        raise ValueError(f"w1 has E = {E} experts; supported: 1 to {configs.MAX_EXPERTS}")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}; it must be on hidden_states' device ({hidden_states.device})")
    _check_scales("w1_scale", w1_scale, w1, block_shape)
    _check_scales("w2_scale", w2_scale, w2, block_shape)
    if activation not in configs.ACTIVATIONS:
        raise ValueError(f"activation must be one of {configs.ACTIVATIONS}, got {activation!r}")
    check_fp8_device("FP8 experts", hidden_states)


# Scales tensors already found finite and positive (read once each, as `tensor_facts` says).
_VALIDATED = TensorFacts(max_entries=256)


def check_scales_finite(w1_scale, w2_scale) -> None:
    """Non-finite or non-positive scales would turn whole blocks into NaN, zeros or flipped signs:
    refused. The values are read back (a host synchronisation) the first time a scales tensor is
    seen and after each in-place change, never while a CUDA graph is being captured."""
    for name, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        if _VALIDATED.get(s) is not None or (s.is_cuda and torch.cuda.is_current_stream_capturing()):
            continue
        if not bool(((s > 0) & torch.isfinite(s)).all()):
            raise ValueError(f"{name} has a non-finite, zero or negative scale")
        _VALIDATED.remember(True, s)


class _FP8Plan:
    __slots__ = ("num_tokens", "hidden", "inter", "num_experts", "top_k", "config", "down_split", "dispatch",
                 "block_scales", "device_index", "launch_key")

    def __init__(self, key, hidden_states, w1, w2, top_k, block_shape):
        T, H = hidden_states.shape
        E, two_i, _ = w1.shape
        self.num_tokens, self.hidden, self.inter, self.num_experts, self.top_k = T, H, two_i // 2, E, top_k
        # The Gluon kernels view the weights as (E * N, K) TMA tensors (the key holds their strides
        # and alignment).
        gluon_ok = w1.is_contiguous() and w2.is_contiguous() and addressable(w1, w2)
        device = info_for(hidden_states)
        self.config = configs.fp8_config(device, T, top_k, E, gluon_ok)
        self.down_split = configs.fp8_down_split(self.config, device, T, top_k, E, H, two_i // 2)
        self.dispatch = routing.DispatchPlan(T, E, top_k, self.config.block_m, hidden_states.device,
                                             self.config.pdl)
        self.block_scales = block_shape is not None
        self.device_index = self.dispatch.device_index
        self.launch_key = (key, self.config, self.down_split)


def new_plan(key, hidden_states, w1, w2, top_k: int, block_shape) -> _FP8Plan:
    """The plan of a call whose arguments passed `check_fp8_args`, cached under `key`."""
    return PLANS.remember(key, _FP8Plan(key, hidden_states, w1, w2, top_k, block_shape))


def run_fp8_experts(plan: _FP8Plan, x, w1, w2, w1_scale, w2_scale, topk_weights, topk_ids, layout, activation):
    """Quantise the tokens, then the FP8 gate/up and down GEMMs and the combine: out (T, H) in
    x's dtype."""
    from .experts import launch_combine

    cfg, key, device = plan.config, plan.launch_key, x.device
    T, H, I = plan.num_tokens, plan.hidden, plan.inter
    w1_scale, w2_scale = (s.reshape(s.shape[0], -1) if not plan.block_scales else s for s in (w1_scale, w2_scale))
    if cfg.gluon:
        y = _gluon_gemms(plan, x, w1, w2, w1_scale, w2_scale, topk_weights, layout, activation)
        out = routing.allocate((T, H), x.dtype, device)
        launch_combine(key, y, topk_ids, out, plan.num_experts, plan.device_index)
        return out
    xq, xs = _quantized_tokens(plan, x)
    rows = layout.num_blocks * layout.block_m
    hq = routing.allocate((rows, I), FP8_DTYPE, device)
    hs = routing.allocate((rows, I // GROUP), torch.float32, device)
    _GATE_UP.launch(
        key, (layout.num_blocks * (I // GROUP), 1, 1),
        (xq, xs, w1, w1_scale, hq, hs, layout.sorted_pairs, layout.block_expert, layout.block_rows, layout.num_blocks,
         H, I, plan.top_k, w1.stride(0), w1.stride(1), w1_scale.stride(0), w1_scale.stride(1),
         activation, plan.block_scales, cfg.block_m, cfg.group_m, GROUP, cfg.swap_ab, cfg.pdl),
        num_warps=cfg.gate_up_warps, num_stages=cfg.num_stages, device_index=plan.device_index,
        **launch_options(cfg.pdl))
    split = plan.down_split  # with a split, each part's fp32 partial rows, added by the combine
    y = (routing.allocate((split, T * plan.top_k, H), torch.float32, device) if split > 1
         else routing.allocate((T * plan.top_k, H), x.dtype, device))
    _DOWN.launch(
        key, (layout.num_blocks * (H // cfg.down_block_n) * split, 1, 1),
        (hq, hs, w2, w2_scale, y, topk_weights, layout.sorted_pairs, layout.block_expert, layout.block_rows,
         layout.num_blocks, T * plan.top_k, H, I, w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
         plan.block_scales, cfg.block_m, cfg.down_block_n, cfg.group_m, GROUP, split, cfg.swap_ab, cfg.pdl),
        num_warps=cfg.down_warps, num_stages=cfg.num_stages, device_index=plan.device_index,
        **launch_options(cfg.pdl))
    out = routing.allocate((T, H), x.dtype, device)
    launch_combine(key, y, topk_ids, out, plan.num_experts, plan.device_index, cfg.pdl)
    return out


def _quantized_tokens(plan: _FP8Plan, x):
    """(xq (T, H) FP8, xs (T, H / 128) fp32): the tokens per row and group of 128 columns. In a
    chained configuration (pdl) the launch is a programmatic dependent of the routing's, beside
    which it runs: x was ready before the routing launched."""
    T, H = plan.num_tokens, plan.hidden
    pdl = plan.config.pdl
    xq = routing.allocate((T, H), FP8_DTYPE, x.device)
    xs = routing.allocate((T, H // GROUP), torch.float32, x.device)
    _QUANTIZE.launch(plan.launch_key, (-(-T // configs.FP8_QUANTIZE_ROWS), H // GROUP, 1),
                     (x, xq, xs, T, H, x.stride(0), configs.FP8_QUANTIZE_ROWS, GROUP, pdl),
                     num_warps=4, num_stages=1, device_index=plan.device_index, **launch_options(pdl))
    return xq, xs


@functools.lru_cache(maxsize=None)
def gluon_box_layout(rows: int, cols: int, scales: bool):
    """The shared-memory layout of a Gluon FP8 GEMM's TMA box: FP8 tiles with the widest swizzle
    their rows allow (as wgmma reads them), fp32 scale rows unswizzled."""
    if scales:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


def _gluon_gemms(plan: _FP8Plan, x, w1, w2, w1_scale, w2_scale, topk_weights, layout, activation):
    """The tokens quantised in layout order, then the Gluon gate/up and down GEMMs
    (`_kernels/fp8_gluon.py`, sm90): y (T * top_k, H), each pair's row at its slot."""

    def describe(t, rows, cols):
        box = gluon_box_layout(rows, cols, t.dtype == torch.float32)
        return unchecked_descriptor(GluonDescriptor, t, list(t.shape), list(t.stride()), [rows, cols], box)

    cfg, key, device = plan.config, plan.launch_key, x.device
    T, H, I, E = plan.num_tokens, plan.hidden, plan.inter, plan.num_experts
    TILE_M = fp8_gluon.TILE_M.value  # the layout's block
    xq, xs = _quantized_tokens(plan, x)
    rows = layout.num_blocks * TILE_M
    xq_rows = routing.allocate((rows, H), FP8_DTYPE, device)
    xs_t = routing.allocate((H // GROUP, rows), torch.float32, device)
    _GATHER_ROWS.launch(
        key, (rows // configs.FP8_GATHER_ROWS, 1, 1),
        (xq.view(torch.uint8), xs, layout.sorted_pairs, layout.block_rows, xq_rows.view(torch.uint8), xs_t, rows, H,
         plan.top_k, TILE_M, configs.FP8_GATHER_ROWS, GROUP),
        num_warps=4, num_stages=1, device_index=plan.device_index)
    hq = routing.allocate((rows, I), FP8_DTYPE, device)
    hs_t = routing.allocate((I // GROUP, rows), torch.float32, device)
    sms = info_for(x).sm_count  # persistent kernels: at most one program an SM
    half = fp8_gluon.HALF.value  # rows of a weight box
    _GATE_UP_GLUON.launch(
        key, (min(layout.num_blocks * (I // GROUP), sms), 1, 1),
        (describe(xq_rows, TILE_M, GROUP), describe(w1.view(E * 2 * I, H), half, GROUP), describe(xs_t, 1, TILE_M),
         w1_scale, hq, hs_t, layout.block_expert, layout.num_blocks, rows, H, I, w1_scale.stride(0),
         w1_scale.stride(1), activation, plan.block_scales, cfg.group_m, cfg.num_stages),
        num_warps=4, num_stages=1, device_index=plan.device_index)
    y = routing.allocate((T * plan.top_k, H), x.dtype, device)
    _DOWN_GLUON.launch(
        key, (min(layout.num_blocks * (H // GROUP), sms), 1, 1),
        (describe(hq, TILE_M, GROUP), describe(w2.view(E * H, I), half, GROUP), describe(hs_t, 1, TILE_M), w2_scale,
         y, topk_weights, layout.sorted_pairs, layout.block_expert, layout.block_rows, layout.num_blocks, H, I,
         w2_scale.stride(0), w2_scale.stride(1), plan.block_scales, cfg.group_m, cfg.num_stages),
        num_warps=4, num_stages=1, device_index=plan.device_index)
    return y
