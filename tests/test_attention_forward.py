"""Attention forward: correctness against the float64 reference, edge cases, bad input.

On the CPU these run through Triton's interpreter in fp32 and fp16 at small sizes; the GPU
tests (marked `gpu`) add bf16 and realistic sizes, and compare our error with PyTorch's own.
"""
import math

import pytest
import torch

from flashmoe_science import flash_attention_forward, flash_attention_science
from flashmoe_science.attention import attention_reference
from flashmoe_science.attention.configs import head_dim_block

CPU_DTYPES = [torch.float32, torch.float16]


def rel_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, device, layout="bhsd"):
    """Fresh random inputs; layout "bshd" gives the (B, S, H, D).transpose(1, 2) views models pass."""
    if layout == "bshd":
        q = torch.randn(B, Sq, Hq, D, dtype=dtype, device=device).transpose(1, 2)
        k = torch.randn(B, Sk, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
        v = torch.randn(B, Sk, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Sq, D, dtype=dtype, device=device)
        k = torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device)
        v = torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device)
    return q, k, v


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def max_error_tolerance(t):
    """Max-abs error bound relative to the largest reference value, for t's dtype and device:
    fp32 products run in tf32 (a 10-bit mantissa) on the GPU."""
    return 1e-2 if t.is_cuda and t.dtype == torch.float32 else TOL[t.dtype]


def lse_tolerance(t):
    """Absolute bound on lse errors for t's dtype and device."""
    if t.dtype == torch.float32:
        return 2e-2 if t.is_cuda else 1e-5
    return 3e-3


def check_against_reference(q, k, v, causal, softmax_scale=None):
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in the output (an unwritten or 0/0 element)"
    tf32 = q.device.type == "cuda" and q.dtype == torch.float32  # fp32 dots run in tf32 on the GPU
    assert rel_error(out, ref) < (3e-3 if tf32 else TOL[q.dtype])
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key must have lse = -inf"
    assert torch.all(lse[~seen] == float("-inf"))
    lse_tol = 2e-2 if tf32 else (1e-5 if q.dtype == torch.float32 else 3e-3)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=lse_tol, rtol=1e-4)
    return out, lse


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [
    (2, 2, 2, 37, 37, 64),    # lengths not block multiples
    (1, 4, 2, 19, 70, 40),    # GQA, Sq < Sk, non-power-of-two D
    (1, 3, 1, 70, 45, 80),    # MQA, Sq > Sk: causal rows i < Sq - Sk see no key
    (1, 2, 2, 1, 33, 96),     # decode: one query against a cache
    (1, 1, 1, 65, 65, 16),
])
def test_forward_matches_reference(B, Hq, Hkv, Sq, Sk, D, causal, dtype, device):
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, device)
    check_against_reference(q, k, v, causal)


@pytest.mark.parametrize("D", [128, 160, 256])
def test_forward_large_head_dims(D, device):
    q, k, v = make_qkv(1, 2, 1, 33, 40, D, torch.float16, device)
    check_against_reference(q, k, v, causal=True)


def test_strided_views_are_read_in_place(device):
    q, k, v = make_qkv(2, 4, 2, 29, 29, 64, torch.float32, device, layout="bshd")
    assert not q.is_contiguous()
    out, _ = check_against_reference(q, k, v, causal=True)
    assert out.stride() == q.stride(), "the output keeps q's (B, S, H, D) layout"


def test_sliced_views_with_odd_strides(device):
    # q, k and v as slices of one packed qkv projection: row stride 3 * H * D.
    B, S, H, D = 1, 21, 2, 32
    qkv = torch.randn(B, S, 3, H, D, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out, _ = check_against_reference(q, k, v, causal=False)
    # A dense (B, S, H, D) output, so the caller's transpose back to (B, S, H * D) is free.
    assert out.transpose(1, 2).is_contiguous()


def test_non_unit_stride_in_head_dim_is_copied(device):
    q, k, v = make_qkv(1, 2, 2, 17, 17, 32, torch.float32, device)
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride 1 in S not D
    assert q_t.stride(-1) != 1
    torch.testing.assert_close(flash_attention_science(q_t, k, v), flash_attention_science(q, k, v))


def test_custom_softmax_scale(device):
    q, k, v = make_qkv(1, 2, 2, 24, 31, 64, torch.float32, device)
    check_against_reference(q, k, v, causal=False, softmax_scale=0.37)


@pytest.mark.parametrize("scale", [-0.37, 0.0])
def test_negative_and_zero_softmax_scale(scale, device):
    # The kernels take row maxima over unscaled scores, so a negative scale runs on a negated q;
    # a zero scale is uniform attention over the visible keys.
    B, S, H, D = 1, 150, 2, 32  # unmasked key blocks and a masked tail
    qkv = torch.randn(B, S, 3, H, D, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # strided views: launch strides differ
    for causal in (False, True):
        check_against_reference(q, k, v, causal=causal, softmax_scale=scale)
    check_against_reference(q, k, v, causal=False)  # the same plan at the default scale afterwards


@pytest.mark.gpu
def test_gpu_negative_scale_after_and_before_the_same_call():
    # q a slice of wider rows (row stride 64, a multiple of 16, over 36 values): a negative scale
    # runs on a negated copy, which must match what the plan's compiled kernel was built for, in
    # whichever order the two scales first run.
    from flashmoe_science.attention import forward
    for scales in ((0.2, -0.2), (-0.2, 0.2)):
        forward.PLANS.clear()
        forward._FORWARD._compiled.clear()
        base = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.float16)
        q = base[..., :36]
        k, v = (torch.randn(1, 2, 300, 36, device="cuda", dtype=torch.float16) for _ in range(2))
        for scale in scales:
            check_against_reference(q, k, v, causal=True, softmax_scale=scale)


def test_no_key_rows_are_zero_not_nan(device):
    # causal with Sq > Sk: the first Sq - Sk queries see nothing.
    q, k, v = make_qkv(1, 2, 2, 40, 8, 32, torch.float32, device)
    out, lse = flash_attention_forward(q, k, v, causal=True)
    assert torch.all(out[:, :, :32] == 0)
    assert torch.all(lse[:, :, :32] == float("-inf"))
    assert torch.isfinite(out).all()


def test_zero_keys_give_zero_output(device):
    q, k, v = make_qkv(1, 2, 2, 5, 0, 32, torch.float32, device)
    out, lse = flash_attention_forward(q, k, v)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("shape", [(0, 2, 8, 32), (2, 2, 0, 32)])
def test_empty_inputs_return_empty_outputs(shape, device):
    q = torch.randn(shape, device=device)
    k = torch.randn(shape[0], 2, 8, 32, device=device)
    out, lse = flash_attention_science(q, k, k.clone(), return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]


def test_output_fully_written(device):
    """The kernel must write every output element: poison a reused buffer layout and look."""
    q, k, v = make_qkv(2, 2, 2, 45, 45, 48, torch.float32, device)
    for _ in range(2):  # the second call takes the cached fast path
        out = flash_attention_science(q, k, v, causal=True)
        assert torch.isfinite(out).all()


def test_return_lse_flag(device):
    q, k, v = make_qkv(1, 1, 1, 9, 9, 16, torch.float32, device)
    out = flash_attention_science(q, k, v)
    out2, lse = flash_attention_science(q, k, v, return_lse=True)
    torch.testing.assert_close(out, out2)
    assert lse.shape == (1, 1, 9)


def test_repeated_calls_with_new_data_use_new_data(device):
    """The cached plan must not cache data: same shapes, fresh values, fresh answers."""
    for _ in range(3):
        q, k, v = make_qkv(1, 2, 1, 20, 20, 32, torch.float32, device)
        check_against_reference(q, k, v, causal=True)


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[0], k, v), "q must have 4 dimensions"),
    (lambda q, k, v: (q.int(), k, v), "q has dtype torch.int32"),
    (lambda q, k, v: (q, k.double(), v.double()), "k has dtype torch.float64"),
    (lambda q, k, v: (q.half(), k, v), "share one dtype"),
    (lambda q, k, v: (q, k[:, :, :, :16], v[:, :, :, :16]), "same head_dim"),
    (lambda q, k, v: (q, k, v[:, :, :5]), "k and v must have the same shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), "same batch size"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)),
     "multiple of the number of key/value heads"),
    (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), "between 16 and 256"),
    (lambda q, k, v: ("q", k, v), "q must be a torch.Tensor"),
])
def test_bad_input_raises_clear_error(bad, match, device):
    q, k, v = make_qkv(2, 4, 2, 8, 8, 32, torch.float32, device)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention_science(*bad(q, k, v))


def test_head_dim_above_256_rejected(device):
    q = torch.randn(1, 1, 4, 272, device=device)
    with pytest.raises(ValueError, match="between 16 and 256"):
        flash_attention_science(q, q, q)


@pytest.mark.parametrize("kwargs,match", [
    ({"causal": "yes"}, "causal must be a bool"),
    ({"softmax_scale": float("nan")}, "softmax_scale must be finite"),
    ({"softmax_scale": "0.1"}, "softmax_scale must be a float"),
])
def test_bad_options_raise(kwargs, match, device):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, device)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention_science(q, k, v, **kwargs)


def test_cpu_tensors_without_interpreter_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="q is on the CPU"):
        flash_attention_science(q, q, q, softmax_scale=0.123456)


# ---- GPU: bf16 and realistic sizes, error compared with PyTorch's own ----

def _sdpa_error(q, k, v, causal, ref, scale=None, window=(-1, -1), rows=None):
    """PyTorch's own error in the input precision (SDPA's math backend, same band alignment), over
    the query rows `rows` (a bool mask; default all)."""
    from flashmoe_science.attention.reference import band_mask
    group = q.shape[1] // k.shape[1]
    banded = causal or tuple(window) != (-1, -1)
    mask = band_mask(q.shape[2], k.shape[2], causal, window, q.device) if banded else None
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=scale)
    if rows is not None:
        out, ref = out[:, :, rows], ref[:, :, rows]
    return rel_error(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [
    (2, 8, 8, 1024, 1024, 64), (1, 16, 4, 777, 1500, 128), (1, 4, 1, 1, 4096, 128),
    (2, 4, 4, 513, 513, 256), (1, 8, 2, 300, 300, 80), (4, 2, 2, 32, 32, 64),
])
def test_gpu_error_within_twice_pytorch(B, Hq, Hkv, Sq, Sk, D, causal, dtype):
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout="bshd")
    out = flash_attention_science(q, k, v, causal=causal)
    ref, _ = attention_reference(q, k, v, causal=causal)
    ours, theirs = rel_error(out, ref), _sdpa_error(q, k, v, causal, ref)
    assert not out.isnan().any()
    assert ours <= 2 * theirs + 1e-4, (ours, theirs)


@pytest.mark.gpu
def test_gpu_fp32_uses_tf32_within_tolerance():
    q, k, v = make_qkv(1, 4, 4, 256, 256, 64, torch.float32, "cuda")
    out = flash_attention_science(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert rel_error(out, ref) < 3e-3


@pytest.mark.gpu
def test_gpu_poisoned_output_fully_written():
    """Fill the caching allocator's blocks with NaN so an unwritten element would show."""
    q, k, v = make_qkv(2, 8, 8, 1000, 1000, 128, torch.bfloat16, "cuda")
    for _ in range(3):
        poison = torch.full((2, 8, 1000, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison
        out = flash_attention_science(q, k, v, causal=True)
        assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_gpu_matches_sdpa_when_sq_equals_sk():
    q, k, v = make_qkv(2, 8, 8, 512, 512, 128, torch.bfloat16, "cuda")
    ours = flash_attention_science(q, k, v, causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_error(ours, theirs) < 1e-2


@pytest.mark.gpu
def test_gpu_second_device_index_respected():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.float16, "cuda:1")
    check_against_reference(q, k, v, causal=False)


def test_default_scale_is_inverse_sqrt_head_dim(device):
    q, k, v = make_qkv(1, 1, 1, 10, 10, 64, torch.float32, device)
    torch.testing.assert_close(flash_attention_science(q, k, v),
                               flash_attention_science(q, k, v, softmax_scale=1 / math.sqrt(64)))


@pytest.mark.gpu
@pytest.mark.parametrize("D,causal,scale", [(128, False, None), (128, True, None), (256, True, None),
                                            (80, True, None), (64, False, None), (64, True, None), (48, True, None),
                                            (128, True, -0.09), (64, False, -0.2), (64, True, 0.0),
                                            (128, True, 0.0)])
def test_gpu_hopper_path_runs_and_matches_reference(D, causal, scale, poisoned_allocations):
    """Large 16-bit calls on sm90 take the TMA kernels: the Gluon kernel where `GLUON_FORWARD` says
    (every padded head dim 128 and 256 call here, 64 unmasked), the Triton one otherwise (64 causal
    below 2048 keys). Head dims below the tile (80 in a 128 tile, 48 in 64) rely on the
    descriptor's zero fill and clipped store; a negative scale runs on a negated q, a zero one at
    MIN_SCALE (uniform weights over the visible keys, masked scores still -inf)."""
    from flashmoe_science.attention.configs import gluon_forward_config
    from flashmoe_science.launch import clear_records, last_launch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper path is for sm90")
    seqlen = 1500 if D > 64 else 2000  # above the FLOPs the Hopper path starts at
    seqlen_k = 4096 if scale == -0.2 else seqlen
    q, k, v = make_qkv(2, 16, 4, seqlen, seqlen_k, D, torch.bfloat16, "cuda", layout="bshd")
    clear_records()
    out = flash_attention_science(q, k, v, causal=causal, softmax_scale=scale)
    gluon = gluon_forward_config(head_dim_block(D), causal, seqlen_k) is not None
    assert gluon is (D > 64 or not causal or seqlen_k >= 2048)
    ran = "attention_forward_gluon" if gluon else "attention_forward_hopper"
    assert last_launch(ran) is not None and last_launch("attention_forward") is None
    ref, _ = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    assert rel_error(out, ref) <= 2 * _sdpa_error(q, k, v, causal, ref, scale) + 1e-4
    if scale == 0.0:  # whatever SDPA makes of a zero scale: the mean of the visible values, to bf16
        assert rel_error(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,Hq,Hkv,Sq,Sk,causal,window", [
    (256, 8, 2, 1700, 1700, False, (-1, -1)),   # GQA, lengths not block multiples
    (256, 8, 8, 700, 4000, True, (-1, -1)),     # causal, Sq < Sk: the band starts mid-keys
    (200, 8, 1, 4000, 1000, True, (-1, -1)),    # MQA, Sq > Sk: rows before Sq - Sk see no key; D padded
    (256, 8, 4, 3000, 3000, False, (300, 45)),  # a sliding window: masked blocks on both edges
    (128, 8, 2, 2500, 2500, False, (-1, -1)),   # two consumers, the second's rows partly past the end
    (96, 16, 16, 1000, 4000, True, (-1, -1)),   # D padded to 128, causal with Sq < Sk
    (128, 16, 1, 4000, 1100, True, (-1, -1)),   # MQA, Sq > Sk: whole consumers see no key
    (128, 8, 4, 3000, 3000, True, (500, 0)),    # a causal sliding window
    (64, 16, 2, 1100, 5000, False, (-1, -1)),   # three consumers (unmasked, many keys), Sq not a tile multiple
    (64, 16, 4, 4096, 4096, True, (-1, -1)),    # two consumers, causal (the Triton kernel below 2048 keys)
    (64, 16, 2, 2600, 2600, True, (-1, -1)),    # the same from 2048 keys, the last tile partly past the end
])
def test_gpu_gluon_forward_matches_reference(D, Hq, Hkv, Sq, Sk, causal, window, dtype, poisoned_allocations):
    """The Gluon kernel (sm90; every shape above the FLOPs the Hopper path starts at): outputs and
    lse against float64 (allocations NaN-poisoned, so every element its TMA stores miss shows),
    rows that see no key zero with lse -inf, and a second call with new data on the cached launch."""
    from flashmoe_science.launch import clear_records, last_launch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm90")
    for _ in range(2):
        q, k, v = make_qkv(1, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout="bshd")
        clear_records()
        out, lse = flash_attention_forward(q, k, v, causal=causal, window_size=window)
        assert last_launch("attention_forward_gluon") is not None
        _check_banded_forward(q, k, v, out, lse, causal, window)


def _check_banded_forward(q, k, v, out, lse, causal, window, scale=None):
    """Outputs and lse against float64; rows that see no key are zero with lse -inf."""
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, window_size=window)
    seen = torch.isfinite(ref_lse)
    assert torch.isfinite(out).all() and torch.equal(torch.isfinite(lse), seen)
    assert torch.all(out.transpose(1, 2)[~seen.transpose(1, 2)] == 0)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=lse_tolerance(q), rtol=1e-4)
    rows = seen.all(dim=(0, 1))  # SDPA gives NaN on rows its mask hides entirely: compare the rest
    sdpa = _sdpa_error(q, k, v, causal, ref, scale, window=window, rows=rows)
    assert rel_error(out[:, :, rows], ref[:, :, rows]) <= 2 * sdpa + 1e-4


@pytest.mark.parametrize("D,Hkv,causal", [(128, 16, True), (128, 4, False), (256, 2, True), (64, 16, False)])
def test_gluon_forward_launch_is_persistent_with_causal_tiles_in_l2_sections(D, Hkv, causal, monkeypatch):
    """The Gluon forward's launch (recorded, not run: Gluon has no interpreter): persistent, one
    program per SM walks the tiles head by head; with one program per tile, causal tiles come in
    sections of as many heads as have K and V within GLUON_L2_SECTION_BYTES. By default a causal
    call is persistent up to GLUON_PERSISTENT_MAX_CAUSAL_KEYS keys, others always."""
    from flashmoe_science.attention import forward
    from flashmoe_science.attention._kernels.forward_gluon import attention_forward_gluon_kernel
    from flashmoe_science.attention.configs import (GLUON_L2_SECTION_BYTES, GLUON_PERSISTENT_MAX_CAUSAL_KEYS,
                                                    gluon_forward_config)
    from flashmoe_science.device import info_for

    calls = []

    class Recorder:
        def launch(self, key, grid, args, **options):
            calls.append((grid, dict(zip(attention_forward_gluon_kernel.arg_names, args, strict=True))))

    monkeypatch.setattr(forward, "_GLUON", Recorder())
    B, Hq = 2, 16
    cfg = gluon_forward_config(D, False, 1000)
    for S, persistent in ((1000, True), (1000, False), (1000, None), (GLUON_PERSISTENT_MAX_CAUSAL_KEYS + 8, None)):
        q, k, v = make_qkv(B, Hq, Hkv, S, S, D, torch.bfloat16, "cpu", layout="bshd")
        forward.launch_gluon(q, k, v, torch.empty_like(q), None, 0.1, cfg, (-1, 0 if causal else -1), causal=causal,
                             persistent=persistent)
        grid, args = calls[-1]
        tiles = B * Hq * -(-S // cfg.block_m)
        assert args["batch_heads"] == B * Hq and args["num_m_blocks"] == -(-S // cfg.block_m)
        assert args["PERSISTENT"] is (persistent if persistent is not None else not causal or S == 1000)
        assert grid == ((min(tiles, info_for(q).sm_count) if args["PERSISTENT"] else tiles), 1, 1)
        kv_per_query_head = 2 * S * head_dim_block(D) * 2 * Hkv // Hq
        if causal and not args["PERSISTENT"]:
            section = args["section"]
            assert section * kv_per_query_head <= GLUON_L2_SECTION_BYTES < (section + 1) * kv_per_query_head
        else:
            assert args["section"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("D,B,Hq,Hkv,Sq,Sk,causal,window", [
    (128, 2, 16, 16, 3000, 3000, True, (-1, -1)),  # ~6 tiles a program; causal sections of 21 heads, the last of 11
    (128, 3, 16, 4, 1000, 2500, False, (-1, -1)),  # GQA, Sq < Sk, tiles of varying key counts in one program
    (128, 2, 16, 1, 2900, 700, True, (-1, -1)),    # MQA, Sq > Sk: tiles with no key between tiles with some
    (256, 4, 8, 2, 2000, 2000, True, (-1, -1)),    # O through Q's buffers; consumer 0 skips the diagonal's last block
    (256, 2, 8, 8, 2500, 2500, True, (300, 0)),    # a causal window: consumers skip leading and trailing blocks
    (64, 4, 16, 4, 2200, 4500, False, (-1, -1)),   # three consumers
    (64, 2, 32, 32, 2048, 2048, True, (-1, -1)),   # three consumers, causal: early consumers skip blocks
])
def test_gpu_gluon_forward_persistent_matches_a_program_per_tile(D, B, Hq, Hkv, Sq, Sk, causal, window):
    """The persistent Gluon kernel (sm90), where each program walks several tiles and carries its
    buffer phases from one to the next, gives bit for bit the output of one program per tile, and
    both match float64."""
    from flashmoe_science.attention import forward
    from flashmoe_science.attention.configs import gluon_forward_config
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm90")
    cfg = gluon_forward_config(head_dim_block(D), False, Sk)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, "cuda", layout="bshd")
    tiles = B * Hq * -(-Sq // cfg.block_m)
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    runs = [forward.attention_forward_hopper(q, k, v, causal, D ** -0.5, cfg, gluon=True, persistent=persistent,
                                             write_lse=True, window_size=window) for persistent in (True, False)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    _check_banded_forward(q, k, v, *runs[0], causal, window)
