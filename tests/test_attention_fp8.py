"""FP8 attention (q, k, v in float8 e4m3 with per-(batch, KV head) descales): the output and lse
against the float64 reference of the dequantised inputs, the error against an FP8 emulation in
PyTorch (P quantised to e4m3 after an exact softmax), the descales' effect, the quantisation
and Hadamard helpers, edge shapes, and every argument check. On the GPU: the Gluon kernel (sm90)
at D = 64, 128, 256 with its transposed-V paths."""
import math

import pytest
import torch

from flashmoe_science import fp8_attention_inputs, flash_attention_forward, flash_attention_science, hadamard_rotate
from flashmoe_science.attention import attention_reference, hadamard_matrix
from flashmoe_science.attention.configs import HOPPER_MIN_FLOPS
from flashmoe_science.attention.reference import band_mask
from flashmoe_science.attention.fp8 import fp8_value_tiles
from flashmoe_science.flops import attention_flops
from flashmoe_science.float8 import FP8_DTYPE, FP8_MAX
from flashmoe_science.launch import clear_records, last_launch


def dequantized(inputs):
    """The real values the FP8 call's inputs stand for, float64 (B, H, S, D)."""
    heads_kv = inputs["k"].shape[1]
    q = inputs["q"].double().unflatten(1, (heads_kv, -1)) * inputs["q_descale"].double()[:, :, None, None, None]
    k = inputs["k"].double() * inputs["k_descale"].double()[:, :, None, None]
    v = inputs["v"].double() * inputs["v_descale"].double()[:, :, None, None]
    return q.flatten(1, 2), k, v


def emulated_fp8(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
    """FP8 attention emulated in PyTorch (float64 but for P): the exact softmax's P, scaled by
    2^8, rounded to e4m3 and scaled back, times v. Our kernels quantise P against the running
    row maximum instead, so their error should be of this size, not equal to it."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ kk.transpose(-1, -2) * (softmax_scale or 1 / math.sqrt(q.shape[-1]))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~band_mask(q.shape[2], k.shape[2], causal, window_size, q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0))
    return ((p * 256).to(FP8_DTYPE).double() / 256) @ vv


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("options", [dict(causal=False), dict(causal=True),
                                     dict(causal=True, window_size=(11, 0), softcap=5.0)],
                         ids=["full", "causal", "window_softcap"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,Dv", [
    (2, 4, 2, 37, 53, 64, 64),   # GQA, uneven lengths
    (1, 2, 1, 19, 70, 32, 32),   # MQA, Sq < Sk
    (1, 2, 2, 40, 24, 48, 32),   # padded head dims, v's own (MLA-like), Sq > Sk
])
def test_fp8_matches_dequantized_reference(B, Hq, Hkv, Sq, Sk, D, Dv, options, device, poisoned_allocations):
    q, k, v = (torch.randn(B, s, h, d, device=device).transpose(1, 2)
               for h, s, d in ((Hq, Sq, D), (Hkv, Sk, D), (Hkv, Sk, Dv)))
    inputs = fp8_attention_inputs(q, k, v)
    out, lse = flash_attention_science(**inputs, return_lse=True, **options)
    assert out.dtype == torch.bfloat16 and out.shape == (B, Hq, Sq, Dv) and lse.shape == (B, Hq, Sq)
    dq, dk, dv = dequantized(inputs)
    ref_out, ref_lse = attention_reference(dq, dk, dv, **options)
    assert torch.isfinite(out).all()
    emulation_err = rel(emulated_fp8(dq, dk, dv, **options), ref_out)
    assert rel(out, ref_out) <= 2 * emulation_err + 8e-3  # within twice the FP8 emulation's, plus bf16 rounding
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    # P's rounding never reaches lse; the FP8 tensor cores' fp32 sums are a little short of fp32's
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 1e-3
    # rows that see no key: output 0
    assert (out[~seen] == 0).all()


def test_flash_attention_forward_takes_fp8(device):
    q, k, v = (torch.randn(1, 2, 33, 64, device=device) for _ in range(3))
    inputs = fp8_attention_inputs(q, k, v)
    out, lse = flash_attention_forward(**inputs, causal=True)
    same, same_lse = flash_attention_science(**inputs, causal=True, return_lse=True)
    assert torch.equal(out, same) and torch.equal(lse, same_lse)


def test_descales_scale_scores_and_output(device):
    q, k, v = (torch.randn(2, 2, 25, 32, device=device) for _ in range(3))
    inputs = fp8_attention_inputs(q, k, v)
    base = flash_attention_science(**inputs).double()
    doubled_v = flash_attention_science(**{**inputs, "v_descale": inputs["v_descale"] * 2}).double()
    assert torch.allclose(doubled_v, 2 * base, rtol=1e-2, atol=1e-6)
    # q_descale * 2 with softmax_scale / 2: the same scores, the same output
    halved = flash_attention_science(**{**inputs, "q_descale": inputs["q_descale"] * 2},
                                     softmax_scale=0.5 / math.sqrt(32)).double()
    assert torch.allclose(halved, base, rtol=1e-2, atol=1e-3)
    # no descales: the stored values are the real ones
    plain = flash_attention_science(inputs["q"], inputs["k"], inputs["v"])
    ref, _ = attention_reference(inputs["q"].double(), inputs["k"].double(), inputs["v"].double())
    assert rel(plain, ref) < 0.05


def test_descale_of_one_batch_entry_stays_there(device):
    q, k, v = (torch.randn(2, 2, 20, 32, device=device) for _ in range(3))
    inputs = fp8_attention_inputs(q, k, v)
    base = flash_attention_science(**inputs)
    v_descale = inputs["v_descale"].clone()
    v_descale[1, 0] *= 4
    out = flash_attention_science(**{**inputs, "v_descale": v_descale})
    assert torch.equal(out[0], base[0]) and torch.equal(out[1, 1], base[1, 1])
    assert torch.allclose(out[1, 0].double(), 4 * base[1, 0].double(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_nan_or_negative_score_descale_poisons_its_head(bad, device):
    q, k, v = (torch.randn(1, 2, 17, 32, device=device) for _ in range(3))
    inputs = fp8_attention_inputs(q, k, v)
    k_descale = inputs["k_descale"].clone()
    k_descale[0, 1] = bad
    out = flash_attention_science(**{**inputs, "k_descale": k_descale})
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all()


def test_zero_inputs_and_empty_shapes(device):
    zeros = fp8_attention_inputs(*(torch.zeros(1, 2, 9, 32, device=device) for _ in range(3)))
    assert torch.equal(zeros["q_descale"], torch.ones(1, 2, device=device))
    assert (flash_attention_science(**zeros) == 0).all()
    for sq, sk in ((0, 8), (8, 0), (0, 0)):
        inputs = fp8_attention_inputs(torch.randn(1, 2, sq, 32, device=device), torch.randn(1, 2, sk, 32, device=device),
                                      torch.randn(1, 2, sk, 32, device=device))
        out, lse = flash_attention_science(**inputs, return_lse=True)
        assert out.shape == (1, 2, sq, 32) and out.dtype == torch.bfloat16
        assert (out == 0).all() and (lse == -math.inf).all()


def test_quantization_helper_round_trips(device):
    q = torch.randn(2, 4, 30, 32, device=device) * 3
    k, v = torch.randn(2, 2, 20, 32, device=device), torch.randn(2, 2, 20, 32, device=device) * 0.01
    inputs = fp8_attention_inputs(q, k, v)
    assert {t.dtype for name, t in inputs.items() if not name.endswith("descale")} == {FP8_DTYPE}
    assert all(inputs[n].shape == (2, 2) and inputs[n].dtype == torch.float32 for n in ("q_descale", "k_descale",
                                                                                       "v_descale"))
    dq, dk, dv = dequantized(inputs)
    for ours, real in ((dq, q), (dk, k), (dv, v)):
        assert (ours - real.double()).abs().max() <= real.abs().max() * 2 ** -4 + 1e-12  # half an e4m3 step
    # each (batch, KV head)'s largest magnitude is FP8_MAX after scaling
    assert torch.allclose(inputs["v"].float().abs().amax(dim=(2, 3)), torch.full((2, 2), FP8_MAX, device=device))


@pytest.mark.parametrize("chunk", [1 << 28, 200, 1], ids=["whole", "heads", "one_head"])
def test_quantization_in_slices_matches_at_once(chunk, monkeypatch, device):
    """Large tensors are quantised a few (batch entry, KV head) slices at a time: the same values
    and descales as at once, on a strided view (a cache's (B, S, Hkv, D) seen as (B, Hkv, S, D))."""
    from flashmoe_science.attention import fp8

    cache = torch.randn(3, 10, 4, 8, device=device) * torch.tensor([1.0, 100.0, 0.0, 1e-3], device=device)[:, None]
    x = cache.transpose(1, 2)
    expected, expected_descale = fp8.quantize_per_kv_head(x, 2)
    monkeypatch.setattr(fp8, "_QUANTIZE_CHUNK", chunk)
    got, descale = fp8.quantize_per_kv_head(x, 2)
    assert got.stride() == x.stride() and got.dtype == FP8_DTYPE
    assert torch.equal(got.float(), expected.float()) and torch.equal(descale, expected_descale)
    amax = x.unflatten(1, (2, 2)).abs().amax(dim=(2, 3, 4))
    assert torch.equal(descale, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))


@pytest.mark.parametrize("head_dim", [32, 64, 96, 192, 80])
def test_hadamard_rotation_is_orthogonal_and_keeps_scores(head_dim, device):
    r = hadamard_matrix(head_dim, seed=3, dtype=torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-12)
    assert not torch.allclose(r, hadamard_matrix(head_dim, seed=4, dtype=torch.float64))
    q, k = torch.randn(1, 2, 5, head_dim, device=device), torch.randn(1, 2, 7, head_dim, device=device)
    qr, kr = hadamard_rotate(q, k, seed=3)
    assert torch.allclose(qr @ kr.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4)
    # an outlier channel spreads over every channel
    spike = torch.zeros(1, 1, 1, head_dim, device=device)
    spike[..., 0] = 100.0
    spread, _ = hadamard_rotate(spike, spike)
    assert spread.abs().max() < 100.0 / math.sqrt(head_dim) * 2 ** (head_dim & (head_dim - 1) != 0) + 1e-3


def test_rotated_fp8_call_matches_unrotated_attention(device):
    q, k, v = (torch.randn(1, 2, 24, 64, device=device) for _ in range(3))
    out = flash_attention_science(**fp8_attention_inputs(q, k, v, rotate=True), causal=True)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
    assert rel(out, ref) < 0.06


@pytest.mark.parametrize("seqlen", [32, 21, 1])
def test_value_tiles_hold_keys_in_register_order(seqlen, device):
    v = torch.randn(2, seqlen, 3, 32, device=device).to(FP8_DTYPE).transpose(1, 2)  # (B, S, H, D) memory
    tiles = fp8_value_tiles(v)
    padded = -(-seqlen // 16) * 16
    assert tiles.shape == (2, 3, 32, padded) and tiles.is_contiguous()
    for position in range(padded):
        group, within = divmod(position, 16)
        c, rest = divmod(within, 4)
        h, e = divmod(rest, 2)
        key = 16 * group + 8 * h + 2 * c + e
        expected = v[:, :, key].float() if key < seqlen else torch.zeros(2, 3, 32, device=device)
        assert torch.equal(tiles[..., position].float(), expected)


def test_fp8_argument_errors(device):
    q, k, v = (torch.randn(1, 2, 16, 32, device=device) for _ in range(3))
    inputs = fp8_attention_inputs(q, k, v)
    with pytest.raises(TypeError, match="float8_e4m3fn; k is"):
        flash_attention_science(inputs["q"], k, inputs["v"])
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, heads_kv\)"):
        flash_attention_science(**{**inputs, "q_descale": torch.ones(2, device=device)})
    with pytest.raises(TypeError, match="k_descale must be float32"):
        flash_attention_science(**{**inputs, "k_descale": inputs["k_descale"].double()})
    with pytest.raises(TypeError, match="v_descale must be a torch.Tensor"):
        flash_attention_science(**{**inputs, "v_descale": 1.0})
    with pytest.raises(ValueError, match="apply to FP8 inputs only|applies to FP8 inputs only"):
        flash_attention_science(q, k, v, q_descale=inputs["q_descale"])
    with pytest.raises(ValueError, match="softmax_scale >= 0"):
        flash_attention_science(**inputs, softmax_scale=-1.0)
    small = fp8_attention_inputs(*(torch.randn(1, 1, 8, 16, device=device) for _ in range(3)))
    with pytest.raises(ValueError, match="head dims from 32 to 256"):
        flash_attention_science(**small)
    with pytest.raises(ValueError, match="4 dimensions"):
        flash_attention_science(inputs["q"][0], inputs["k"], inputs["v"])
    with pytest.raises(TypeError, match="16- or 32-bit"):
        fp8_attention_inputs(inputs["q"], k, v)
    from flashmoe_science.attention.forward import attention_forward
    flash_attention_science(**inputs)  # caches the call's plan
    with pytest.raises(TypeError, match="FP8 q, k, v run through"):
        # the cached plan's fast path must not run FP8 tensors without their descales
        attention_forward(inputs["q"], inputs["k"], inputs["v"], False, None, False)


def test_fp8_refused_without_fp8_tensor_cores(monkeypatch):
    from flashmoe_science import float8
    from flashmoe_science.device import DeviceInfo

    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(float8, "info_for", lambda t: DeviceInfo("NVIDIA A100", 80, 108, 166912, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 8.9 or newer\); NVIDIA A100 is sm80"):
        float8.check_fp8_device("FP8 attention", FakeCuda())


# ---- on the GPU: the Gluon kernel (sm90) and the generic one elsewhere, at the widths models use ----

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,Sq,Sk,Hq,Hkv", [(64, 1000, 1000, 8, 2), (128, 777, 1533, 4, 4), (256, 512, 512, 2, 1),
                                         (128, 2048, 2048, 16, 4), (64, 3000, 3001, 16, 8), (256, 1500, 1499, 16, 16)])
def test_fp8_gpu_matches_reference(D, Sq, Sk, Hq, Hkv, causal, poisoned_allocations):
    q, k, v = (torch.randn(2, s, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    inputs = fp8_attention_inputs(q, k, v)
    clear_records()
    out, lse = flash_attention_science(**inputs, causal=causal, return_lse=True)
    big = attention_flops(2, Hq, Sq, Sk, D) >= HOPPER_MIN_FLOPS  # as the dispatcher counts
    record = last_launch("attention_forward_gluon" if big else "attention_forward")
    assert record is not None and record.constexprs.get("FP8") is True
    if big and torch.cuda.get_device_capability() == (9, 0):
        assert record.kernel.startswith("attention_forward_gluon")
    dq, dk, dv = dequantized(inputs)
    ref_out, ref_lse = attention_reference(dq, dk, dv, causal=causal)
    emulation_err = rel(emulated_fp8(dq, dk, dv, causal=causal), ref_out)
    assert torch.isfinite(out).all()
    assert rel(out, ref_out) <= 2 * emulation_err + 8e-3
    seen = torch.isfinite(ref_lse)
    # FP8 tensor cores sum products with about 14 bits (DeepSeek-V3's report): scores, hence lse, are
    # good to about 1e-3 at D = 256; a lost descale or scale would be off by far more
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 4e-3
    # v in another layout gives the same bits, and so does a second run
    other_v = torch.empty((*inputs["v"].shape[:-1], 2 * D), dtype=FP8_DTYPE, device="cuda")[..., :D]
    other_v.copy_(inputs["v"])  # rows 2 * D apart
    assert torch.equal(flash_attention_science(**{**inputs, "v": other_v}, causal=causal), out)
    assert torch.equal(flash_attention_science(**inputs, causal=causal), out)


@pytest.mark.gpu
def test_fp8_gpu_outliers_with_rotation_closer_to_bf16():
    """FA3's outlier distribution: N(0, 1) entries plus 0.1% from N(0, 10); rotating q and k
    must not make the FP8 error worse, and both stay within a few times bf16's."""
    torch.manual_seed(0)
    shape = (2, 4096, 8, 128)

    def outliers():
        x = torch.randn(shape, device="cuda")
        mask = torch.rand(shape, device="cuda") < 1e-3
        return torch.where(mask, torch.randn(shape, device="cuda") * 10, x).transpose(1, 2)

    q, k, v = outliers(), outliers(), outliers()
    ref, _ = attention_reference(q.double(), k.double(), v.double())
    rmse = {}
    for rotate in (False, True):
        out = flash_attention_science(**fp8_attention_inputs(q, k, v, rotate=rotate))
        rmse[rotate] = (out.double() - ref).pow(2).mean().sqrt().item()
    bf16 = flash_attention_science(q.bfloat16(), k.bfloat16(), v.bfloat16())
    rmse_bf16 = (bf16.double() - ref).pow(2).mean().sqrt().item()
    assert rmse[True] <= rmse[False] * 1.05
    assert rmse[True] < 30 * rmse_bf16


# ---- FP8 KV caches: flash_attention_with_kvcache reading e4m3 caches with q in 16 or 32 bits ----

def _quantized_cache(cache, per_token):
    """(e4m3 cache, descale): the 16/32-bit cache (B, S, Hkv, D) quantised with one descale per
    (sequence, KV head), or per (sequence, token, KV head)."""
    amax = cache.abs().amax(dim=-1) if per_token else cache.abs().amax(dim=(1, 3))
    descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    expand = descale[..., None] if per_token else descale[:, None, :, None]
    return (cache / expand).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), descale


def _dequantized(cache8, descale, per_token):
    return cache8.double() * (descale.double()[..., None] if per_token else descale.double()[:, None, :, None])


@pytest.mark.parametrize("per_token", [False, True], ids=["per_head", "per_token"])
@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_kv_cache_matches_reference_and_appends(per_token, paged_cache, num_splits, device):
    from flashmoe_science import flash_attention_with_kvcache
    from test_attention_decode import reference

    B, Sq, Hq, Hkv, D, capacity, new = 2, 2, 4, 2, 32, 64, 2
    lengths = [17, 45]
    q = torch.randn(B, Sq, Hq, D, device=device)
    k_full, v_full = (torch.randn(B, capacity, Hkv, D, device=device) for _ in range(2))
    k_new, v_new = (torch.randn(B, new, Hkv, D, device=device) * 3 for _ in range(2))
    (k8, kd), (v8, vd) = _quantized_cache(k_full, per_token), _quantized_cache(v_full, per_token)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if paged_cache:
        page = 16
        order = torch.randperm(B * capacity // page, device=device)
        table = order.view(B, -1).to(torch.int32)

        def to_pages(t):
            out = torch.empty((B * capacity // page, page, *t.shape[2:]), dtype=t.dtype, device=device)
            out[order] = t.reshape(-1, page, *t.shape[2:])
            return out

        k_cache, v_cache = to_pages(k8), to_pages(v8)
        k_descale, v_descale = (to_pages(d) if per_token else d for d in (kd, vd))
    else:
        table = None
        k_cache, v_cache, k_descale, v_descale = k8.clone(), v8.clone(), kd.clone(), vd.clone()
    out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                            block_table=table, k_descale=k_descale, v_descale=v_descale,
                                            num_splits=num_splits, return_lse=True)

    # the appended tokens, quantised as the kernel must: bit for bit
    def back(t):  # pages back to the contiguous layout
        return t[table.flatten().long()].reshape(B, capacity, *t.shape[2:]) if paged_cache else t

    k_now, v_now = back(k_cache), back(v_cache)
    kd_now, vd_now = (back(d) if per_token else d for d in (k_descale, v_descale))
    for cache8, now, descale, fresh in ((k8, k_now, kd_now, k_new), (v8, v_now, vd_now, v_new)):
        for b, n in enumerate(lengths):
            if per_token:
                amax = fresh[b].abs().amax(dim=-1)
                scale = torch.clamp(amax / FP8_MAX, min=1e-12)
                assert torch.allclose(descale[b, n:n + new], scale, rtol=1e-6)
                want = (fresh[b] / scale[..., None]).to(FP8_DTYPE)
            else:
                want = (fresh[b] / descale[b][None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            assert torch.equal(now[b, n:n + new].view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(now[b, :n].view(torch.uint8), cache8[b, :n].view(torch.uint8))  # untouched
    # the attention: against float64 of the dequantised cache, new tokens included
    k_real, v_real = _dequantized(k_now, kd_now, per_token), _dequantized(v_now, vd_now, per_token)
    ref_out, ref_lse = reference(q, k_real, v_real, [n + new for n in lengths])
    assert rel(out, ref_out) < 1e-5
    assert torch.allclose(lse, ref_lse, atol=1e-5)


def test_fp8_kv_cache_saturates_new_values_and_keeps_nan(device):
    from flashmoe_science import flash_attention_with_kvcache

    q = torch.randn(1, 1, 2, 32, device=device)
    k_cache, v_cache = (torch.zeros(1, 32, 2, 32, device=device).to(FP8_DTYPE) for _ in range(2))
    descale = torch.ones(1, 2, device=device)
    k_new = torch.randn(1, 1, 2, 32, device=device)
    k_new[0, 0, 0, 0], k_new[0, 0, 0, 1], k_new[0, 0, 1, 0] = 1e4, -math.inf, math.nan
    flash_attention_with_kvcache(q, k_cache, v_cache, k_new, torch.zeros_like(k_new), cache_seqlens=3,
                                 k_descale=descale, v_descale=descale)
    assert k_cache[0, 3, 0, 0].float() == FP8_MAX  # finite beyond e4m3's range: saturated
    assert torch.isnan(k_cache[0, 3, 0, 1].float()) and torch.isnan(k_cache[0, 3, 1, 0].float())


def test_fp8_kv_cache_descale_errors(device):
    from flashmoe_science import flash_attention_with_kvcache

    q = torch.randn(2, 1, 4, 32, device=device)
    k_cache, v_cache = (torch.zeros(2, 16, 2, 32, device=device).to(FP8_DTYPE) for _ in range(2))
    good = torch.ones(2, 2, device=device)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(2, 2\) \(per sequence and KV head\) or "
                                         r"\(2, 16, 2\)"):
        flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, k_descale=torch.ones(2, device=device),
                                     v_descale=good)
    with pytest.raises(TypeError, match="both descales given, or neither"):
        flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, k_descale=good)
    with pytest.raises(TypeError, match="k_descale must be float32"):
        flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, k_descale=good.double(),
                                     v_descale=good)
    with pytest.raises(ValueError, match="applies to FP8 caches only"):
        flash_attention_with_kvcache(q, k_cache.float(), v_cache.float(), cache_seqlens=4, k_descale=good,
                                     v_descale=good)
    with pytest.raises(ValueError, match="must share one dtype"):
        flash_attention_with_kvcache(q, k_cache, v_cache.float(), cache_seqlens=4)
    with pytest.raises(TypeError, match="q must be fp16, bf16 or fp32|q has dtype"):
        flash_attention_with_kvcache(q.to(FP8_DTYPE), k_cache, v_cache, cache_seqlens=4)
    # no descales: the stored values are the real ones
    out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4)
    assert (out == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [False, True])
def test_fp8_kv_cache_gpu_bf16(per_token):
    from flashmoe_science import flash_attention_with_kvcache
    from test_attention_decode import reference

    B, Hq, Hkv, D, capacity = 4, 32, 8, 128, 4096
    lengths = [4000, 1, 2500, 4095]
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k_full, v_full = (torch.randn(B, capacity, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    (k8, kd), (v8, vd) = _quantized_cache(k_full, per_token), _quantized_cache(v_full, per_token)
    k_new, v_new = (torch.randn(B, 1, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = flash_attention_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
    k_real, v_real = _dequantized(k8, kd, per_token), _dequantized(v8, vd, per_token)
    ref_out, _ = reference(q, k_real, v_real, [n + 1 for n in lengths])
    bf16_out, _ = reference(q, k_real.bfloat16(), v_real.bfloat16(), [n + 1 for n in lengths])
    assert rel(out, ref_out) <= 2 * max(rel(bf16_out.bfloat16(), ref_out), 2e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_matches_each_sequence(causal, device, poisoned_allocations):
    from flashmoe_science import flash_attention_varlen

    lengths_q, lengths_k = [5, 0, 33, 17], [9, 4, 33, 40]
    Hq, Hkv, D = 4, 2, 32
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lengths_q), Hq, D, device=device)
    k, v = (torch.randn(sum(lengths_k), Hkv, D, device=device) for _ in range(2))
    # one descale per sequence and KV head
    descales, packed = {}, {}
    for name, t, cu, heads in (("q", q, cu_q, Hq), ("k", k, cu_k, Hkv), ("v", v, cu_k, Hkv)):
        scales, parts = [], []
        for b in range(len(lengths_q)):
            part = t[cu[b]:cu[b + 1]].unflatten(1, (Hkv, heads // Hkv))
            amax = part.abs().amax(dim=(0, 2, 3)) if part.numel() else torch.zeros(Hkv, device=device)
            scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            scales.append(scale)
            parts.append((part / scale[None, :, None, None]).clamp(-FP8_MAX, FP8_MAX).flatten(1, 2))
        descales[f"{name}_descale"] = torch.stack(scales)
        packed[name] = torch.cat(parts).to(FP8_DTYPE)
    helper = fp8_attention_inputs(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # the same, in one call
    for name in packed:
        assert torch.equal(helper[f"{name}_descale"], descales[f"{name}_descale"])
        assert torch.equal(helper[name].view(torch.uint8), packed[name].view(torch.uint8))
    out, lse = flash_attention_varlen(packed["q"], packed["k"], packed["v"], cu_q, cu_k, max(lengths_q),
                                      max(lengths_k), causal=causal, return_lse=True, **descales)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lengths_q), Hq, D) and lse.shape == (Hq, sum(lengths_q))
    for b in range(len(lengths_q)):
        def real(name, cu, heads):
            part = packed[name][cu[b]:cu[b + 1]].double().unflatten(1, (Hkv, heads // Hkv))
            return (part * descales[f"{name}_descale"][b].double()[None, :, None, None]).flatten(1, 2)[None].transpose(1, 2)
        ref_out, ref_lse = attention_reference(real("q", cu_q, Hq), real("k", cu_k, Hkv), real("v", cu_k, Hkv),
                                               causal=causal)
        ours = out[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
        if ours.numel():
            emulation_err = rel(emulated_fp8(real("q", cu_q, Hq), real("k", cu_k, Hkv), real("v", cu_k, Hkv),
                                             causal=causal), ref_out)
            assert rel(ours, ref_out) <= 2 * emulation_err + 8e-3
            seen = torch.isfinite(ref_lse[0])
            assert torch.equal(torch.isfinite(lse[:, cu_q[b]:cu_q[b + 1]]), seen)
            assert (lse[:, cu_q[b]:cu_q[b + 1]][seen].double() - ref_lse[0][seen]).abs().max() < 1e-3
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, heads_kv\) = \(4, 2\)"):
        flash_attention_varlen(packed["q"], packed["k"], packed["v"], cu_q, cu_k, max(lengths_q), max(lengths_k),
                               **{**descales, "q_descale": torch.ones(3, 2, device=device)})


@pytest.mark.parametrize("v_layout", ["heads_first", "d_strided"])
def test_fp8_under_torch_compile_equals_eager(v_layout, device):
    """fullgraph torch.compile traces FP8 calls through the forward custom ops (descales as an
    argument, bf16 out): the same output, lse and output layout as eager, dense and packed."""
    from flashmoe_science import flash_attention_varlen

    q, k, v = (torch.randn(2, 40, 4 if name == "q" else 2, 32, device=device).transpose(1, 2) for name in "qkv")
    inputs = fp8_attention_inputs(q, k, v)
    if v_layout == "d_strided":  # v's head dim not of unit stride: the output is contiguous
        inputs["v"] = inputs["v"].transpose(-1, -2).contiguous().transpose(-1, -2)

    def dense(q, k, v, q_descale, k_descale, v_descale):
        return flash_attention_science(q, k, v, True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                       return_lse=True)

    eager = dense(**inputs)
    compiled = torch.compile(dense, fullgraph=True, backend="aot_eager")(**inputs)
    for ours, theirs in zip(compiled, eager):
        assert ours.dtype == theirs.dtype and ours.stride() == theirs.stride() and torch.equal(ours, theirs)
    assert eager[0].dtype == torch.bfloat16

    cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
    packed = {name: inputs[name][:1].transpose(1, 2).reshape(40, -1, 32) for name in "qkv"}
    descales = {f"{n}_descale": inputs[f"{n}_descale"][:1].expand(2, -1).contiguous() for n in "qkv"}

    def varlen(q, k, v, q_descale, k_descale, v_descale):
        return flash_attention_varlen(q, k, v, cu, cu, 23, 23, causal=True, q_descale=q_descale,
                                      k_descale=k_descale, v_descale=v_descale, return_lse=True)

    eager = varlen(**packed, **descales)
    compiled = torch.compile(varlen, fullgraph=True, backend="aot_eager")(**packed, **descales)
    for ours, theirs in zip(compiled, eager):
        assert ours.dtype == theirs.dtype and ours.stride() == theirs.stride() and torch.equal(ours, theirs)
    with pytest.raises(RuntimeError, match="forward only"):
        torch.compile(dense, fullgraph=True, backend="aot_eager")(
            **{**inputs, "q": inputs["q"].float().requires_grad_().to(FP8_DTYPE)})
