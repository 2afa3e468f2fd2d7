"""The attention forward: which kernel runs for a call, and its launch.

`attention_forward` makes a call's plan (`ForwardPlan`) once per set of shapes, strides, dtypes,
devices and options, caches it under those facts (`plan_key`), and `launch_forward` allocates
the outputs and launches the plan's kernel. Packed variable-length calls (`varlen.py`) make
their own plans of the same class and launch through `launch_forward` too. Which kernel runs
(the kernels live in `_kernels/`, their tables in `configs.py`):

- sm90, dense 16-bit calls of at least `HOPPER_MIN_FLOPS` whose tensors TMA can address:
  - no softcap, at a head dim and key count `GLUON_FORWARD` lists: the Gluon kernel,
    `forward_gluon.attention_forward_gluon_kernel` (`launch_gluon`);
  - otherwise the Triton TMA kernel, `forward_hopper.attention_forward_hopper_kernel`
    (`launch_tma`, `HOPPER_FORWARD`).
- Dense calls whose Sq x group query rows fit one decode tile, against many keys, with one head
  dim for q, k and v (`configs.takes_decode`; decode with a KV cache, on any GPU): the KV-cache kernels,
  `decode.attention_decode_split_kernel` then, with more than one split, `..._combine_kernel`
  (`decode.launch_decode`): split-KV, with the query heads of a KV head packed into one tile.
- Every other call (fp32, packed, small, not unit-strided in D, any other GPU, the CPU
  interpreter): `forward.attention_forward_kernel` (`FORWARD`, by device family, dtype and
  padded head dim; `forward_config` picks the short or long tile).

A v head dim of its own (MLA) takes the tables' entry of the larger padded head dim
(`configs.VALUE_HEAD_DIM_BLOCKS`); a Gluon entry then needs room for separate output buffers
(`configs.gluon_separate_output`).

A negative softmax_scale runs as a positive one on -q (`positive_scale`), the one place the
scale changes before it reaches a kernel (as scale * log2(e), the kernels working in base 2).
"""
from __future__ import annotations

import math

import torch

from ..device import info_for
from ..float8 import FP8_DTYPE
from ..flops import attention_flops
from ..launch import KernelLauncher, PlanCache
from . import descriptors
from ._kernels.forward import attention_forward_kernel
from ._kernels.forward_gluon import attention_forward_gluon_kernel
from ._kernels.forward_hopper import attention_forward_hopper_kernel
from .checks import NO_WINDOW, check_band, check_inputs, check_options
from .configs import (forward_config, gluon_forward_section, gluon_forward_tiles, gluon_persistent,
                      gluon_separate_output, head_dim_block, hopper_forward_config, takes_decode)
from .decode import DecodePlan, launch_decode
from .fp8 import FP8_OUT_DTYPE, fp8_value_tiles
from .layouts import LOG2E, cdiv, dense_strides, kernel_window, positive_scale, row_strides, token_totals

_FORWARD = KernelLauncher("attention_forward", attention_forward_kernel, fp32_dots=True)
_HOPPER = KernelLauncher("attention_forward_hopper", attention_forward_hopper_kernel)
_GLUON = KernelLauncher("attention_forward_gluon", attention_forward_gluon_kernel)
PLANS = PlanCache()


class ForwardPlan:
    """Everything about a forward call that depends only on its shapes, strides, dtypes and options.

    Dense calls: q (B, Hq, Sq, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, D_v), D_v = D or not
    (MLA). Packed variable-length calls: q (total_q, Hq, D), k (total_k, Hkv, D) and v
    (total_k, Hkv, D_v), `batch` sequences of at most `seqlen_q` queries and `seqlen_k` keys;
    lse is then (Hq, total_q). The output is q's shape with D_v.
    """

    __slots__ = ("empty", "contiguous", "config", "grid", "default_scale", "softcap", "packed", "lse_shape",
                 "device_index", "kernel_options", "launch_tail", "hopper", "decode", "window", "causal",
                 "out_shape", "out_strides", "out_dtype", "fp8")

    def __init__(self, q, k, v, batch, seqlen_q, seqlen_k, causal, window_size, softcap, write_lse, packed,
                 config=None):
        heads_q, head_dim, head_dim_v = q.shape[1], q.shape[-1], v.shape[-1]
        self.fp8 = q.dtype == FP8_DTYPE  # (`fp8.py`): a bf16 output
        self.out_dtype = FP8_OUT_DTYPE if self.fp8 else q.dtype
        # FP8's v may have any strides for the sm90 kernel, which reads a copy (`fp8.fp8_value_tiles`);
        # the generic kernel, like every 16-bit path, reads rows of unit stride (set below once the
        # kernel is known).
        q_strided, k_strided, v_strided = (t.stride(-1) != 1 for t in (q, k, v))
        self.contiguous = q_strided or k_strided or (v_strided and not self.fp8)
        # The output is q's shape with v's head dim, its dimensions in the memory order of q, dense
        # (`output_like`); contiguous where any of q, k, v has a non-unit stride in D, FP8's v
        # included, whichever kernel runs: one rule, which the custom op's fake implementation
        # (`ops.py`) repeats.
        self.out_shape = (*q.shape[:-1], head_dim_v)
        self.out_strides = dense_strides(self.out_shape,
                                         None if q_strided or k_strided or v_strided else q.stride())
        self.empty = q.numel() == 0
        self.default_scale = 1.0 / math.sqrt(head_dim)
        self.softcap = float(softcap)
        self.packed = packed
        self.lse_shape = (heads_q, q.shape[0]) if packed else (batch, heads_q, seqlen_q)
        self.device_index = q.device.index if q.device.type == "cuda" else None
        # Tiles are chosen for the larger head dim (the tables' shared memory bounds hold q, k and v
        # tiles of one width).
        cfg = self.config = config or forward_config(info_for(q), q.element_size(), max(head_dim, head_dim_v),
                                                     seqlen_q, batch * heads_q, packed)
        num_m_blocks = cdiv(seqlen_q, cfg.block_m)
        self.grid = (num_m_blocks * batch * heads_q, 1, 1)
        lse_strides = (0, q.shape[0]) if packed else (heads_q * seqlen_q, seqlen_q)
        # The kernel arguments after the tensors' strides; the strides join them at the first
        # launch, once the output (whose layout follows q's) exists.
        self.kernel_options = (*lse_strides, heads_q, heads_q // k.shape[1], seqlen_q, seqlen_k,
                               *token_totals(q, k, packed), num_m_blocks,
                               *kernel_window(causal, window_size), head_dim, head_dim_block(head_dim),
                               head_dim_v, head_dim_block(head_dim_v), cfg.block_m, cfg.block_n, causal, softcap > 0,
                               packed, write_lse, self.fp8)
        self.launch_tail = None
        self.causal = causal
        self.window = kernel_window(causal, window_size)
        # Large dense 16-bit calls on sm90 take the TMA kernels when the tensors allow it.
        flops = attention_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, head_dim_v=head_dim_v)
        self.hopper = self.decode = None
        if (config is None and not packed and not self.contiguous and head_dim_v == head_dim and not self.fp8
                and takes_decode(q.element_size(), seqlen_q, heads_q // k.shape[1], seqlen_k)):
            # A short query against many keys: the KV-cache kernels, the keys as a full cache.
            self.decode = DecodePlan(q.transpose(1, 2), k.transpose(1, 2), None, causal, window_size, 0)
        elif config is None and not packed and not self.contiguous and q.is_cuda:
            masked = causal or any(w >= 0 for w in window_size)
            hopper_cfg = hopper_forward_config(info_for(q), q.element_size(), head_dim, flops, softcap > 0, masked,
                                               seqlen_k, head_dim_v)
            # FP8's V reaches the Gluon kernel as a copy (`fp8.fp8_value_tiles`), TMA-addressable whatever v is.
            if hopper_cfg is not None and descriptors.supports(q, k, *(() if self.fp8 else (v,))):
                self.hopper = hopper_cfg
        if self.hopper is None and v.stride(-1) != 1 and not self.contiguous:  # FP8's v, generic kernel
            self.contiguous = True
            self.out_strides = dense_strides(self.out_shape)


def plan_key(q, k, v, causal, window_size, softcap, write_lse):
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, causal, window_size, softcap, write_lse,
            q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)


def launch_forward(plan: ForwardPlan, key, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, write_lse,
                sequence_order=None, descales=None):
    """Launches the forward kernel for a plan: returns (out, lse), lse None unless `write_lse`.
    `key` (None: Triton's ordinary launch path) must determine the plan, as `plan_key` does.
    Packed batches pass their cumulative lengths and `sequence_order` (`varlen.longest_first`).
    FP8 calls pass their (B, Hkv, 3) descales (`fp8.fp8_descales`)."""
    if plan.contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_strided(plan.out_shape, plan.out_strides, dtype=plan.out_dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if write_lse else None
    if plan.empty:
        return out, lse
    if plan.decode is not None:
        launch_decode(plan.decode, key, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
                      lse, k.shape[2], None, 0, softmax_scale, plan.softcap)
        return out, lse
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    q, scale = positive_scale(q, scale)
    softcap = plan.softcap
    if plan.hopper is not None:
        gluon, cfg = plan.hopper
        if gluon:
            launch_gluon(q, k, fp8_value_tiles(v) if plan.fp8 else v, out, lse, scale, cfg, plan.window,
                         causal=plan.causal, device_index=plan.device_index, key=key, descales=descales)
        else:
            launch_tma(q, k, v, out, lse, scale, softcap, cfg, plan.window, causal=plan.causal,
                       device_index=plan.device_index, key=key)
        return out, lse
    tail = plan.launch_tail
    if tail is None:
        packed = plan.packed
        tail = plan.launch_tail = (*row_strides(q.stride(), packed), *row_strides(k.stride(), packed),
                                   *row_strides(v.stride(), packed), *row_strides(out.stride(), packed)
                                   ) + plan.kernel_options
    cfg = plan.config
    scales = (scale * LOG2E, scale / softcap if softcap else 0.0, softcap * LOG2E)
    _FORWARD.launch(key, plan.grid, (q, k, v, out, lse if write_lse else out, cu_seqlens_q, cu_seqlens_k,
                                     sequence_order, out if descales is None else descales, *scales) + tail,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, device_index=plan.device_index)
    return out, lse


def launch_tma(q, k, v, out, lse, scale, softcap, config, window, *, causal, device_index=None,
               key=None) -> None:
    """The Triton TMA kernel (`_kernels/forward_hopper.py`): writes out (and lse, (B, Hq, Sq)
    float32, unless None) for dense q (B, Hq, Sq, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, D_v),
    out (B, Hq, Sq, D_v); `window` is the
    kernel's (window_left, window_right); scale >= 0 (callers negate q for a negative one). `key` as
    for `KernelLauncher.launch`: the descriptors are built per call (they hold data pointers), and
    what Triton specialises on, their dtype and tile shape, follows from the dtypes and `config`,
    which the caller's key determines."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    block_d, block_dv = head_dim_block(head_dim), head_dim_block(v.shape[-1])

    def describe(t, rows):
        return descriptors.tma_descriptor(t, rows, head_dim_block(t.shape[-1]))

    num_m_blocks = -(-seqlen_q // config.block_m)
    _HOPPER.launch(
        key, (num_m_blocks * batch * heads_q, 1, 1),
        (describe(q, config.block_m), describe(k, config.block_n), describe(v, config.block_n),
         describe(out, config.block_m), out if lse is None else lse,
         scale * LOG2E, scale / softcap if softcap else 0.0, softcap * LOG2E, heads_q * seqlen_q, seqlen_q,
         heads_q, heads_q // k.shape[1], seqlen_q, k.shape[2], num_m_blocks, *window,
         block_d, block_dv, config.block_m, config.block_n, causal, softcap > 0, lse is not None),
        num_warps=config.num_warps, num_stages=config.num_stages, device_index=device_index)


def launch_gluon(q, k, v, out, lse, scale, config, window, *, causal, persistent=None, device_index=None,
                 key=None, descales=None) -> None:
    """As `launch_tma`, through the Gluon kernel (`_kernels/forward_gluon.py`): no softcap;
    config.block_m query rows per tile, 16 per warp of its four-warp consumers (config.num_warps
    is a consumer's), so block_m = 128 runs two consumers and 192 three. `persistent` (default:
    `configs.gluon_persistent`): one program per SM walks the tiles; else one program per tile.
    v (and out) may have a head dim of their own (MLA) where `configs.gluon_separate_output` holds.
    FP8 (`descales` given, (B, Hkv, 3)): q, k in FP8 and v as `fp8.fp8_value_tiles` lays it out,
    (B, Hkv, D, Sk padded to 16); out 16-bit."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    fp8 = descales is not None
    block_d = head_dim_block(head_dim)
    block_dv = head_dim_block(v.shape[2] if fp8 else v.shape[-1])
    rows, consumers = gluon_forward_tiles(config)
    num_m_blocks = -(-seqlen_q // config.block_m)
    tiles = num_m_blocks * batch * heads_q
    if persistent is None:
        persistent = gluon_persistent(causal, seqlen_k)
    programs = min(tiles, info_for(q).sm_count) if persistent else tiles
    section = gluon_forward_section(heads_q // heads_kv, seqlen_k, (block_d + block_dv) // 2, q.element_size(),
                                    causal and not persistent)

    def describe(t, tile_rows):
        return descriptors.gluon_descriptor(t, tile_rows, head_dim_block(t.shape[-1]))

    desc_v = descriptors.gluon_descriptor(v, block_dv, config.block_n) if fp8 else describe(v, config.block_n)
    _GLUON.launch(
        key, (programs, 1, 1),
        (describe(q, rows), describe(k, config.block_n), desc_v, describe(out, rows),
         out if lse is None else lse, descales if fp8 else out, scale * LOG2E, heads_q * seqlen_q, seqlen_q,
         heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, num_m_blocks, batch * heads_q, section, *window,
         rows, config.block_n, head_dim, block_d, block_dv, config.num_stages, causal, lse is not None, consumers,
         fp8 or gluon_separate_output(config, block_d, block_dv), persistent, fp8),
        num_warps=4, num_stages=1, device_index=device_index)


def attention_forward(q, k, v, causal: bool, softmax_scale: float | None, write_lse: bool, config=None,
                      window_size=NO_WINDOW, softcap: float = 0.0, descales=None):
    """Runs the forward kernel on dense inputs: returns (out, lse) with lse None unless `write_lse`.

    `config` forces an AttentionConfig (for tuning sweeps); such calls take Triton's ordinary,
    uncached launch path, as do calls whose window_size is a list rather than a tuple. FP8 calls
    pass their checked descales (`fp8.fp8_descales`).
    """
    # The options' types and values are checked on every call (a cached plan's key compares
    # causal=1 equal to True and window (1.0, 2) equal to (1, 2)); the tensors' facts are the key.
    check_options(causal, softmax_scale)
    window_size = check_band(window_size, softcap)
    plan, key = forward_plan(q, k, v, causal, window_size, softcap, write_lse, config, descales is not None)
    return launch_forward(plan, key, q, k, v, None, None, softmax_scale, write_lse, descales=descales)


def forward_plan(q, k, v, causal, window_size, softcap, write_lse, config=None, fp8=False):
    """(plan, key) of a dense call whose options are checked (`window_size` as `check_band`
    returns it): the cached plan of the tensors' facts, or a new one after checking them; key None
    (Triton's ordinary launch path) with a forced `config` or arguments that are not tensors."""
    key = plan = None
    if config is None:
        try:
            key = plan_key(q, k, v, causal, window_size, softcap, write_lse)
            plan = PLANS.get(key)
        except AttributeError:  # not tensors: the checks say which
            key = None
    if plan is None:
        check_inputs(q, k, v, fp8=fp8)
        plan = ForwardPlan(q, k, v, q.shape[0], q.shape[2], k.shape[2], causal, window_size, softcap, write_lse,
                            False, config)
        if key is not None:
            PLANS.remember(key, plan)
    if plan.fp8 != fp8:  # a cached plan's fast path too: never FP8 bytes read as 16-bit
        raise TypeError("FP8 q, k, v run through flash_attention_science or flash_attention_forward with their "
                        "descales; other dtypes take no descales")
    return plan, key


def attention_forward_hopper(q, k, v, causal: bool, softmax_scale: float, config, *, gluon: bool = False,
                             persistent: bool | None = None, write_lse: bool = False, window_size=NO_WINDOW,
                             descales=None):
    """Forward through the Hopper Triton kernel, or the Gluon kernel with `gluon` (`persistent` as
    for `launch_gluon`), with an explicit AttentionConfig (for sweeps); returns (out, lse).

    q: (B, Hq, Sq, D), k and v: (B, Hkv, Sk, D), fp16 or bf16, on an sm90 GPU, `supports` true;
    window_size as for `flash_attention_science` (with causal, the right bound is 0). FP8 (Gluon
    only): q, k, v in FP8 with their (B, Hkv, 3) `descales` (`fp8.fp8_descales`), out bf16.
    """
    q, softmax_scale = positive_scale(q, softmax_scale)
    out = torch.empty(q.shape, dtype=FP8_OUT_DTYPE if descales is not None else q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if write_lse else None
    left, right = window_size
    window = (left, 0 if causal else right)
    if gluon:
        launch_gluon(q, k, fp8_value_tiles(v) if descales is not None else v, out, lse, softmax_scale, config, window,
                     causal=causal, persistent=persistent, device_index=q.device.index, descales=descales)
    else:
        launch_tma(q, k, v, out, lse, softmax_scale, 0.0, config, window, causal=causal,
                   device_index=q.device.index)
    return out, lse
