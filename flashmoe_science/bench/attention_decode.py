"""`flashmoe-science bench attention --mode decode`: one new token against a KV cache.

Per (batch B, cached length Sk, heads, head dim, cache layout): `flash_attention_with_kvcache`
on a contiguous cache and on paged ones (pages of 16 and 256 tokens, shuffled), against
PyTorch's SDPA on the same keys as (B, Hkv, Sk, D) tensors (`enable_gqa`, no causal mask: the
one query sees every cached key), each backend that runs timed and the fastest kept, and the
copy floor: the bytes of K and V the call must read over the copy bandwidth measured in the same
run. Rows carry GPU time (CUDA events), the fraction of the copy bandwidth reached, and each
side's error against float64 on the first sequence. Without a GPU: a tiny grid through the
interpreter, errors only.
"""
from __future__ import annotations

import torch

from ..attention import attention_reference, flash_attention_with_kvcache
from .common import measure_copy_bandwidth, rel_error
from .timing import speedup_interval, time_gpu

BATCHES = (1, 8, 32, 64, 128)
SEQLENS = (1024, 4096, 8192, 32768, 65536, 131072)
HEADS = ((32, 8, 128), (32, 32, 128), (32, 8, 64))  # (Hq, Hkv, D)
PAGE_SIZES = (0, 16, 256)  # 0: contiguous
MAX_CACHE_BYTES = 16 << 30  # K and V of one case, to leave room for SDPA's copies
INTERPRETER_GRID = dict(batches=(1, 2), seqlens=(64, 160), heads=((4, 2, 32),), page_sizes=(0, 16))


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}


def _paged(cache, page_size, generator):
    batch, capacity, heads, dim = cache.shape
    pages = capacity // page_size
    order = torch.randperm(batch * pages, generator=generator).to(cache.device)
    paged = torch.empty_like(cache).view(batch * pages, page_size, heads, dim)
    paged[order] = cache.reshape(batch * pages, page_size, heads, dim)
    return paged, order.view(batch, pages).to(torch.int32)


def run(args, device) -> list[dict]:
    gpu = device.type == "cuda"
    grid = (dict(batches=BATCHES, seqlens=SEQLENS, heads=HEADS, page_sizes=PAGE_SIZES) if gpu
            else INTERPRETER_GRID)
    dtype = torch.bfloat16 if gpu else torch.float32
    copy_tbps = measure_copy_bandwidth() if gpu else None
    generator = torch.Generator().manual_seed(0)
    cases = [(b, s, h) for h in grid["heads"] for b in grid["batches"] for s in grid["seqlens"]
             if 2 * b * s * h[1] * h[2] * 2 <= MAX_CACHE_BYTES]
    rows = []
    for batch, seqlen, (heads_q, heads_kv, dim) in args.progress(cases, desc="attention decode"):
        q = torch.randn(batch, 1, heads_q, dim, dtype=dtype, device=device)
        k_cache, v_cache = (torch.randn(batch, seqlen, heads_kv, dim, dtype=dtype, device=device) for _ in range(2))
        lengths = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
        case = dict(section="decode", mode="decode", batch=batch, seqlen=seqlen, heads_q=heads_q, heads_kv=heads_kv,
                    head_dim=dim, dtype=str(dtype).replace("torch.", ""))
        ref, _ = attention_reference(q[:1].transpose(1, 2).double(), k_cache[:1].transpose(1, 2).double(),
                                     v_cache[:1].transpose(1, 2).double())
        floor_ms = 2 * k_cache.numel() * k_cache.element_size() / (copy_tbps * 1e12) * 1e3 if gpu else None
        timings, ours_rows = {}, []
        for page_size in grid["page_sizes"]:
            if page_size and seqlen % page_size:
                continue
            if page_size:
                k_pages, table = _paged(k_cache, page_size, generator)
                v_pages = torch.empty_like(k_pages)
                v_pages[table.flatten().long()] = v_cache.reshape(-1, page_size, heads_kv, dim)
            else:
                k_pages, v_pages, table = k_cache, v_cache, None

            def ours():
                return flash_attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table)

            row = dict(case, impl="ours" if not page_size else f"ours_paged{page_size}",
                       rel_err=rel_error(ours()[:1].transpose(1, 2), ref))
            if gpu:
                t = timings[row["impl"]] = time_gpu(ours, warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
                row.update(us=t.median_ms * 1e3, floor_us=floor_ms * 1e3, copy_fraction=floor_ms / t.median_ms)
            ours_rows.append(row)
        rows += ours_rows
        if not gpu:
            continue
        qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        best = None
        for name, backend in _sdpa_backends().items():
            from torch.nn.attention import sdpa_kernel

            def theirs(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            try:
                err = rel_error(theirs()[:1], ref)
                t = time_gpu(theirs, warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
            except Exception:  # a backend that does not take this shape
                continue
            if best is None or t.median_ms < best[1].median_ms:
                best = (name, t, err)
        if best is not None:
            name, t, err = best
            rows.append(dict(case, impl="sdpa_best", backend=name, rel_err=err, us=t.median_ms * 1e3,
                             floor_us=floor_ms * 1e3, copy_fraction=floor_ms / t.median_ms))
            for row in ours_rows:
                ratio, lo, hi = speedup_interval(timings[row["impl"]], t)
                row.update(speedup_vs_sdpa=ratio, speedup_vs_sdpa_ci=[lo, hi])
        args.checkpoint(rows)
    return rows
