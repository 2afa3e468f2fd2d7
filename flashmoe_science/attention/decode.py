"""Attention against a KV cache: `flash_attention_with_kvcache`, decode and short queries.

flash-attn's layouts and meaning: q (B, Sq, Hq, D); a contiguous cache k_cache, v_cache
(B, Sk_max, Hkv, D), or a paged one (num_pages, page_size, Hkv, D) with `block_table`
(B, max_pages_per_sequence) int32; `cache_seqlens` each sequence's cached length. Optional new
keys and values (B, Sq_new, Hkv, D) are written into the cache at cache_seqlens[b] ... before the
attention reads it (`_kernels/decode.kv_cache_append_kernel`; the caller advances
cache_seqlens), and the call attends to cache_seqlens[b] + Sq_new keys, bottom-right causal;
with `cache_leftpad`, to the keys from cache_leftpad[b] on (a left-padded batch in one cache).

Split-KV (flash-decoding): each (batch entry, KV head) has few query rows, so the keys are cut
into `num_splits` ranges that separate programs attend to, each writing a partial output and its
lse into a workspace sized from the shapes alone; a second kernel combines them. The rows of a
tile are the query rows of the heads that share a KV head (GQA packing), so K and V are read
once per group. Nothing reads a device value on the host: the call can be captured in a CUDA
graph and replayed with new cache_seqlens and block_table.

FP8 caches (both in float8 e4m3, q 16-bit or fp32) halve the bytes a step reads, with descales
per (sequence, KV head) or per cached token and KV head (`_cache_scales`); new keys and values
are quantised as they are appended (`_kernels/decode.py`'s module docstring).
"""
from __future__ import annotations

import math
import numbers

import torch

from ..dependent_launch import launch_options, pdl_runs
from ..device import check_runnable, info_for
from ..float8 import FP8_DTYPE, check_fp8_device
from ..launch import KernelLauncher, PlanCache
from ._kernels.decode import (HEAD_SCALES, NO_SCALES, TOKEN_SCALES, attention_decode_combine_kernel,
                              attention_decode_split_kernel, kv_cache_append_kernel)
from .checks import DTYPES, NO_WINDOW, check_band, check_bool, check_options, check_tensor
from .configs import (DECODE_COMBINE_SPLITS, DECODE_COMBINE_WARPS, decode_aligned_pages, decode_schedule,
                      decode_split_length, head_dim_block)
from .layouts import LOG2E, cdiv, kernel_window, positive_scale

_SPLIT = KernelLauncher("attention_decode_split", attention_decode_split_kernel, fp32_dots=True)
_COMBINE = KernelLauncher("attention_decode_combine", attention_decode_combine_kernel)
_APPEND = KernelLauncher("kv_cache_append", kv_cache_append_kernel)
PLANS = PlanCache()


def _check_tensor(name, t, ndim, dims, dtypes=DTYPES):
    check_tensor(name, t, ndim, dims, dtypes)
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {tuple(t.stride())}")


def _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad) -> None:
    """Shapes, dtypes and devices; cache_seqlens' values when it is an int (a tensor's are device
    values, checked by the kernels)."""
    _check_tensor("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    check_runnable("q", q)
    cache_dims = "(batch, seqlen_k, heads_kv, head_dim), or paged (num_pages, page_size, heads_kv, head_dim)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, 4, cache_dims, DTYPES + (FP8_DTYPE,))
        if t.dtype not in (q.dtype, FP8_DTYPE) or t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}) with q's dtype ({q.dtype}) or "
                             f"torch.float8_e4m3fn, got {t.dtype} on {t.device}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q and the caches must have the same head_dim, got {head_dim} and {k_cache.shape[3]}")
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be between 16 and 256, got {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the caches' heads ({heads_kv})")
    if block_table is not None:
        _check_tensor("block_table", block_table, 2, "(batch, max_pages_per_sequence)", (torch.int32,))
        if block_table.shape[0] != batch or block_table.device != q.device:
            raise ValueError(f"block_table must be ({batch}, max_pages_per_sequence) on {q.device}, got "
                             f"{tuple(block_table.shape)} on {block_table.device}")
        page_size = k_cache.shape[1]
        if page_size % 16:
            raise ValueError(f"a paged cache's page size (k_cache.shape[1]) must be a multiple of 16, got {page_size}")
    elif k_cache.shape[0] != batch:
        raise ValueError(f"a contiguous k_cache must have q's batch size {batch}, got {k_cache.shape[0]} "
                         "(pass block_table for a paged cache)")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new keys and values), or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, 4, "(batch, seqlen_new, heads_kv, head_dim)")
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:] or t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must be (batch={batch}, seqlen_new, heads_kv={heads_kv}, "
                                 f"head_dim={head_dim}) "
                                 f"of q's dtype and device, got {tuple(t.shape)} {t.dtype} on {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if cache_leftpad is not None:
        if not isinstance(cache_leftpad, torch.Tensor):
            raise TypeError(f"cache_leftpad must be an int32 tensor of shape ({batch},) or None, got "
                            f"{type(cache_leftpad).__name__}")
        if cache_leftpad.dtype != torch.int32 or cache_leftpad.shape != (batch,) or cache_leftpad.stride(0) != 1:
            raise ValueError(f"cache_leftpad must be a contiguous int32 tensor of shape ({batch},), got "
                             f"{cache_leftpad.dtype} {tuple(cache_leftpad.shape)}")
        if cache_leftpad.device != q.device:
            raise ValueError(f"cache_leftpad must be on q's device ({q.device}), got {cache_leftpad.device}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens (int32 (batch,) tensor or int) is required: each sequence's cached length")
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,) or cache_seqlens.stride(0) != 1:
            raise ValueError(f"cache_seqlens must be a contiguous int32 tensor of shape ({batch},), got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on q's device ({q.device}), got {cache_seqlens.device}")
    elif not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool):
        raise TypeError(f"cache_seqlens must be an int32 tensor or an int, got {type(cache_seqlens).__name__}")
    else:
        new = 0 if k is None else k.shape[1]
        capacity = _capacity(k_cache, block_table)
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(f"cache_seqlens={cache_seqlens} with {new} new tokens does not fit a cache of "
                             f"{capacity} tokens per sequence")


DESCALE_NAMES = ("k_descale", "v_descale")


def _cache_scales(q, k_cache, k_descale, v_descale) -> tuple:
    """(SCALES, k's descales, v's) of a call: (NO_SCALES, None, None) for a 16-bit or fp32 cache.
    An FP8 cache's descales are float32, both None (1 for every sequence and head), both
    (batch, heads_kv) (one per sequence and KV head) or both the cache's shape without its head
    dim, (batch, seqlen_k, heads_kv) or paged (num_pages, page_size, heads_kv) (one per cached token
    and KV head, written by appends)."""
    given = (k_descale, v_descale)
    if k_cache.dtype != FP8_DTYPE:
        for name, t in zip(DESCALE_NAMES, given):
            if t is not None:
                raise ValueError(f"{name} applies to FP8 caches only (torch.float8_e4m3fn); the caches are "
                                 f"{k_cache.dtype}")
        return NO_SCALES, None, None
    if q.dtype == FP8_DTYPE:
        raise TypeError("q must be fp16, bf16 or fp32 against an FP8 cache (the cache is converted to q's dtype)")
    check_fp8_device("FP8 KV caches", q)
    batch, heads_kv = q.shape[0], k_cache.shape[2]
    if k_descale is None and v_descale is None:
        ones = torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device)
        return HEAD_SCALES, ones, ones
    per_head, per_token = (batch, heads_kv), tuple(k_cache.shape[:3])
    for name, t in zip(DESCALE_NAMES, given):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor (both descales given, or neither), got "
                            f"{type(t).__name__}")
        if t.dtype != torch.float32 or t.device != q.device:
            raise TypeError(f"{name} must be float32 on q's device ({q.device}), got {t.dtype} on {t.device}")
        if tuple(t.shape) not in (per_head, per_token) or t.shape != given[0].shape:
            raise ValueError(f"{name} must have shape {per_head} (per sequence and KV head) or {per_token} (per "
                             f"cached token and KV head), the same for both descales; got {tuple(t.shape)}")
    if k_descale.stride() != v_descale.stride():
        raise ValueError(f"k_descale and v_descale must have the same strides, got {tuple(k_descale.stride())} and "
                         f"{tuple(v_descale.stride())}")
    return (HEAD_SCALES if tuple(k_descale.shape) == per_head else TOKEN_SCALES), k_descale, v_descale


def _scale_strides(descale) -> tuple:
    """(stride_sb, stride_sn, stride_sh) the kernels take for a descale tensor (zeros without one)."""
    if descale is None:
        return 0, 0, 0
    if descale.dim() == 2:
        return descale.stride(0), 0, descale.stride(1)
    return tuple(descale.stride())


def _capacity(k_cache, block_table) -> int:
    """Tokens a sequence's cache holds: Sk_max, or pages per sequence times the page size."""
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


class DecodePlan:
    """What a call's shapes, strides, dtypes and options decide: tiles, splits, grids, workspace."""

    __slots__ = ("config", "rows", "block_m", "rows_padded", "num_splits", "split_len", "split_grid",
                 "combine_grid", "block_d", "default_scale", "capacity", "window", "page_size", "device_index",
                 "pdl", "combine_options", "aligned_pages")

    def __init__(self, q, k_cache, block_table, causal, window_size, num_splits, config=None):
        """`config` (an AttentionConfig) replaces the table's, for the tuning sweep."""
        batch, seqlen_q, heads_q, head_dim = q.shape
        heads_kv = k_cache.shape[2]
        group = heads_q // heads_kv
        self.rows = seqlen_q * group
        self.block_d = head_dim_block(head_dim)
        self.capacity = _capacity(k_cache, block_table)
        self.page_size = k_cache.shape[1] if block_table is not None else 0
        device = info_for(q)
        cfg, splits = decode_schedule(device, q.element_size(), self.block_d, self.rows, k_cache.element_size(),
                                      batch * heads_kv, self.capacity, self.page_size, config)
        self.config = cfg
        self.block_m = cfg.block_m
        num_m_blocks = cdiv(self.rows, self.block_m)
        self.rows_padded = num_m_blocks * self.block_m
        splits = max(1, min(num_splits or splits, cdiv(max(self.capacity, 1), cfg.block_n)))
        self.split_len = decode_split_length(self.capacity, splits, cfg.block_n)
        self.num_splits = cdiv(max(self.capacity, 1), self.split_len)
        self.split_grid = (self.num_splits, batch * heads_kv, num_m_blocks)
        self.combine_grid = (batch * heads_kv, self.rows, 1)
        self.default_scale = 1.0 / math.sqrt(head_dim)
        self.window = kernel_window(causal, window_size)
        # Key blocks on page bounds, unless leftpad shifts them (`launch_decode`)
        self.aligned_pages = decode_aligned_pages(device, cfg, self.page_size, k_cache.element_size(),
                                                  math.prod(self.split_grid))
        self.device_index = q.device.index if q.device.type == "cuda" else None
        # The combine kernel as a programmatic dependent launch (griddepcontrol, sm90 on):
        # `_kernels/decode.py`'s docstring.
        self.pdl = q.is_cuda and pdl_runs(device)
        self.combine_options = launch_options(self.pdl)


def _plan_key(q, k_cache, v_cache, k, block_table, cache_seqlens, causal, window_size, softcap, return_lse,
              num_splits, cache_leftpad=None, k_descale=None, v_descale=None):
    """What fixes a call's plan and every kernel specialisation (the launchers' cache key): shapes,
    strides, alignment, dtypes, devices and options; not the values of an int cache length."""
    tensors = [t for t in (q, k_cache, v_cache, k, block_table, cache_leftpad, k_descale, v_descale) if t is not None]
    if isinstance(cache_seqlens, torch.Tensor):
        tensors.append(cache_seqlens)
    return (tuple(t.shape for t in tensors), tuple(t.stride() for t in tensors),
            tuple(t.data_ptr() % 16 for t in tensors), q.dtype, k_cache.dtype, q.device, block_table is not None,
            k is not None, cache_leftpad is not None, k_descale is not None, causal, window_size, softcap > 0,
            return_lse, num_splits)


def _lengths(cache_seqlens, placeholder) -> tuple:
    """(CACHE_SEQLENS, cache_len, LENGTHS_TENSOR) as the kernels take cache_seqlens: a tensor
    (`placeholder`, any tensor, stands in when it is an int, which travels as cache_len)."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens, 0, True
    return placeholder, int(cache_seqlens), False


def _append(new, cache, cache_seqlens, block_table, plan, key, scales=NO_SCALES, descale=None):
    """New keys or values into their cache (quantised with `descale` into an FP8 one, `scales` as
    `_cache_scales` says)."""
    batch, seqlen_new, heads_kv, head_dim = new.shape
    if new.numel() == 0:
        return
    table = block_table if block_table is not None else cache
    lengths, cache_len, lengths_tensor = _lengths(cache_seqlens, cache)
    _APPEND.launch(key, (batch * seqlen_new, heads_kv, 1),
                   (new, cache, lengths, table, descale if descale is not None else new, *new.stride()[:3],
                    *cache.stride()[:3], block_table.stride(0) if block_table is not None else 0,
                    *_scale_strides(descale), seqlen_new, cache_len, plan.capacity, cache.shape[0], head_dim,
                    plan.block_d, plan.page_size, lengths_tensor, scales),
                   num_warps=1, num_stages=1, device_index=plan.device_index)


def launch_decode(plan: DecodePlan, key, q, k_cache, v_cache, out, lse, cache_seqlens, block_table, seqlen_new,
                  softmax_scale, softcap, cache_leftpad=None, scales=NO_SCALES, k_descale=None,
                  v_descale=None) -> None:
    """Runs the split and combine kernels for a plan: writes out, shaped and laid out like q
    (B, Sq, Hq, D), and lse (B, Hq, Sq) unless None. `cache_seqlens` an int32 tensor or an int;
    `seqlen_new` new tokens already appended; `cache_leftpad` None or an int32 (B,) tensor. `key`
    (None: Triton's ordinary launch) must determine the plan, as `_plan_key` does (the forward's
    dispatch passes its own plan key). An FP8 cache passes its `scales` and descales
    (`_cache_scales`)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    if q.numel() == 0:
        return
    heads_kv = k_cache.shape[2]
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    q, scale = positive_scale(q, scale)
    softcap = float(softcap)
    cfg = plan.config
    single = plan.num_splits == 1
    write_lse = lse is not None
    # One split: the split kernel writes out and lse itself, and the workspace is a placeholder.
    if single:
        o_part = lse_part = torch.empty((1,), dtype=torch.float32, device=q.device)
    else:
        o_part = torch.empty((plan.num_splits, batch * heads_kv, plan.rows_padded, plan.block_d), dtype=torch.float32,
                             device=q.device)
        lse_part = torch.empty((plan.num_splits, batch * heads_kv, plan.rows_padded), dtype=torch.float32,
                               device=q.device)
    lengths, cache_len, lengths_tensor = _lengths(cache_seqlens, lse_part)
    table = block_table if block_table is not None else lse_part
    has_leftpad = int(cache_leftpad is not None)
    if cache_leftpad is None:
        # An int32 pointer for the kernels' cache_leftpad argument, never read: cache_seqlens, or a
        # fresh one-element buffer. Never a tensor a plan keeps: one made while torch.compile's
        # CUDA graphs record would stay alive in their memory pool, which they refuse.
        cache_leftpad = lengths if lengths_tensor else torch.empty(1, dtype=torch.int32, device=q.device)
    lse_arg, lse_strides = (lse, (lse.stride(0), lse.stride(1))) if write_lse else (lse_part, (0, 0))
    _SPLIT.launch(key, plan.split_grid,
                  (q, k_cache, v_cache, o_part, lse_part, out, lse_arg, lengths,
                   cache_leftpad, table, k_descale if scales else lse_part, v_descale if scales else lse_part,
                   scale * LOG2E,
                   scale / softcap if softcap else 0.0, softcap * LOG2E, *q.stride()[:3], *k_cache.stride()[:3],
                   *v_cache.stride()[:3], *out.stride()[:3], *lse_strides,
                   block_table.stride(0) if block_table is not None else 0, *_scale_strides(k_descale), heads_kv,
                   heads_q // heads_kv, seqlen_q, seqlen_new, cache_len, has_leftpad, plan.capacity,
                   k_cache.shape[0], plan.rows,
                   plan.rows_padded, plan.split_len, plan.num_splits, *plan.window, head_dim, plan.block_d,
                   plan.block_m, cfg.block_n, plan.page_size, softcap > 0, lengths_tensor, single, write_lse, scales,
                   plan.pdl, plan.aligned_pages and not has_leftpad),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, device_index=plan.device_index)
    if single:
        return
    _COMBINE.launch(key, plan.combine_grid,
                    (o_part, lse_part, out, lse_arg, *out.stride()[:3], *lse_strides, heads_kv, heads_q // heads_kv,
                     plan.rows_padded, plan.num_splits, head_dim, plan.block_d, DECODE_COMBINE_SPLITS, write_lse,
                     plan.pdl),
                    num_warps=DECODE_COMBINE_WARPS, num_stages=1, device_index=plan.device_index,
                    **plan.combine_options)


def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                                 cache_leftpad=None, causal=True, softmax_scale=None, window_size=NO_WINDOW,
                                 softcap=0.0, num_splits=0, return_lse=False, k_descale=None, v_descale=None):
    """Attention of q against a KV cache, as flash-attn's `flash_attn_with_kvcache`.

    Args:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32; Sq from 1 (decode) to a few hundred (speculative
            decoding, chunked prefill).
        k_cache, v_cache: (B, Sk_max, Hkv, D), or paged (num_pages, page_size, Hkv, D) with
            `block_table`; Hq a multiple of Hkv. Updated in place when k, v are given.
        k, v: optional new keys and values (B, Sq_new, Hkv, D), written at cache_seqlens[b] ...
            before attending; the caller advances cache_seqlens afterwards.
        cache_seqlens: int32 (B,) tensor or an int: tokens already in each sequence's cache. The
            call attends to cache_seqlens[b] + Sq_new keys.
        block_table: int32 (B, max_pages_per_sequence): the pages of each sequence, in order;
            page_size a multiple of 16.
        cache_leftpad: int32 (B,) tensor or None: where each sequence starts in its cache (the
            slots before are padding, as a left-padded batch leaves them). Sequence b is the
            cache positions cache_leftpad[b] to cache_seqlens[b] + Sq_new; causality and windows
            count from its start. A value outside [0, cache_seqlens[b]] makes b's outputs NaN.
        causal: bottom-right aligned (query i sees keys j <= i + Sk - Sq), as the other functions.
        softmax_scale, window_size, softcap: as for `flash_attention_science`.
        num_splits: key ranges attended to by separate programs (0: chosen from the shapes and
            the SM count, never from cache_seqlens' values).
        return_lse: also return lse (B, Hq, Sq) float32.
        k_descale, v_descale: an FP8 cache's descales (k_cache and v_cache in torch.float8_e4m3fn,
            q fp16, bf16 or fp32; sm89 and newer): float32, both None (1), both (B, Hkv), one per
            sequence and KV head (new values are divided by it and saturate at +-448 times it), or
            both shaped as the cache without its head dim ((B, Sk_max, Hkv), or paged (num_pages,
            page_size, Hkv)), one per cached token and KV head, which appends write for the new
            tokens. The cache is converted to q's dtype as it is read.

    A cache length, left padding or page id out of range, which can only be seen on the device, makes that
    sequence's outputs NaN; nothing outside the caches is read or written. Not differentiable.
    torch.compile traces it as one custom op, `flashmoe_science::attention_with_kvcache`, which
    mutates the caches (fullgraph, no graph break).

    Returns:
        out (B, Sq, Hq, D), or (out, lse) when return_lse.
    """
    check_options(causal, softmax_scale)
    window_size = check_band(window_size, softcap)
    check_bool("return_lse", return_lse)
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen from the shapes), got {num_splits!r}")
    _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad)
    if torch.compiler.is_compiling():  # through the custom op (ops.py): one graph node, the caches mutated
        if not isinstance(cache_seqlens, torch.Tensor):
            cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens or 0), dtype=torch.int32, device=q.device)
        # The op's descales are mutable arguments: never None and never one tensor twice. On the
        # H100 with torch 2.11, compiled calls with None descales failed in the fake-tensor trace
        # while those with descale tensors traced. A 16-bit cache passes empty placeholders, which
        # the op ignores.
        _, k_descale, v_descale = _cache_scales(q, k_cache, k_descale, v_descale)
        if k_cache.dtype != FP8_DTYPE:
            k_descale, v_descale = (q.new_empty((0,), dtype=torch.float32) for _ in range(2))
        elif k_descale is v_descale:
            v_descale = k_descale.clone()
        out, lse = torch.ops.flashmoe_science.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal, softmax_scale,
            window_size[0], window_size[1], float(softcap), int(num_splits), k_descale, v_descale)
        return (out, lse) if return_lse else out
    return _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal, softmax_scale,
                         window_size, softcap, num_splits, return_lse, k_descale, v_descale)


def _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal, softmax_scale,
                  window_size, softcap, num_splits, return_lse, k_descale=None, v_descale=None):
    """`flash_attention_with_kvcache` after its checks: the plan, the append, the launches."""
    scales, k_descale, v_descale = _cache_scales(q, k_cache, k_descale, v_descale)
    key = _plan_key(q, k_cache, v_cache, k, block_table, cache_seqlens, causal, window_size, softcap, return_lse,
                    num_splits, cache_leftpad, k_descale, v_descale)
    plan = PLANS.get(key) or PLANS.remember(key, DecodePlan(q, k_cache, block_table, causal, window_size,
                                                             num_splits))
    if k is not None:
        _append(k, k_cache, cache_seqlens, block_table, plan, key, scales, k_descale)
        _append(v, v_cache, cache_seqlens, block_table, plan, key, scales, v_descale)
    out = torch.empty_like(q)
    batch, seqlen_q, heads_q, _ = q.shape
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    launch_decode(plan, key, q, k_cache, v_cache, out, lse, cache_seqlens, block_table,
                  0 if k is None else k.shape[1], softmax_scale, softcap, cache_leftpad, scales, k_descale, v_descale)
    return (out, lse) if return_lse else out
