"""`flashmoe-science bench attention --mode decode`: one new token against a KV cache.

Per (batch B, cached length Sk, heads, head dim, cache layout): `flash_attention_with_kvcache`
on a contiguous cache and on paged ones (pages of 16 and 256 tokens, shuffled), against
PyTorch's SDPA on the same keys as (B, Hkv, Sk, D) tensors (`enable_gqa`, no causal mask: the
one query sees every cached key), each backend that runs timed and the fastest kept, and the
copy floor: the bytes of K and V the call must read over the copy bandwidth measured in the same
run. Rows carry GPU time (CUDA events), the fraction of the copy bandwidth reached, and each
side's error against float64 on the first sequence. Where GRAPH_LAYERS caches of the case fit
GRAPH_MAX_BYTES (the short and middle caches, where a call's time is latency rather than
bandwidth), ours (contiguous) and each SDPA backend that ran are also timed as a serving
framework runs them: one CUDA graph of GRAPH_LAYERS calls, each layer's against its own cache,
replayed (`graph_us`: per layer, no host time and no launch gaps; SDPA's fastest there, its
`graph_backend`, need not be the eager winner, whose samples can wait on the host); the paged
layouts too, each layer's cache paged on its own (`graph_vs_contiguous`: their time over the
contiguous cache's, which eager samples of such short calls cannot tell from host noise).
`ours_fp8_cache`: the contiguous cache in FP8 (e4m3, one descale per sequence and KV head), its
time against the bf16 cache's and its own copy floor (half the bytes), its error against float64
of the bf16 cache. Without a GPU: a tiny grid through the interpreter, errors only; `--quick`:
the same tiny grid on the GPU too.
"""
from __future__ import annotations

import torch

from ..attention import attention_reference, flash_attention_with_kvcache
from ..attention.fp8 import quantize_per_kv_head
from .common import measure_copy_bandwidth, rel_error
from .timing import graph_replay, speedup_interval, time_gpu

BATCHES = (1, 8, 32, 64, 128)
SEQLENS = (1024, 4096, 8192, 32768, 65536, 131072)
HEADS = ((32, 8, 128), (32, 32, 128), (32, 8, 64))  # (Hq, Hkv, D)
# (B, Sk, (Hq, Hkv, D)) cases beyond the grid: a Qwen3-30B-A3B decode step's attention at B 1 and
# 32 with 4k cached tokens, whose GRAPH_LAYERS-call graph is the attention of a whole step.
MODEL_CASES = ((1, 4096, (32, 4, 128)), (32, 4096, (32, 4, 128)))
PAGE_SIZES = (0, 16, 256)  # 0: contiguous
MAX_CACHE_BYTES = 16 << 30  # K and V of one case, to leave room for SDPA's copies
GRAPH_LAYERS = 32
GRAPH_MAX_BYTES = 8 << 30  # K and V of all the graph's layers
TINY_GRID = dict(batches=(1, 2), seqlens=(64, 160), heads=((4, 2, 32),), page_sizes=(0, 16))


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}


def paged_copy(k_cache, v_cache, page_size, generator=None):
    """(k_pages, v_pages, block_table): contiguous caches (B, Sk, Hkv, D) copied into shuffled
    pages of `page_size` tokens, as a paging allocator leaves them."""
    batch, capacity, heads, dim = k_cache.shape
    pages = capacity // page_size
    order = torch.randperm(batch * pages, generator=generator).to(k_cache.device)
    paged = []
    for cache in (k_cache, v_cache):
        copy = torch.empty_like(cache).view(batch * pages, page_size, heads, dim)
        copy[order] = cache.reshape(batch * pages, page_size, heads, dim)
        paged.append(copy)
    return paged[0], paged[1], order.view(batch, pages).to(torch.int32)


def _sdpa(backend, q, k_cache, v_cache):
    """SDPA with one backend on the caches' layout (B, Sk, Hkv, D) seen as (B, Hkv, Sk, D)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                                                v_cache.transpose(1, 2), enable_gqa=True)


def _fp8_cache(cache):
    """(the (B, Sk, Hkv, D) cache in e4m3, contiguous, its (B, Hkv) descales): one descale per
    sequence and KV head, as `fp8_attention_inputs` quantises k and v."""
    quantized, descale = quantize_per_kv_head(cache.transpose(1, 2), cache.shape[2])
    return quantized.transpose(1, 2).contiguous(), descale


def graph_us_per_call(call, caches, *, warmup_ms, rep_ms, repeats) -> float:
    """GPU time per call of one CUDA graph of `call(*layer)` over each layer's caches, e.g.
    (k_cache, v_cache), or with a block table (each layer's own, so the L2 holds none of the next
    one's)."""
    replay = graph_replay(lambda: [call(*layer) for layer in caches])
    t = time_gpu(replay, warmup_ms=warmup_ms, rep_ms=rep_ms, repeats=repeats)
    return t.median_ms * 1e3 / len(caches)


def run(args, device) -> list[dict]:
    gpu = device.type == "cuda"
    grid = (TINY_GRID if args.quick or not gpu
            else dict(batches=BATCHES, seqlens=SEQLENS, heads=HEADS, page_sizes=PAGE_SIZES))
    dtype = torch.bfloat16 if gpu else torch.float32
    copy_tbps = measure_copy_bandwidth() if gpu else None
    generator = torch.Generator().manual_seed(0)
    cases = [(b, s, h) for h in grid["heads"] for b in grid["batches"] for s in grid["seqlens"]
             if 2 * b * s * h[1] * h[2] * 2 <= MAX_CACHE_BYTES]
    cases += [] if args.quick or not gpu else list(MODEL_CASES)
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
                k_pages, v_pages, table = paged_copy(k_cache, v_cache, page_size, generator)
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
        k_pages = v_pages = table = None  # the largest cases fit the GPU only one copy at a time
        # An FP8 (e4m3) copy of the contiguous cache, one descale per sequence and KV head: half the bytes.
        (k8, k_descale), (v8, v_descale) = _fp8_cache(k_cache), _fp8_cache(v_cache)

        def ours_fp8():
            return flash_attention_with_kvcache(q, k8, v8, cache_seqlens=lengths, k_descale=k_descale,
                                                v_descale=v_descale)

        fp8_row = dict(case, impl="ours_fp8_cache", rel_err=rel_error(ours_fp8()[:1].transpose(1, 2), ref))
        if gpu and "ours" in timings:
            t = time_gpu(ours_fp8, warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
            fp8_floor = floor_ms * k8.element_size() / k_cache.element_size()
            ratio, lo, hi = speedup_interval(t, timings["ours"])
            fp8_row.update(us=t.median_ms * 1e3, floor_us=fp8_floor * 1e3, copy_fraction=fp8_floor / t.median_ms,
                           time_vs_bf16_cache=1 / ratio, time_vs_bf16_cache_ci=[1 / hi, 1 / lo])
        rows += ours_rows + [fp8_row]
        if not gpu:
            continue
        best, ran = None, {}
        for name, backend in _sdpa_backends().items():
            def theirs(backend=backend):
                return _sdpa(backend, q, k_cache, v_cache)
            try:
                err = rel_error(theirs()[:1], ref)
                t = time_gpu(theirs, warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
            except Exception:  # a backend that does not take this shape
                continue
            ran[name] = backend
            if best is None or t.median_ms < best[1].median_ms:
                best = (name, t, err)
        if best is not None:
            name, t, err = best
            sdpa_row = dict(case, impl="sdpa_best", backend=name, rel_err=err, us=t.median_ms * 1e3,
                            floor_us=floor_ms * 1e3, copy_fraction=floor_ms / t.median_ms)
            rows.append(sdpa_row)
            for row in ours_rows:
                ratio, lo, hi = speedup_interval(timings[row["impl"]], t)
                row.update(speedup_vs_sdpa=ratio, speedup_vs_sdpa_ci=[lo, hi])
            if GRAPH_LAYERS * 2 * k_cache.numel() * k_cache.element_size() <= GRAPH_MAX_BYTES:
                caches = [(k_cache, v_cache)] + [
                    (torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(GRAPH_LAYERS - 1)]
                timing = dict(warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
                ours_rows[0]["graph_us"] = graph_us_per_call(
                    lambda k, v: flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths), caches, **timing)
                # every backend that took the shape: the eager pick can be a host-noise winner
                graph_us = {name: graph_us_per_call(lambda k, v, b=backend: _sdpa(b, q, k, v), caches, **timing)
                            for name, backend in ran.items()}
                sdpa_row["graph_backend"] = min(graph_us, key=graph_us.get)
                sdpa_row["graph_us"] = graph_us[sdpa_row["graph_backend"]]
                ours_rows[0]["graph_speedup_vs_sdpa"] = sdpa_row["graph_us"] / ours_rows[0]["graph_us"]
                for row in ours_rows[1:]:  # the paged layouts, each layer's cache paged on its own
                    page_size = int(row["impl"].removeprefix("ours_paged"))
                    paged = [paged_copy(k, v, page_size, generator) for k, v in caches]
                    row["graph_us"] = graph_us_per_call(
                        lambda k, v, t: flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=t),
                        paged, **timing)
                    row["graph_vs_contiguous"] = row["graph_us"] / ours_rows[0]["graph_us"]
                    del paged
                del caches
        args.checkpoint(rows)
    return rows
