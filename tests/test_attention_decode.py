"""flash_attention_with_kvcache: attention against a contiguous or paged KV cache, with split-KV,
against the float64 reference of each sequence's visible keys.

On the CPU these run through Triton's interpreter in fp32 and fp16 at small sizes; the GPU tests
(marked `gpu`) add bf16, realistic sizes, PyTorch's own error and CUDA-graph replay.
"""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashmoe_science import flash_attention_with_kvcache
from flashmoe_science.attention import attention_reference
from flashmoe_science.attention import decode as decode_module
from flashmoe_science.device import SHARED_MEMORY_PER_BLOCK, DeviceInfo
from flashmoe_science.launch import clear_records, last_launch
from test_attention_forward import rel_error


def reference(q, k_cache, v_cache, lengths, causal=True, starts=None, **options):
    """Per sequence: float64 attention of q (B, Sq, Hq, D) over its cached keys starts[b] (0 by
    default) to lengths[b]; out (B, Sq, Hq, D) and lse (B, Hq, Sq)."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        first = starts[b] if starts is not None else 0
        q_b = q[b:b + 1].transpose(1, 2).double()
        k_b, v_b = (t[b:b + 1, first:n].transpose(1, 2).double() for t in (k_cache, v_cache))
        out, lse = attention_reference(q_b, k_b, v_b, causal=causal, **options)
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def paged(k_cache, page_size, generator=None):
    """The contiguous cache (B, Sk_max, Hkv, D) as shuffled pages (num_pages, page_size, Hkv, D) and
    the block table (B, Sk_max / page_size) that finds them, with spare pages of NaN between."""
    batch, capacity, heads, dim = k_cache.shape
    per_seq = capacity // page_size
    num_pages = 2 * batch * per_seq
    order = torch.randperm(num_pages, generator=generator)[:batch * per_seq]
    pages = torch.full((num_pages, page_size, heads, dim), float("nan"), dtype=k_cache.dtype)
    pages[order] = k_cache.reshape(batch * per_seq, page_size, heads, dim)
    return pages, order.reshape(batch, per_seq).to(torch.int32)


def pages_like(cache, pages, table):
    """`cache` laid out in the pages `table` gave another cache of the same shape."""
    out = torch.full_like(pages, float("nan"))
    out[table.flatten().long()] = cache.reshape(-1, *pages.shape[1:])
    return out


def make_cache(batch, capacity, heads_kv, dim, dtype, device, lengths):
    """Caches holding NaN past each sequence's length: nothing there may reach an output."""
    k_cache, v_cache = (torch.randn(batch, capacity, heads_kv, dim, dtype=dtype) for _ in range(2))
    for b, n in enumerate(lengths):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    return k_cache.to(device), v_cache.to(device)


CASES = [  # B, Sq, Hq, Hkv, D, capacity, lengths, options
    (2, 1, 8, 2, 64, 96, [37, 96], {}),                                  # decode, GQA 4, one full cache
    (3, 4, 8, 1, 32, 64, [0, 16, 63], {}),                               # MQA 8, an empty and page-edge lengths
    (1, 16, 4, 4, 48, 80, [80], dict(window_size=(20, 0))),              # Sq 16, a causal window, padded D
    (2, 3, 6, 3, 32, 64, [10, 50], dict(softcap=5.0, softmax_scale=0.3)),
    (2, 2, 4, 2, 16, 48, [5, 48], dict(causal=False)),
]


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("B,Sq,Hq,Hkv,D,capacity,lengths,options", CASES)
def test_contiguous_and_paged_caches_match_reference(B, Sq, Hq, Hkv, D, capacity, lengths, options, num_splits,
                                                     device):
    dtype = torch.float32
    q = torch.randn(B, Sq, Hq, D, dtype=dtype, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, dtype, device, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    causal = options.pop("causal", True)
    out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal,
                                            num_splits=num_splits, return_lse=True, **options)
    ref, ref_lse = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths, causal, **options)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert torch.all(out.cpu().transpose(1, 2)[~seen] == 0)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen].double(), atol=2e-5, rtol=1e-5)
    for page_size in (16, 32):
        if capacity % page_size:
            continue
        k_pages, table = paged(k_cache.cpu(), page_size)
        v_pages = pages_like(v_cache.cpu(), k_pages, table)
        out_paged = flash_attention_with_kvcache(q, k_pages.to(device), v_pages.to(device), cache_seqlens=seqlens,
                                                 block_table=table.to(device), causal=causal, num_splits=num_splits,
                                                 **options)
        assert torch.equal(out_paged, out), page_size  # the same tiles in the same order: the same bits


def test_more_splits_than_one_combine_load(device):
    """40 splits of one key block each: the combine kernel folds them DECODE_COMBINE_SPLITS at a
    time; the short sequence leaves most splits empty (lse -inf), the long one fills every one."""
    from flashmoe_science.attention.configs import DECODE_COMBINE_SPLITS
    from flashmoe_science.attention.decode import DecodePlan
    num_splits = 40
    B, Sq, Hq, Hkv, D, capacity, lengths = 2, 2, 4, 2, 16, 40 * 64, [70, 2560]
    q = torch.randn(B, Sq, Hq, D, device=device) * 3  # spread the splits' lse
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float32, device, lengths)
    plan = DecodePlan(q, k_cache, None, True, (-1, -1), num_splits)
    assert plan.num_splits == num_splits > 2 * DECODE_COMBINE_SPLITS
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                            return_lse=True)
    ref, ref_lse = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu().double(), ref_lse.double(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("paged_cache", [False, True])
def test_new_keys_are_appended_in_place_before_attending(paged_cache, device):
    B, Sq, Hq, Hkv, D, capacity = 3, 2, 4, 2, 32, 64
    lengths = [0, 17, 62]
    q = torch.randn(B, Sq, Hq, D, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float32, device, lengths)
    k_new, v_new = (torch.randn(B, Sq, Hkv, D, device=device) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        expected_k[b, n:n + Sq] = k_new[b]
        expected_v[b, n:n + Sq] = v_new[b]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if paged_cache:
        k_pages, table = paged(k_cache.cpu(), 16)
        v_pages = pages_like(v_cache.cpu(), k_pages, table)
        k_cache, v_cache, table = k_pages.to(device), v_pages.to(device), table.to(device)
    else:
        table = None
    out = flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table)
    if paged_cache:  # back to the contiguous layout
        k_cache = k_cache[table.flatten().long()].reshape(B, capacity, Hkv, D)
        v_cache = v_cache[table.flatten().long()].reshape(B, capacity, Hkv, D)
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, atol=0, rtol=0)
    ref, _ = reference(q.cpu(), expected_k.cpu(), expected_v.cpu(), [n + Sq for n in lengths])
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-4)


def test_fp16_and_an_int_length(device):
    B, Sq, Hq, Hkv, D, capacity = 2, 1, 8, 2, 64, 64
    q = torch.randn(B, Sq, Hq, D, dtype=torch.float16, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float16, device, [40, 40])
    out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=40, num_splits=2)
    ref, _ = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), [40, 40])
    theirs, _ = reference(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), [40, 40])
    assert rel_error(out.cpu(), ref) <= 2 * rel_error(theirs.half(), ref) + 1e-4


@pytest.mark.parametrize("D,tile,num_splits", [(128, "stream1", 1), (128, "stream2", 3), (64, "stream1", 2),
                                                (64, "stream2", 1), (128, "few", 3)])
def test_hopper_regime_tiles_match_reference(D, tile, num_splits, device):
    """`configs.decode_schedule`'s Hopper tiles (DECODE_STREAM_TILES at D = 128 and 64's doubled
    keys, DECODE_FEW_TILE), forced through DecodePlan on any device: fp16, a capacity no whole
    number of their key blocks, sequences ending mid-block and an empty one, one split writing the
    output itself and several through the combine kernel."""
    from flashmoe_science.attention.configs import DECODE_FEW_TILE, decode_stream_tile
    from flashmoe_science.attention.decode import DecodePlan, launch_decode

    cfg = DECODE_FEW_TILE if tile == "few" else decode_stream_tile(int(tile[-1]), D)
    B, Hq, Hkv, capacity, lengths = 3, 8, 2, 600, [600, 301, 0]
    q = torch.randn(B, 1, Hq, D, dtype=torch.float16, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float16, device, lengths)
    plan = DecodePlan(q, k_cache, None, True, (-1, -1), num_splits, config=cfg)
    assert plan.config == cfg and plan.num_splits == num_splits
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, 1), float("nan"), dtype=torch.float32, device=device)
    launch_decode(plan, None, q, k_cache, v_cache, out, lse, torch.tensor(lengths, dtype=torch.int32, device=device),
                  None, 0, None, 0.0)
    ref, ref_lse = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths)
    theirs, _ = reference(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), lengths)
    assert torch.all(out[2].cpu() == 0) and torch.all(lse[2].cpu() == float("-inf"))  # the empty sequence
    assert rel_error(out[:2].cpu(), ref[:2]) <= 2 * rel_error(theirs[:2].half(), ref[:2]) + 1e-4
    torch.testing.assert_close(lse[:2].cpu().double(), ref_lse[:2].double(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("page_size,block_n,aligned", [(16, 64, True), (64, 32, True), (64, 64, True),
                                                       (48, 32, False)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("leftpad", [False, True])
def test_page_layouts_match_the_contiguous_cache(page_size, block_n, aligned, num_splits, leftpad, device):
    """Every way a key block meets pages: several pages a block, several blocks a page, one each,
    and page sizes no multiple or divisor of the block (the per-key path, as is any call with
    leftpad); the same bits as the contiguous cache under the same tile, a page id out of range
    poisoning its sequence only, and the kernel told which path it takes (aligned blocks, taken
    on Hopper, forced here)."""
    from flashmoe_science.attention.configs import AttentionConfig
    from flashmoe_science.attention.decode import DecodePlan, launch_decode

    B, Hq, Hkv, D, capacity, lengths = 3, 4, 2, 32, 192, [192, 101, 150]
    q = torch.randn(B, 1, Hq, D, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float32, device, lengths)
    k_pages, table = paged(k_cache.cpu(), page_size)
    v_pages = pages_like(v_cache.cpu(), k_pages, table)
    table[2, 1] = k_pages.shape[0]  # visible and out of range: sequence 2 only turns NaN
    k_pages, v_pages, table = k_pages.to(device), v_pages.to(device), table.to(device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    starts = torch.tensor([5, 0, 17] if leftpad else [0, 0, 0], dtype=torch.int32, device=device)
    cfg = AttentionConfig(16, block_n, 4, 2)
    outs = []
    for k, v, t in ((k_cache, v_cache, None), (k_pages, v_pages, table)):
        plan = DecodePlan(q, k, t, True, (-1, -1), num_splits, config=cfg)
        plan.aligned_pages = t is not None and aligned  # as on Hopper, on any device
        out = torch.full_like(q, float("nan"))
        clear_records()
        launch_decode(plan, None, q, k, v, out, None, seqlens, t, 0, None, 0.0, cache_leftpad=starts if leftpad else None)
        outs.append(out)
    constexprs = last_launch("attention_decode_split").constexprs
    assert constexprs["ALIGNED_PAGES"] == (aligned and not leftpad)
    assert torch.equal(outs[1][:2], outs[0][:2])
    assert torch.isnan(outs[1][2]).all()
    ref, _ = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths, starts=starts.tolist())
    torch.testing.assert_close(outs[0].cpu().double(), ref, atol=2e-5, rtol=1e-4)


def test_malformed_device_values_poison_their_sequence_only(device):
    """Lengths past the cache and page ids out of range are device values no host check sees:
    the sequence they belong to gets NaN, the others their right answers, and nothing outside the
    cache is read or written."""
    B, Sq, Hq, Hkv, D, capacity = 3, 1, 4, 2, 32, 64
    q = torch.randn(B, Sq, Hq, D, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float32, device, [capacity] * B)
    good = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), [20, 30, 40])[0]
    for lengths in ([20, 65, 40], [20, -1, 40]):
        out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                                                                           device=device))
        assert torch.isnan(out[1]).all()
        torch.testing.assert_close(out[[0, 2]].cpu().double(), good[[0, 2]], atol=2e-5, rtol=1e-4)
    k_pages, table = paged(k_cache.cpu(), 16)
    v_pages = pages_like(v_cache.cpu(), k_pages, table)
    table[1, 1] = k_pages.shape[0]  # a visible page out of range
    table[2, 3] = -5  # a page past the sequence's length: never read, harmless
    out = flash_attention_with_kvcache(q, k_pages.to(device), v_pages.to(device), block_table=table.to(device),
                                       cache_seqlens=torch.tensor([20, 30, 40], dtype=torch.int32, device=device))
    assert torch.isnan(out[1]).all()
    torch.testing.assert_close(out[[0, 2]].cpu().double(), good[[0, 2]], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("paged_cache", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("Sq,options", [(1, {}), (3, dict(window_size=(9, 0), softcap=4.0)), (2, dict(causal=False))])
def test_left_padded_sequences_attend_from_their_start(Sq, options, num_splits, paged_cache, device):
    """cache_leftpad[b]: sequence b occupies cache positions leftpad[b] to its length, the slots
    before hold padding (NaN here: nothing of them may reach an output); causality and windows
    count from the sequence's start, with new keys appended at cache_seqlens[b]."""
    B, Hq, Hkv, D, capacity = 4, 4, 2, 32, 64
    lengths, leftpad = [40, 40, 64, 17], [0, 7, 50, 17]  # none, some, most, all of the sequence is padding
    q = torch.randn(B, Sq, Hq, D, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float32, device, lengths)
    for b, first in enumerate(leftpad):
        k_cache[b, :first] = float("nan")
        v_cache[b, :first] = float("nan")
    k_new, v_new = (torch.randn(B, Sq, Hkv, D, device=device) for _ in range(2))
    seqlens = torch.tensor([n - Sq for n in lengths], dtype=torch.int32, device=device)
    pad = torch.tensor(leftpad, dtype=torch.int32, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        expected_k[b, n - Sq:n] = k_new[b]
        expected_v[b, n - Sq:n] = v_new[b]
    pad[3] = lengths[3] - Sq  # the padding runs up to the new tokens: they are the whole sequence
    leftpad[3] = lengths[3] - Sq
    table = None
    if paged_cache:
        k_cache, table = paged(k_cache.cpu(), 16)
        v_cache = pages_like(v_cache.cpu(), k_cache, table)
        k_cache, v_cache, table = k_cache.to(device), v_cache.to(device), table.to(device)
    causal = options.pop("causal", True)
    out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                            cache_leftpad=pad, block_table=table, causal=causal,
                                            num_splits=num_splits, return_lse=True, **options)
    ref, ref_lse = reference(q.cpu(), expected_k.cpu(), expected_v.cpu(), lengths, causal, starts=leftpad, **options)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen].double(), atol=2e-5, rtol=1e-5)


def test_left_padding_out_of_range_poisons_its_sequence_only(device):
    B, Sq, Hq, Hkv, D, capacity = 3, 1, 4, 2, 32, 64
    q = torch.randn(B, Sq, Hq, D, device=device)
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.float32, device, [capacity] * B)
    lengths = torch.tensor([20, 30, 40], dtype=torch.int32, device=device)
    good = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), [20, 30, 40], starts=[2, 0, 5])[0]
    for bad in (31, -1, 2**31 - 1):
        pad = torch.tensor([2, bad, 5], dtype=torch.int32, device=device)
        out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=pad)
        assert torch.isnan(out[1]).all(), bad
        torch.testing.assert_close(out[[0, 2]].cpu().double(), good[[0, 2]], atol=2e-5, rtol=1e-4)


def test_empty_cache_and_empty_batch(device):
    q = torch.randn(2, 1, 4, 32, device=device)
    k_cache = torch.randn(2, 16, 2, 32, device=device)
    out, lse = flash_attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=0, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    empty = flash_attention_with_kvcache(q[:0], k_cache[:0], k_cache[:0], cache_seqlens=0)
    assert empty.shape == (0, 1, 4, 32)


def test_records_the_split_kernel(device):
    q = torch.randn(1, 1, 8, 64, device=device)
    k_cache = torch.randn(1, 256, 2, 64, device=device)
    clear_records()
    flash_attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=200, num_splits=4)
    assert last_launch("attention_decode_split").grid[0] == 4
    assert last_launch("attention_decode_combine") is not None


@pytest.mark.parametrize("call,message", [
    (lambda q, c, t: flash_attention_with_kvcache(q[0], c, c, cache_seqlens=1), "q must have 4 dimensions"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c[..., :16], cache_seqlens=1), "same shape"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c), "cache_seqlens .* is required"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=33), "does not fit"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t.long()), "int32"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t[:1]), r"shape \(2,\)"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c[:, :24], c[:, :24], cache_seqlens=t, block_table=t[:, None]),
     "multiple of 16"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t, block_table=t[:, None].long()),
     "block_table has dtype"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, c[:, :1], cache_seqlens=t), "both k and v"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t, num_splits=-1), "num_splits"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t, causal=1), "causal must be a bool"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c[:1], c[:1], cache_seqlens=t), "batch size"),
    (lambda q, c, t: flash_attention_with_kvcache(q[..., :3, :], c, c, cache_seqlens=t), "multiple of the caches'"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t, cache_leftpad=t.long()),
     "cache_leftpad must be a contiguous int32"),
    (lambda q, c, t: flash_attention_with_kvcache(q, c, c, cache_seqlens=t, cache_leftpad=3), "cache_leftpad must be an"),
])
def test_bad_arguments_are_named(call, message, device):
    q = torch.randn(2, 1, 4, 32, device=device)
    cache = torch.randn(2, 32, 2, 32, device=device)
    lengths = torch.tensor([3, 5], dtype=torch.int32, device=device)
    with pytest.raises((ValueError, TypeError), match=message):
        call(q, cache, lengths)


@pytest.mark.parametrize("Sq,Hq,Hkv,Sk,options", [(1, 8, 2, 700, {}), (3, 4, 4, 600, dict(window_size=(100, 0))),
                                                  (2, 8, 1, 520, dict(softcap=3.0, softmax_scale=-0.2))])
def test_dense_short_queries_take_the_kv_cache_kernels(Sq, Hq, Hkv, Sk, options, device):
    """flash_attention_science with a few queries against many keys (a model decoding with its
    cache) runs the split-KV kernels by itself: outputs and lse against float64, and gradients
    through the backward kernels from its out and lse."""
    from flashmoe_science import flash_attention_science
    from test_attention_backward import assert_grads_close

    q = torch.randn(2, Sq, Hq, 32, device=device).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, Sk, Hkv, 32, device=device).transpose(1, 2).requires_grad_() for _ in range(2))
    clear_records()
    out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True, **options)
    assert last_launch("attention_decode_split") is not None and last_launch("attention_forward") is None
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=True, **options)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-5, rtol=1e-5)
    assert out.stride() == q.stride()
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(attention_reference(*leaves, causal=True, **options)[0], leaves, grad_out.double())
    assert_grads_close(grads, refs, torch.float32)


@contextlib.contextmanager
def planning_as(device_info):
    """Decode plans made as on `device_info` (None: the real device), none kept past the block."""
    if device_info is None:
        yield
        return
    decode_module.PLANS.clear()
    try:
        with mock.patch.object(decode_module, "info_for", lambda tensor: device_info):
            yield
    finally:
        decode_module.PLANS.clear()


@given(st.data())
def test_any_cache_matches_reference(data):
    """Property: any batch, query length, GQA ratio, head dim, dtype, capacity, page size, lengths
    (including 0 and full; a tensor or, when all equal, an int), new keys appended in place (none,
    or as many as the queries), left padding, split count, window, softcap and scale, contiguous
    and paged alike; the caches afterwards hold exactly the appended keys and values. On the CPU,
    some examples plan as on a Hopper GPU of a few SMs (its stream, few-tile and busy regimes,
    page-aligned key blocks, PDL), so that those kernels' paths meet every input class too."""
    draw = data.draw
    heads_kv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    batch, seqlen_q = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    dim = draw(st.sampled_from([16, 24, 32, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    page_size = draw(st.sampled_from([0, 16, 32]))
    capacity = draw(st.integers(1, 5)) * 32
    new = draw(st.sampled_from([0, 0, seqlen_q]))
    lengths = [draw(st.integers(0, capacity - new)) for _ in range(batch)]
    if draw(st.booleans()):
        lengths = [lengths[0]] * batch
    starts = [draw(st.integers(0, n)) for n in lengths] if draw(st.booleans()) else None
    options = dict(softmax_scale=draw(st.sampled_from([None, 0.5, -0.3])),
                   softcap=draw(st.sampled_from([0.0, 2.0])),
                   window_size=(draw(st.sampled_from([-1, 0, 7, 40])), -1))
    causal = draw(st.booleans())
    num_splits = draw(st.sampled_from([0, 1, 2, 5]))
    int_length = len(set(lengths)) == 1 and draw(st.booleans())
    q = torch.randn(batch, seqlen_q, heads_kv * group, dim).to(dtype)
    k_cache, v_cache = make_cache(batch, capacity, heads_kv, dim, dtype, "cpu", lengths)
    k_new, v_new = (torch.randn(batch, new, heads_kv, dim).to(dtype) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        expected_k[b, n:n + new], expected_v[b, n:n + new] = k_new[b], v_new[b]
    seqlens = lengths[0] if int_length else torch.tensor(lengths, dtype=torch.int32)
    table = None
    if page_size:
        k_cache, table = paged(k_cache, page_size)
        v_cache = pages_like(v_cache, k_cache, table)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    hopper_sms = draw(st.sampled_from([None, None, 1, 3, 8])) if device == "cpu" else None
    planned_as = DeviceInfo("probe", 90, hopper_sms, SHARED_MEMORY_PER_BLOCK[90], 0) if hopper_sms else None
    with planning_as(planned_as):
        out, lse = flash_attention_with_kvcache(
            q.to(device), k_cache, v_cache, *((k_new.to(device), v_new.to(device)) if new else ()),
            cache_seqlens=seqlens if int_length else seqlens.to(device),
            block_table=None if table is None else table.to(device),
            cache_leftpad=None if starts is None else torch.tensor(starts, dtype=torch.int32, device=device),
            causal=causal, num_splits=num_splits, return_lse=True, **options)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    if table is not None:
        k_cache = k_cache[table.flatten().long()].reshape(batch, capacity, heads_kv, dim)
        v_cache = v_cache[table.flatten().long()].reshape(batch, capacity, heads_kv, dim)
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, atol=0, rtol=0)
    ref, ref_lse = reference(q, expected_k, expected_v, [n + new for n in lengths], causal, starts, **options)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert torch.all(out.cpu().transpose(1, 2)[~seen] == 0), "rows that see no key are 0"
    # The GPU's fp32 products may run as TF32; fp16 rounds q, k, v and the output.
    tol = 3e-2 if out.is_cuda else 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen].double(), atol=tol, rtol=tol)


# ---- GPU: bf16, realistic sizes, PyTorch's own error, CUDA graphs ----

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16, 256])
@pytest.mark.parametrize("B,Sq,Hq,Hkv,D,capacity", [(1, 1, 32, 8, 128, 65536), (8, 1, 32, 8, 128, 8192),
                                                    (64, 1, 32, 32, 64, 2048), (4, 8, 32, 8, 256, 4096),
                                                    (2, 1, 16, 2, 96, 3000)])
def test_gpu_decode_within_twice_pytorch(B, Sq, Hq, Hkv, D, capacity, page_size):
    if page_size and capacity % page_size:
        pytest.skip("the capacity is not a whole number of pages")
    _check_against_pytorch(B, Sq, Hq, Hkv, D, capacity, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,D,capacity,regime", [(1, 4, 128, 2048, "few"), (16, 8, 128, 2048, "stream"),
                                                      (32, 8, 128, 2048, "stream"), (16, 8, 64, 2048, "stream"),
                                                      (32, 8, 64, 2048, "stream"), (1, 8, 128, 32768, "stream"),
                                                      (8, 8, 64, 4096, "stream")])
def test_gpu_decode_regimes_within_twice_pytorch(B, Hkv, D, capacity, regime):
    """The tiles of `configs.decode_schedule`'s regimes (on an H100 or H200: DECODE_FEW_TILE, and
    DECODE_STREAM_TILES in one split or, over long caches, several), sequences of every length up
    to the capacity."""
    from flashmoe_science.attention.configs import DECODE_FEW_TILE, decode_stream_tile
    from flashmoe_science.attention.decode import DecodePlan

    q = torch.empty(B, 1, 32, D, dtype=torch.bfloat16, device="cuda")
    plan = DecodePlan(q, torch.empty(B, capacity, Hkv, D, dtype=torch.bfloat16, device="cuda"), None, True,
                      (-1, -1), 0)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper and torch.cuda.get_device_properties(0).multi_processor_count == 132:
        expected = DECODE_FEW_TILE if regime == "few" else decode_stream_tile(-(-B * Hkv // 132), D)
        assert plan.config == expected and (plan.num_splits == 1) == (regime == "stream" and B * Hkv > 64)
    _check_against_pytorch(B, 1, 32, Hkv, D, capacity, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,D,capacity,page_size", [(1, 8, 128, 8192, 16), (32, 8, 128, 2048, 256),
                                                         (64, 8, 128, 2048, 16), (128, 8, 64, 1024, 64),
                                                         (8, 8, 64, 4096, 16), (1, 8, 128, 32768, 256)])
def test_gpu_paged_regimes_within_twice_pytorch(B, Hkv, D, capacity, page_size):
    """Paged caches in the few-tile, stream and busy regimes, through the page-aligned key blocks
    on Hopper (`configs.decode_aligned_pages`)."""
    from flashmoe_science.attention.decode import DecodePlan

    q = torch.empty(B, 1, 32, D, dtype=torch.bfloat16, device="cuda")
    pages = torch.empty(B * capacity // page_size, page_size, Hkv, D, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(B, capacity // page_size, dtype=torch.int32, device="cuda")
    plan = DecodePlan(q, pages, table, True, (-1, -1), 0)
    assert plan.aligned_pages == (torch.cuda.get_device_capability() == (9, 0))
    _check_against_pytorch(B, 1, 32, Hkv, D, capacity, page_size)


def _check_against_pytorch(B, Sq, Hq, Hkv, D, capacity, page_size):
    """Each sequence's output against float64 attention, within twice PyTorch's own bf16 error;
    random lengths (the first the whole capacity), pages in a random order."""
    generator = torch.Generator().manual_seed(B * capacity)
    lengths = torch.randint(0, capacity + 1, (B,), generator=generator).tolist()
    lengths[0] = capacity
    q = torch.randn(B, Sq, Hq, D, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = make_cache(B, capacity, Hkv, D, torch.bfloat16, "cpu", lengths)
    table = None
    if page_size:
        k_pages, table = paged(k_cache, page_size, generator)
        k_cache, v_cache, table = k_pages, pages_like(v_cache, k_pages, table), table.cuda()
    out = flash_attention_with_kvcache(q, k_cache.cuda(), v_cache.cuda(), block_table=table,
                                       cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    contiguous_k = k_cache if not page_size else k_cache[table.cpu().flatten().long()].reshape(B, capacity, Hkv, D)
    contiguous_v = v_cache if not page_size else v_cache[table.cpu().flatten().long()].reshape(B, capacity, Hkv, D)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.all(out[b] == 0)
            continue
        qb = q[b:b + 1].transpose(1, 2)
        kb, vb = (t[b:b + 1, :n].cuda().transpose(1, 2) for t in (contiguous_k, contiguous_v))
        ref, _ = attention_reference(qb.double(), kb.double(), vb.double(), causal=True)
        theirs, _ = attention_reference(qb, kb, vb, causal=True, upcast=False)
        assert rel_error(out[b:b + 1].transpose(1, 2), ref) <= 2 * rel_error(theirs, ref) + 1e-4, b


@pytest.mark.gpu
def test_gpu_cached_launches_follow_the_options_and_an_int_length():
    """Calls of one shape one after another: each takes its own softcap, lse and int cache length
    (a launch cached for one must not serve another)."""
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (torch.randn(2, 4096, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for length, softcap, return_lse in ((4096, 0.0, False), (1000, 5.0, True), (17, 0.0, True), (4095, 5.0, False)):
        out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, softcap=softcap,
                                           return_lse=return_lse)
        out = out[0] if return_lse else out
        ref, _ = reference(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), [length] * 2,
                           softcap=softcap)
        assert rel_error(out.cpu(), ref) < 2e-2, (length, softcap, return_lse)


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_a_cuda_graph_with_new_lengths_and_pages():
    B, Hq, Hkv, D, page_size, pages_per_seq = 4, 32, 8, 128, 16, 64
    num_pages = B * pages_per_seq + 8
    k_pages, v_pages = (torch.randn(num_pages, page_size, Hkv, D, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    table = torch.arange(B * pages_per_seq, dtype=torch.int32, device="cuda").reshape(B, pages_per_seq)
    lengths = torch.tensor([100, 300, 17, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, Hq, D, dtype=torch.bfloat16, device="cuda")
    k_new, v_new = (torch.randn(B, 1, Hkv, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def step():
        return flash_attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=lengths, block_table=table)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for new_lengths in ([5, 600, 33, 0], [1000, 1, 2, 512]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        table.copy_(table.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        expected = step()  # eager, the same inputs (the append writes the same values again)
        assert torch.equal(static_out, expected)
