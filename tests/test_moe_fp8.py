"""FP8 experts (w8a8, e4m3): `quantize_fp8_blockwise` / `quantize_fp8_per_channel` round trips,
`fused_experts` / `fused_moe` with FP8 weights against a float64 reference computed from the same
quantised values (tokens and the intermediate quantised per row and 128 columns, as the kernels
do), the error against the unquantised layer reported, poisoned outputs, and bad scales refused.
Under the interpreter here (small shapes, fp32 products of FP8 values, exact); on a GPU with FP8
tensor cores (sm89+) at larger shapes."""
import contextlib
from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from flashmoe_science.bench.timing import captured_graph
from flashmoe_science.launch import PlanCache, clear_records, last_launch
from flashmoe_science.moe import configs, fp8, fused_experts, fused_moe, moe_route
from flashmoe_science.moe.fp8 import (FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8_blockwise,
                                      quantize_fp8_per_channel)
from flashmoe_science.moe.reference import fused_experts_torch, gated_activation_torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FP8_GPU = GPU and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(GPU and not FP8_GPU, reason="FP8 tensor cores need sm89 or newer")
DTYPES = [torch.float16, torch.bfloat16]  # the FP8 path's products are FP8: bf16 tokens run in the interpreter too


def _rows_quantized(v: torch.Tensor) -> torch.Tensor:
    """v (n, K) in float64 after the kernels' quantisation: per row and 128 columns, scale =
    max |v| / 448, values rounded to e4m3 (ties to even)."""
    groups = v.view(v.shape[0], -1, 128)
    scale = (groups.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    return ((groups.float() / scale).to(FP8_DTYPE).double() * scale.double()).view_as(v)


def _reference(x, q1, s1, q2, s2, block, weights, ids, activation="silu"):
    """The FP8 layer in float64 from the same quantised values: tokens and h quantised per row
    and 128 columns, weights dequantised; dropped slots add nothing."""
    w1, w2 = dequantize_fp8(q1, s1, block).double(), dequantize_fp8(q2, s2, block).double()
    xq = _rows_quantized(x.double())
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = w1.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w1.shape[0]:  # a dropped slot
                continue
            gate_up = xq[t] @ w1[e].T
            h = gated_activation_torch(gate_up[:inter], gate_up[inter:], activation)
            out[t] += weights[t, j].double() * (_rows_quantized(h[None])[0] @ w2[e].T)
    return out


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@contextlib.contextmanager
def forced_fp8_tiling(**tiling):
    """Calls inside run the table's FP8 entry with `tiling`'s fields replaced, and split the down
    GEMM's K as that entry says whatever the shape (fresh plans: a plan keeps its configuration)."""
    table = configs.fp8_config
    with (mock.patch.object(fp8, "PLANS", PlanCache()),
          mock.patch.object(configs, "fp8_config", lambda *args: replace(table(*args), **tiling)),
          mock.patch.object(configs, "fp8_down_split", lambda cfg, *args: cfg.down_split_k)):
        yield


def _layer(T, E, H, I, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    logits = torch.randn(T, E, generator=g)
    return [t.to(DEVICE) for t in (x, w1, w2, logits)]


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_quantize_round_trip(block):
    w = torch.randn(3, 200, 300) * torch.logspace(-3, 3, 300)  # columns across six decades
    q, s = quantize_fp8_blockwise(w) if block else quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == ((3, 2, 3) if block else (3, 200))
    back = dequantize_fp8(q, s, block)
    # e4m3 keeps 3 mantissa bits: each value within half a step (1/16 relative) of its own,
    # or within half the smallest step of its scale
    tile_scale = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[:, :200, :300] if block else s[..., None]
    assert ((back - w).abs() <= w.abs() / 16 + tile_scale * 2.0**-10).all()
    assert (q.float().abs() <= FP8_MAX).all()


def test_quantize_refuses_what_it_cannot_scale():
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_blockwise(torch.randn(4, 256, 256), block=(64, 64))
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8_blockwise(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(TypeError, match="float"):
        quantize_fp8_per_channel(torch.ones(4, 4, dtype=torch.int32))


@needs_fp8
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("T,E,H,I,k,activation", [(5, 4, 256, 128, 2, "silu"), (3, 8, 128, 256, 3, "gelu")]
                         + ([(4096, 64, 2048, 768, 8, "silu")] if GPU else []))
def test_fp8_experts_match_the_quantised_reference(block, T, E, H, I, k, activation):
    x, w1, w2, logits = _layer(T, E, H, I, k)
    weights, ids = moe_route(logits, k)
    quantize = quantize_fp8_blockwise if block else quantize_fp8_per_channel
    (q1, s1), (q2, s2) = quantize(w1), quantize(w2)
    xb = x.to(torch.bfloat16)
    rows = slice(0, 64)  # the float64 loop on the first rows
    with torch.no_grad():
        clear_records()
        out = fused_experts(xb, q1, q2, weights, ids, activation=activation, w1_scale=s1, w2_scale=s2,
                            block_shape=block)
        gluon = last_launch("moe_fp8_gate_up_gluon") is not None
        clear_records()
        out_moe = fused_moe(xb, q1, q2, logits, k, activation=activation, w1_scale=s1, w2_scale=s2, block_shape=block)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, out_moe)
    if T * k <= 64:  # decode sizes: the routing launch builds the layout too (one launch, no align launch)
        assert last_launch("moe_route").constexprs["LAYOUT"] == "full" and last_launch("moe_align") is None
    # Hopper's prefill GEMMs (Gluon) past 128 pairs an expert
    assert gluon == (GPU and T * k / E > 128 and torch.cuda.get_device_capability() == (9, 0))
    ref = _reference(xb[rows], q1, s1, q2, s2, block, weights[rows], ids[rows], activation)
    # bf16 output rounding, plus the intermediate's rounding: fp32 and float64 h differ in the last
    # bits, so a few entries round to the neighbouring e4m3 value (a 1/16 step) in the kernel
    bf16_rounding = _rel(ref.to(torch.bfloat16), ref)
    assert _rel(out[rows], ref) <= 2 * bf16_rounding + 6e-3
    unquantised = fused_experts_torch(x[rows].double(), w1.double(), w2.double(), weights[rows].double(), ids[rows],
                                      activation=activation)
    assert _rel(out[rows], unquantised) < 0.12  # the FP8 error of the layer itself (about 6 % here)


@needs_fp8
def test_fp8_experts_write_every_row_and_skip_dropped_slots():
    x, w1, w2, logits = _layer(7, 4, 128, 128, 2, seed=1)
    weights, ids = moe_route(logits, 2)
    ids = ids.clone()
    ids[3] = -1  # token 3 routed nowhere: zeros
    ids[5, 1] = 99
    (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)
    with torch.no_grad():
        out = fused_experts(x.to(torch.bfloat16), q1, q2, weights, ids, w1_scale=s1, w2_scale=s2,
                            block_shape=(128, 128))
    assert torch.isfinite(out).all()
    assert (out[3] == 0).all()
    kept = ids.clone().masked_fill((ids < 0) | (ids >= 4), 0)
    only_first = fused_experts(x.to(torch.bfloat16)[5:6], q1, q2, weights[5:6, :1], kept[5:6, :1], w1_scale=s1,
                               w2_scale=s2, block_shape=(128, 128))
    assert torch.equal(out[5:6], only_first)
    empty = fused_experts(x.to(torch.bfloat16)[:0], q1, q2, weights[:0], ids[:0], w1_scale=s1, w2_scale=s2,
                          block_shape=(128, 128))
    assert empty.shape == (0, 128)


@needs_fp8
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("block_m,split_k", [(16, 1), (16, 3), (32, 2)])
def test_swapped_products_match_the_quantised_reference(block, block_m, split_k):
    """FP8Config.swap_ab (the weight tiles on the MMA's M side, the products transposed), with
    the down GEMM's K whole or split (three splits of two K steps: one split adds nothing), on a
    layout with a dropped slot, an expert without tokens, several K steps and two h groups: the
    quantised reference's answer, as the plain orientation gives it."""
    x, w1, w2, logits = _layer(6, 4, 256, 256, 2, seed=2)
    weights, ids = moe_route(logits, 2)
    ids = ids.clone().masked_fill(ids == 3, 0)  # expert 3 gets no token
    ids[2, 1] = -1
    quantize = quantize_fp8_blockwise if block else quantize_fp8_per_channel
    (q1, s1), (q2, s2) = quantize(w1), quantize(w2)
    xb = x.to(torch.bfloat16)

    def run(**tiling):
        clear_records()
        with forced_fp8_tiling(**tiling), torch.no_grad():
            out = fused_experts(xb, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, block_shape=block)
        return out, last_launch("moe_fp8_gate_up").constexprs, last_launch("moe_fp8_down").constexprs
    plain, plain_gate_up, _ = run(swap_ab=False, down_split_k=1)
    swapped, gate_up, down = run(block_m=block_m, swap_ab=True, down_split_k=split_k)
    assert not plain_gate_up["SWAP_AB"] and gate_up["SWAP_AB"] and down["SWAP_AB"] and down["BLOCK_M"] == block_m
    assert down["SPLIT_K"] == split_k
    ref = _reference(xb, q1, s1, q2, s2, block, weights, ids)
    bf16_rounding = _rel(ref.to(torch.bfloat16), ref)
    for out in (plain, swapped):
        assert _rel(out, ref) <= 2 * bf16_rounding + 6e-3
    torch.testing.assert_close(swapped, plain, rtol=2e-2, atol=2e-2 * plain.abs().max().item())


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Gluon GEMMs are sm90's")
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("H,I", [(256, 384), (512, 128)])
def test_gluon_prefill_matches_the_quantised_reference_with_dropped_slots(block, H, I):
    """Hopper's prefill GEMMs (`_kernels/fp8_gluon.py`) on a layout with an expert that gets no
    token, dropped slots, partly filled blocks, and one K step (I = 128)."""
    T, E, k = 640, 8, 2
    x, w1, w2, logits = _layer(T, E, H, I, k, seed=3)
    weights, ids = moe_route(logits, k)
    ids = ids.clone()
    ids[ids == 5] = 6  # expert 5 gets no token
    ids[::7, 1] = -1  # dropped slots
    ids[3::11, 0] = 99
    quantize = quantize_fp8_blockwise if block else quantize_fp8_per_channel
    (q1, s1), (q2, s2) = quantize(w1), quantize(w2)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        clear_records()
        out = fused_experts(xb, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, block_shape=block)
    assert last_launch("moe_fp8_gate_up_gluon") is not None and last_launch("moe_fp8_down_gluon") is not None
    rows = torch.cat([torch.arange(0, 48), torch.arange(T - 16, T)])  # both ends of the layout's experts
    ref = _reference(xb[rows], q1, s1, q2, s2, block, weights[rows], ids[rows])
    assert torch.isfinite(out).all()
    assert _rel(out[rows], ref) <= 2 * _rel(ref.to(torch.bfloat16), ref) + 6e-3


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Gluon GEMMs are sm90's")
def test_gluon_prefill_is_deterministic_syncs_nothing_and_replays_in_a_cuda_graph():
    T, E, H, I, k = 1024, 8, 256, 256, 2
    x, w1, w2, logits = _layer(T, E, H, I, k, seed=4)
    (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)
    xb = x.to(torch.bfloat16)

    def layer():
        return fused_moe(xb, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))

    with torch.no_grad():
        clear_records()
        first = layer()
        assert last_launch("moe_fp8_gate_up_gluon") is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = layer()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(first, again)
        graph, captured = captured_graph(layer)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, first)


@needs_fp8
def test_fp8_experts_refuse_bad_scales_and_gradients():
    x, w1, w2, logits = _layer(4, 4, 128, 128, 2)
    weights, ids = moe_route(logits, 2)
    (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)
    xb = x.to(torch.bfloat16)

    def call(**kwargs):
        args = dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128)) | kwargs
        with torch.no_grad():
            return fused_experts(xb, q1, q2, weights, ids, **args)

    call()  # a cached plan: the checks below run on the fast path too
    with pytest.raises(ValueError, match="w1_scale has shape"):
        call(w1_scale=s1[:, :1])
    with pytest.raises(TypeError, match="w2_scale must be float32"):
        call(w2_scale=s2.double())
    with pytest.raises(ValueError, match="w2_scale has a non-finite"):
        call(w2_scale=torch.where(s2 > 0, float("inf"), s2))
    with pytest.raises(ValueError, match="w1_scale has a non-finite, zero"):
        call(w1_scale=torch.zeros_like(s1))
    with pytest.raises(ValueError, match="per output channel"):
        call(block_shape=None)
    with pytest.raises(ValueError, match="block_shape must be"):
        call(block_shape=(64, 64))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fused_experts(xb, q1, w2.to(torch.bfloat16), weights, ids, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        fused_experts(x, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    with pytest.raises(ValueError, match="block_shape applies to FP8"):
        fused_experts(xb, w1.to(torch.bfloat16), w2.to(torch.bfloat16), weights, ids, block_shape=(128, 128))
    with pytest.raises(RuntimeError, match="inference"):
        fused_experts(xb.requires_grad_(), q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    xb = xb.detach()

    def layer(**kwargs):  # fused_moe's FP8 path has a plan of its own: its checks on its cached path
        args = dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128)) | kwargs
        top_k = args.pop("top_k", 2)
        with torch.no_grad():
            return fused_moe(xb, q1, q2, args.pop("logits", logits), top_k, **args)

    layer()
    with pytest.raises(ValueError, match="w2_scale has a non-finite"):
        layer(w2_scale=torch.where(s2 > 0, float("nan"), s2))
    with pytest.raises(TypeError, match="top_k"):
        layer(top_k=2.0)
    with pytest.raises(ValueError, match="router_logits has shape"):
        layer(logits=logits[:, :3])
    with pytest.raises(ValueError, match="scoring"):
        layer(scoring="softplus")
    with pytest.raises(RuntimeError, match="inference"):
        fused_moe(xb, q1, q2, logits.requires_grad_(), 2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    (qa, sa), (qb, sb) = (quantize_fp8_per_channel(torch.randn(shape, device=DEVICE)) for shape in ((2, 256, 96),
                                                                                                      (2, 96, 128)))
    with pytest.raises(ValueError, match="multiples of 128"):  # H = 96
        fused_experts(torch.randn(3, 96, device=DEVICE, dtype=torch.bfloat16), qa, qb, weights[:3], ids[:3] % 2,
                      w1_scale=sa, w2_scale=sb)


@needs_fp8
def test_a_scale_changed_in_place_is_checked_again():
    x, w1, w2, logits = _layer(4, 4, 128, 128, 2)
    weights, ids = moe_route(logits, 2)
    (q1, s1), (q2, s2) = quantize_fp8_per_channel(w1), quantize_fp8_per_channel(w2)
    with torch.no_grad():
        fused_experts(x.to(torch.bfloat16), q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
        s2[0, 0] = float("nan")
        with pytest.raises(ValueError, match="w2_scale has a non-finite"):
            fused_experts(x.to(torch.bfloat16), q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)


@needs_fp8
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_layer_to_fp8_runs_the_fp8_experts(block):
    from flashmoe_science import FlashMoELayer

    torch.manual_seed(0)
    layer = FlashMoELayer(128, 4, 128, top_k=2, num_shared_experts=1, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(6, 128, device=DEVICE, dtype=torch.bfloat16)
    w1, w2 = layer.w1.detach().clone(), layer.w2.detach().clone()
    assert layer.to_fp8(block) is layer and layer.is_fp8
    assert layer.w1.dtype == FP8_DTYPE and "w1" not in dict(layer.named_parameters())
    assert set(layer.state_dict()) >= {"w1", "w2", "w1_scale", "w2_scale", "router.weight", "shared_w1"}
    with torch.no_grad():
        out = layer(x)
        weights, ids = moe_route(layer.router(x), 2)
        experts = fused_experts(x, layer.w1, layer.w2, weights, ids, w1_scale=layer.w1_scale,
                                w2_scale=layer.w2_scale, block_shape=block)
    gate, up = F.linear(x, layer.shared_w1).chunk(2, dim=-1)
    assert torch.equal(out, experts + F.linear(gated_activation_torch(gate, up), layer.shared_w2))
    # against the unquantised layer in float64 (bf16 products are wrong in the interpreter)
    dense = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    dense += F.linear(gated_activation_torch(gate.double(), up.double()), layer.shared_w2.double())
    assert _rel(out, dense) < 0.12 and layer.tokens_per_expert.sum() == 12
    # the quantised weights are the quantisation of the layer's own
    (q1, s1) = (quantize_fp8_blockwise if block else quantize_fp8_per_channel)(w1)
    assert torch.equal(layer.w1.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(layer.w1_scale, s1)
    with pytest.raises(RuntimeError, match="inference only"):
        layer(x)
    with pytest.raises(RuntimeError, match="FP8 already"):
        layer.to_fp8()
    with pytest.raises(RuntimeError, match="before to_fp8"):
        layer.load_hf_experts({})
    fresh = FlashMoELayer(128, 4, 128, top_k=2, num_shared_experts=1, device=DEVICE, dtype=torch.bfloat16)
    fresh.to_fp8(block).load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x), out)
    with pytest.raises(ValueError, match="multiples of 128"):
        FlashMoELayer(64, 4, 128).to_fp8()


@st.composite
def fp8_cases(draw):
    E = draw(st.sampled_from([1, 2, 4]))
    return dict(T=draw(st.integers(0, 24)), E=E, k=draw(st.integers(1, min(E, 3))),
                H=draw(st.sampled_from([128, 256])), I=draw(st.sampled_from([128, 256])),
                block=draw(st.sampled_from([(128, 128), None])), dtype=draw(st.sampled_from(DTYPES)),
                activation=draw(st.sampled_from(["silu", "gelu"])),
                routing=draw(st.sampled_from(["random", "one_expert", "dropped"])),
                id_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                layout=draw(st.sampled_from(["contiguous", "row_stride", "column_stride"])),
                scale=draw(st.sampled_from([1e-3, 1.0, 30.0])),  # outputs to about 1e4: within fp16
                tiling=draw(st.sampled_from(["table", "swap_ab", "swap_ab split"])))


@needs_fp8
@given(fp8_cases())
def test_fp8_experts_match_the_quantised_reference_on_any_input(case):
    """Random members of the FP8 path's input class: token counts from 0, expert counts, routings
    to one expert or dropped, int32 and int64 ids, tokens with a row stride or a column stride,
    magnitudes over four decades, the table's tiling or transposed products with or without a
    split down GEMM; against the float64 reference of the same quantised values."""
    c = case
    torch.manual_seed(0)
    T, E, k, H, I = c["T"], c["E"], c["k"], c["H"], c["I"]
    x = torch.randn(T, H, device=DEVICE) * c["scale"]
    if c["layout"] == "row_stride":
        x = torch.randn(T, 2 * H, device=DEVICE)[:, :H] * c["scale"]
    elif c["layout"] == "column_stride":
        x = (torch.randn(H, T, device=DEVICE) * c["scale"]).t()
    x = x.to(c["dtype"]) if c["layout"] != "column_stride" else x.t().contiguous().t().to(c["dtype"])
    quantize = quantize_fp8_blockwise if c["block"] else quantize_fp8_per_channel
    (q1, s1), (q2, s2) = (quantize(torch.randn(E, n, m, device=DEVICE) / m**0.5) for n, m in ((2 * I, H), (H, I)))
    ids = torch.stack([torch.randperm(E, device=DEVICE)[:k] for _ in range(T)]) if T else torch.zeros(
        0, k, dtype=torch.int64, device=DEVICE)
    if c["routing"] == "one_expert":
        ids = torch.where(torch.arange(k, device=DEVICE) == 0, 0, -1).expand(T, k).clone()
    elif c["routing"] == "dropped" and T:
        ids[torch.rand(T, k, device=DEVICE) < 0.3] = E + 7
    weights = torch.rand(T, k, device=DEVICE)
    tiling = {"table": contextlib.nullcontext(), "swap_ab": forced_fp8_tiling(swap_ab=True),
              "swap_ab split": forced_fp8_tiling(swap_ab=True, down_split_k=3)}[c["tiling"]]
    with tiling, torch.no_grad():
        out = fused_experts(x, q1, q2, weights, ids.to(c["id_dtype"]), activation=c["activation"], w1_scale=s1,
                            w2_scale=s2, block_shape=c["block"])
    assert out.shape == (T, H) and out.dtype == c["dtype"]
    if not T:
        return
    kept = torch.where((ids >= 0) & (ids < E), ids, -1)
    ref = _reference(x, q1, s1, q2, s2, c["block"], weights * (kept >= 0), kept.clamp_min(0), c["activation"])
    if ref.abs().max() == 0:
        assert (out == 0).all()
        return
    rounding = _rel(ref.to(c["dtype"]), ref)
    assert _rel(out, ref) <= 2 * rounding + 1.5e-2, c


@needs_fp8
def test_compiled_fp8_inference_equals_eager():
    """Under torch.compile(fullgraph=True) with no gradient wanted, fused_experts and fused_moe
    with FP8 weights are one `flashmoe_science::moe_experts` op each: the eager results."""
    x, w1, w2, logits = _layer(9, 4, 128, 128, 2, seed=2)
    x = x.to(torch.bfloat16)
    weights, ids = moe_route(logits, 2)
    (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)

    def layer(x, weights, ids, logits):
        return (fused_experts(x, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, block_shape=(128, 128)),
                fused_moe(x, q1, q2, logits, 2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128)))

    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, weights, ids, logits)
        eager = layer(x, weights, ids, logits)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)


def test_scales_check_never_trusts_a_reused_address():
    """A scales tensor validated and freed, then a new one at the same address, with the same shape
    and version but bad values (numpy's memory written behind torch's back): checked afresh."""
    import numpy as np

    from flashmoe_science.moe.fp8 import check_scales_finite

    memory = np.ones(64, dtype=np.float32)
    good = torch.from_numpy(memory)
    check_scales_finite(good, good)
    address = good.data_ptr()
    del good
    memory[:] = np.inf
    bad = torch.from_numpy(memory)
    assert bad.data_ptr() == address and bad._version == 0
    with pytest.raises(ValueError, match="w1_scale has a non-finite"):
        check_scales_finite(bad, bad)
