"""fused_moe and fused_experts against the float64 reference of the formula, on the CPU
interpreter (fp32 and fp16, small shapes) and on the GPU (bf16 at real model shapes)."""
import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl
from test_moe_routing import poisoned  # noqa: F401  (fixture: every launcher buffer starts as poison)

from flashmoe_science.bench.timing import captured_graph
from flashmoe_science.launch import PlanCache, clear_records, last_launch
from flashmoe_science.moe import configs, experts, fused_experts, fused_moe, moe_route
from flashmoe_science.moe._kernels.offsets import wide_offset
from flashmoe_science.moe.reference import fused_experts_torch, fused_moe_torch


def make_layer(T, E, H, I, dtype, device):
    """Activations like a transformer's (unit scale) and weights ~ 1/sqrt(fan_in)."""
    x = torch.randn(T, H, device=device).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) / I**0.5).to(dtype)
    return x, w1, w2


def rel_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_against_reference(out, ref64, torch_out, *, atol=2e-3):
    """MEASURING.md: within 2x of PyTorch's own error in the input precision, plus a small
    absolute term; fp32 products must also be within 1e-5 (interpreter) of the reference."""
    assert not torch.isnan(out).any(), "an element the kernels should have written was left as poison"
    if out.is_cuda and out.dtype == torch.float32:
        atol = max(atol, 5e-3)  # fp32 products run in tf32 on the GPU (10-bit mantissa)
    ours, theirs = rel_error(out, ref64), rel_error(torch_out, ref64)
    assert ours <= 2 * theirs + atol, f"relative error {ours:.2e}, PyTorch's own {theirs:.2e}"
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k,H,I", [
    (1, 4, 2, 32, 16),      # decode: one token, most experts idle
    (1, 16, 8, 48, 272),    # one token, k = 8 (its layout written from its picks)
    (5, 8, 8, 16, 32),      # top_k = E
    (33, 8, 3, 64, 48),     # T and I not multiples of any block
    (300, 4, 2, 32, 16),    # several dispatch chunks, prefill configuration (BLOCK_M = 128)
])
def test_fused_moe_matches_reference(device, poisoned, T, E, k, H, I, dtype):  # noqa: F811
    x, w1, w2 = make_layer(T, E, H, I, dtype, device)
    logits = torch.randn(T, E, device=device)
    out = fused_moe(x, w1, w2, logits, k)
    assert out.shape == (T, H) and out.dtype == dtype
    ref = fused_moe_torch(x.double(), w1.double(), w2.double(), logits.double(), k)
    err = check_against_reference(out, ref, fused_moe_torch(x, w1, w2, logits, k))
    if dtype == torch.float32 and device.type == "cpu":
        assert err < 1e-5


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", False), ("sigmoid", True)])
def test_fused_moe_options(device, poisoned, activation, scoring, renormalize):  # noqa: F811
    T, E, k, H, I = 21, 8, 2, 32, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    logits = torch.randn(T, E, device=device)
    out = fused_moe(x, w1, w2, logits, k, renormalize=renormalize, activation=activation, scoring=scoring)
    options = dict(renormalize=renormalize, activation=activation, scoring=scoring)
    ref = fused_moe_torch(x.double(), w1.double(), w2.double(), logits.double(), k, **options)
    assert not torch.isnan(out).any()
    assert rel_error(out, ref) < (1e-5 if device.type == "cpu" else 5e-3)


@pytest.mark.parametrize("ids_dtype,weights_dtype", [(torch.int32, torch.float32), (torch.int64, torch.float16)])
def test_fused_experts_given_routing(device, poisoned, ids_dtype, weights_dtype):  # noqa: F811
    """User routing: int64 ids, half weights, repeated experts in a row, and ids outside [0, E)
    (dropped slots, as expert parallelism marks experts held elsewhere) that contribute nothing."""
    T, E, k, H, I = 40, 8, 3, 48, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    ids = torch.randint(0, E, (T, k), device=device, dtype=ids_dtype)
    ids[::5, 1] = ids[::5, 0]
    ids[::3, 2] = -1
    ids[1::4, 0] = E
    weights = torch.rand(T, k, device=device).to(weights_dtype)
    out = fused_experts(x, w1, w2, weights, ids)
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    assert not torch.isnan(out).any()
    assert rel_error(out, ref) < (1e-5 if device.type == "cpu" else 5e-3)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpt_oss_experts_transposed_interleaved_and_biased(device, poisoned, interleaved, dtype):  # noqa: F811
    """gpt-oss's experts as transformers stores them: gate_up_proj (E, H, 2I) and down_proj
    (E, I, H), read in place through transposed views, gate and up rows interleaved (or not),
    biases on both projections, and the clamped SwiGLU with pre-activations well past its clamps
    (|gate|, |up| up to about 4 x 7); against float64, and the same bits as contiguous copies of
    the weights. One and 37 tokens (decode and prefill layouts)."""
    E, k, H, I = 8, 2, 48, 32
    for T in (1, 37):
        x = torch.randn(T, H, device=device).to(dtype)
        gate_up_proj = (torch.randn(E, H, 2 * I, device=device) * 4 / H**0.5).to(dtype)
        down_proj = (torch.randn(E, I, H, device=device) / I**0.5).to(dtype)
        b1, b2 = torch.randn(E, 2 * I, device=device).to(dtype), torch.randn(E, H, device=device).to(dtype)
        weights, ids = moe_route(torch.randn(T, E, device=device), k)
        options = dict(activation="swiglu_oai", w1_bias=b1, w2_bias=b2, gate_up_interleaved=interleaved)
        w1, w2 = gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)
        out = fused_experts(x, w1, w2, weights, ids, **options)
        assert last_launch("moe_gate_up").constexprs["HAS_BIAS"] and last_launch("moe_down").constexprs["HAS_BIAS"]
        assert torch.equal(out, fused_experts(x, w1.contiguous(), w2.contiguous(), weights, ids, **options))
        as64 = {**options, "w1_bias": b1.double(), "w2_bias": b2.double()}
        ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids, **as64)
        gate_up = (x.double() @ w1[ids[0, 0]].double().T + b1[ids[0, 0]].double()).abs()
        if T > 1:
            assert gate_up.max() > 7, "the clamps were not reached"
        err = check_against_reference(out, ref, fused_experts_torch(x, w1, w2, weights, ids, **options))
        if dtype == torch.float32 and device.type == "cpu":
            assert err < 1e-5


def test_gpt_oss_options_are_named_when_wrong(device):
    E, k, H, I, T = 4, 2, 32, 16, 5
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    weights, ids = moe_route(torch.randn(T, E, device=device), k)
    b1, b2 = torch.zeros(E, 2 * I, device=device), torch.zeros(E, H, device=device)
    with pytest.raises(ValueError, match=r"w2_bias has shape \(4, 16\); expected \(4, 32\)"):
        fused_experts(x, w1, w2, weights, ids, w2_bias=b2[:, :I])
    with pytest.raises(TypeError, match="w1_bias must have hidden_states' dtype"):
        fused_experts(x, w1, w2, weights, ids, w1_bias=b1.half())
    with pytest.raises(TypeError, match="gate_up_interleaved must be a bool"):
        fused_experts(x, w1, w2, weights, ids, gate_up_interleaved=1)
    out = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)  # zero biases: the plain result
    torch.testing.assert_close(out, fused_experts(x, w1, w2, weights, ids), rtol=0, atol=0)
    b1, b2 = torch.randn_like(b1), torch.randn_like(b2)

    def layer(x, w1, w2, b1, b2):  # under torch.compile: one op, the eager bits
        return fused_experts(x, w1, w2, weights, ids, activation="swiglu_oai", w1_bias=b1, w2_bias=b2,
                             gate_up_interleaved=True)

    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        views = (w1.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2))
        assert torch.equal(compiled(x, *views, b1, b2), layer(x, *views, b1, b2))


def test_idle_experts_and_one_expert_for_every_token(device, poisoned):  # noqa: F811
    T, E, H, I = 37, 8, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    logits = torch.randn(T, E, device=device)
    logits[:, 5] += 20.0  # expert 5 is everyone's first choice; second choices spread out and,
    for k in (1, 2):      # with sigmoid scores, keep a real share of the weight
        out = fused_moe(x, w1, w2, logits, k, scoring="sigmoid")
        ref = fused_moe_torch(x.double(), w1.double(), w2.double(), logits.double(), k, scoring="sigmoid")
        assert rel_error(out, ref) < (1e-5 if device.type == "cpu" else 5e-3)
    ids = torch.full((T, 1), 2, device=device, dtype=torch.int32)  # seven experts get nothing
    weights = torch.rand(T, 1, device=device)
    out = fused_experts(x, w1, w2, weights, ids)
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    assert rel_error(out, ref) < (1e-5 if device.type == "cpu" else 5e-3)


def test_one_token_with_repeated_and_dropped_ids(device, poisoned):  # noqa: F811
    """fused_experts on one token with an expert picked twice (one block of two rows) and ids
    outside [0, E) (left out of the layout), as the reference treats them."""
    E, H, I = 8, 48, 32
    x, w1, w2 = make_layer(1, E, H, I, torch.float32, device)
    ids = torch.tensor([[5, 2, 5, -1, 8, 0]], device=device, dtype=torch.int32)
    weights = torch.rand(1, 6, device=device)
    out = fused_experts(x, w1, w2, weights, ids)
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    assert out.shape == (1, H) and rel_error(out, ref) < (1e-5 if device.type == "cpu" else 5e-3)


def test_no_tokens(device):
    x, w1, w2 = make_layer(0, 4, 32, 16, torch.float16, device)
    out = fused_moe(x, w1, w2, torch.randn(0, 4, device=device), 2)
    assert out.shape == (0, 32) and out.dtype == torch.float16
    ids = torch.zeros(0, 2, dtype=torch.int32, device=device)
    assert fused_experts(x, w1, w2, ids.float(), ids).shape == (0, 32)


def test_strided_inputs(device):
    """Rows of hidden_states with a larger stride are read in place; weights without unit
    stride along their last dimension are copied first."""
    T, E, k, H, I = 9, 4, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    wide = torch.randn(T, 2 * H, device=device)
    wide[:, 16:16 + H] = x
    w1_t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    logits = torch.randn(T, 2 * E, device=device)[:, ::2]
    out = fused_moe(wide[:, 16:16 + H], w1_t, w2, logits, k)
    ref = fused_moe_torch(x.double(), w1.double(), w2.double(), logits.double(), k)
    assert rel_error(out, ref) < (1e-5 if device.type == "cpu" else 5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_adds_the_named_rows_in_fp32(device, dtype):
    """gather_sum (expert parallelism's combine): out[t] = the sum of rows[index[t, j]] over j,
    an index outside [0, N) adding nothing (-1, N and past it), with an index read through a
    transposed view and rows of a larger stride; no tokens, and rows but no index."""
    N, H, T, m = 11, 40, 9, 3
    wide = torch.randn(N, H + 8, device=device).to(dtype)
    rows = wide[:, 4:4 + H]
    index = torch.randint(0, N, (m, T), device=device)
    index[0, 1], index[1, 1], index[2, 1] = -1, N, N + 5  # a token with nothing to add
    index[1, 3] = -1
    index = index.t()  # (T, m), strides (1, T)
    out = experts.gather_sum(rows, index)
    valid = (index >= 0) & (index < N)
    ref = torch.where(valid[..., None], rows.double()[index.clamp(0, N - 1)], 0.0).sum(1)
    assert out.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert experts.gather_sum(rows, index[:0]).shape == (0, H)
    assert torch.equal(experts.gather_sum(rows[:0], torch.full((2, 3), 0, device=device)),
                       torch.zeros(2, H, device=device, dtype=dtype))


def config_forcer(monkeypatch, plans_owner, plans_name: str, table_name: str):
    """force(change): calls run change(what configs.<table_name> picks) from here on (plans keep
    their configuration, so each force starts an empty plans_owner.<plans_name> cache)."""
    table = getattr(configs, table_name)

    def force(change):
        monkeypatch.setattr(plans_owner, plans_name, PlanCache())
        monkeypatch.setattr(configs, table_name, lambda *args: change(table(*args)))
    return force


@pytest.fixture
def forced_experts_config(monkeypatch):
    """force(change): the forward runs change(the table's ExpertsConfig) from here on."""
    return config_forcer(monkeypatch, experts, "_EXPERTS_PLANS", "experts_config")


def has_tma(device) -> bool:
    """Whether kernels can take their TMA paths on `device` (the interpreter emulates them)."""
    return device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9


def assert_same_bits(pointer, tma):
    """The GPU's products see the same tiles either way: the same bits. The interpreter's fp32
    products go through numpy, which sums a B tile read transposed (the descriptor path's
    tl.trans) in another order: within a few ulps there (fp16 outputs round it away)."""
    if tma.device.type == "cpu" and tma.dtype == torch.float32:
        torch.testing.assert_close(tma, pointer, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(pointer, tma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H,I", [(5, 48, 48), (37, 48, 80), (300, 80, 32)])
def test_tma_forward_gives_the_pointer_kernels_bits(device, poisoned, forced_experts_config, T, H, I,
                                                    dtype):  # noqa: F811
    """ExpertsConfig.tma: the weight tiles (gate/up through the (E, I, 2, H) view, interleaved as
    the pointer path's B tile) and down's h tile come through descriptors, with the pointer
    kernels' bits. H and I leave ragged last tiles and K steps (I = 80: two column tiles of gate/up, H = 80
    past one K step of 64); expert 3 gets no token; T = 300 runs the prefill tiles."""
    E, k = 8, 2
    x, w1, w2 = make_layer(T, E, H, I, dtype, device)
    ids = torch.randint(0, E - 1, (T, k), device=device, dtype=torch.int32)
    ids[ids >= 3] += 1
    weights = torch.rand(T, k, device=device)
    outs = {}
    for tma in (False, True):
        forced_experts_config(functools.partial(dataclasses.replace, tma=tma))
        outs[tma] = fused_experts(x, w1, w2, weights, ids)
        assert last_launch("moe_gate_up").constexprs["TMA"] == last_launch("moe_down").constexprs["TMA"] == (
            tma and has_tma(device))
    assert_same_bits(outs[False], outs[True])
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    check_against_reference(outs[True], ref, fused_experts_torch(x, w1, w2, weights, ids))


def test_tma_forward_falls_back_where_tensors_are_not_addressable(device, poisoned, forced_experts_config):  # noqa: F811
    """w1 starting 2 bytes past a 16-byte boundary: gate/up reads it through pointers, down still
    through descriptors, with the pointer kernels' bits."""
    T, E, k, H, I = 21, 4, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float16, device)
    weights, ids = moe_route(torch.randn(T, E, device=device), k)
    shifted_w1 = torch.cat([w1.new_zeros(1), w1.flatten()])[1:].view(w1.shape)
    assert shifted_w1.data_ptr() % 16 == 2 and not experts.tma_addressable(shifted_w1)
    outs = {}
    for tma in (False, True):
        forced_experts_config(functools.partial(dataclasses.replace, tma=tma))
        outs[tma] = fused_experts(x, shifted_w1, w2, weights, ids)
    assert last_launch("moe_gate_up").constexprs["TMA"] is False
    assert last_launch("moe_down").constexprs["TMA"] == has_tma(device)
    assert_same_bits(outs[False], outs[True])


def test_gluon_down_runs_only_on_hopper(device, poisoned, forced_experts_config):  # noqa: F811
    """A configuration asking for the Gluon down GEMM runs the Triton kernel where the Gluon one
    cannot: in the interpreter and on the CPU, for fp32, for a w2 that is not contiguous, over
    blocks of other than 128 rows."""
    T, E, k, H, I = 200, 4, 2, 64, 32  # 100 pairs an expert: the prefill tiles
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    for dtype, transposed, block_m in ((torch.float16, False, 128), (torch.float32, False, 128),
                                       (torch.float16, True, 128), (torch.float16, False, 64)):
        forced_experts_config(functools.partial(dataclasses.replace, tma=True, gluon_down_stages=4, block_m=block_m))
        x, w1, w2 = make_layer(T, E, H, I, dtype, device)
        if transposed:
            w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
        weights, ids = moe_route(torch.randn(T, E, device=device), k)
        clear_records()
        out = fused_experts(x, w1, w2, weights, ids)
        gluon = hopper and dtype == torch.float16 and not transposed and block_m == 128
        assert (last_launch("moe_down_gluon") is not None) == gluon
        assert (last_launch("moe_down") is None) == gluon
        ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
        check_against_reference(out, ref, fused_experts_torch(x, w1, w2, weights, ids))


# (E, k, H, I, T): H = 1440 ends in a partial column tile, I = 656 in a partial K step; expert 1
# gets no token and one slot is dropped.
GLUON_DOWN_SHAPES = [(16, 4, 1024, 384, 1024), (8, 2, 1440, 656, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,k,H,I,T", GLUON_DOWN_SHAPES)
def test_gluon_down_gives_the_triton_kernels_bits(poisoned, forced_experts_config, E, k, H, I, T,
                                                   dtype):  # noqa: F811
    """The Gluon down GEMM (sm90) against the Triton kernel it replaces at prefill sizes: the same
    bits (both sum each K step's products in order, then scale by the routing weight in fp32), and
    the float64 reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon down kernel runs on sm90")
    x, w1, w2 = make_layer(T, E, H, I, dtype, "cuda")
    weights, ids = moe_route(torch.randn(T, E, device="cuda"), k)
    ids = torch.where(ids == 1, 0, ids)
    ids[3, 0] = -1
    outs = {}
    for stages in (0, 4):
        forced_experts_config(functools.partial(dataclasses.replace, gluon_down_stages=stages))
        clear_records()
        outs[stages] = fused_experts(x, w1, w2, weights, ids)
        assert (last_launch("moe_down_gluon") is not None) == bool(stages)
        assert last_launch("moe_down_gluon" if stages else "moe_down").grid[0] > 0
    assert torch.equal(outs[0], outs[4])
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    check_against_reference(outs[4], ref, fused_experts_torch(x, w1, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_inference_is_one_op_whatever_the_token_count(device, dtype):
    """torch.compile(fullgraph=True) with no gradient wanted (decoding under CUDA graphs): each call
    is one `flashmoe_science::moe_experts` op, which stores nothing for a backward and whose
    output has the input's token count, so a dynamic token count (the second size recompiles
    with one) traces without a graph break; the eager results."""
    E, k, H, I = 8, 2, 32, 16

    def layer(x, w1, w2, weights, ids, logits):
        return fused_experts(x, w1, w2, weights, ids), fused_moe(x, w1, w2, logits, k)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for T in (5, 37, 300):
            x, w1, w2 = make_layer(T, E, H, I, dtype, device)
            logits = torch.randn(T, E, device=device)
            weights, ids = moe_route(logits, k)
            clear_records()
            out = compiled(x, w1, w2, weights, ids, logits)
            assert last_launch("moe_gate_up").constexprs["ACTIVATION"] == "silu"
            for c, e in zip(out, layer(x, w1, w2, weights, ids, logits)):
                assert torch.equal(c, e)
    graph = torch._dynamo.explain(layer)(x, w1, w2, weights, ids, logits)
    assert graph.graph_break_count == 0
    ops = {str(n.target) for g in graph.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "flashmoe_science.moe_experts" in ops and not any("experts_forward" in op for op in ops)


@triton.jit
def _products_kernel(index_ptr, stride, out_ptr):
    tl.store(out_ptr, wide_offset(tl.load(index_ptr), stride))


def test_wide_offset_is_64_bit(device):
    index = torch.tensor([300_000], dtype=torch.int32, device=device)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    _products_kernel[(1,)](index, 100_003, out)
    assert out.item() == 300_000 * 100_003  # 3.0e10: wraps to a wrong value in 32 bits


_BEYOND_2_31 = textwrap.dedent("""
    import torch
    from flashmoe_science.moe import fused_experts
    from flashmoe_science.moe.reference import fused_experts_torch
    torch.manual_seed(0)
    # Expert 2 of w1 and token 2 of x start 2**31 + 2**21 elements into one buffer, with strides
    # (2**30 + 2**20) that fit 32 bits, so only their products overflow. The buffer is 4.3 GB of
    # address space; only the pages of the tensors below are ever touched.
    S, E, I, H, T = 2**30 + 2**20, 3, 16, 32, 3
    buf = torch.empty(2 * S + 4096, dtype=torch.float16, device=DEVICE)
    w1 = buf.as_strided((E, 2 * I, H), (S, H, 1), 0)
    x = buf.as_strided((T, H), (S, 1), 2048)
    w1.copy_(torch.randn(E, 2 * I, H) / H**0.5)
    x.copy_(torch.randn(T, H))
    w2 = (torch.randn(E, H, I) / I**0.5).half().to(DEVICE)
    ids = torch.tensor([[2, 1], [2, 0], [1, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(T, 2, device=DEVICE)
    out = fused_experts(x, w1, w2, weights, ids)
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    print("rel_error", ((out.double() - ref).norm() / ref.norm()).item())
""")


def test_offsets_beyond_2_31_elements(device):
    """In a subprocess, because a 32-bit offset here is a wild address: the failure is a crash."""
    env = dict(os.environ)
    if device.type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", f"DEVICE = {str(device)!r}\n" + _BEYOND_2_31],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-2000:]}"
    error = float(proc.stdout.split("rel_error")[-1])
    assert error < 2e-3, proc.stdout


@pytest.mark.parametrize("call,match", [
    (lambda x, w1, w2, lg: fused_moe(x[0], w1, w2, lg, 2), "hidden_states must be 2-D"),
    (lambda x, w1, w2, lg: fused_moe(x.tolist(), w1, w2, lg, 2), "hidden_states must be a torch.Tensor"),
    (lambda x, w1, w2, lg: fused_moe(x, w1[0], w2, lg, 2), "w1 must be 3-D"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2[:, :, :8], lg, 2), r"w1 has shape .* and w2 .* or w2 must be"),
    # w1 holding the gate rows alone, (E, I, H): the error names w1 and the 2 * I it needs.
    (lambda x, w1, w2, lg: fused_moe(x, w1[:, :w1.shape[1] // 2], w2, lg, 2),
     r"w1 has shape .* so its middle dimension must be"),
    (lambda x, w1, w2, lg: fused_moe(x, w1[:3], w2[:3], lg, 2), r"router_logits has shape .* expected \(T, E\)"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2[:3], lg, 2), "w2 has shape"),
    (lambda x, w1, w2, lg: fused_moe(x[:, :24], w1[:, :, :24], w2[:, :24], lg, 2), "H = 24"),
    (lambda x, w1, w2, lg: fused_moe(x, w1[:, :16], w2[:, :, :8], lg, 2), "I = 8 "),
    (lambda x, w1, w2, lg: fused_moe(x, w1[:, :31], w2, lg, 2), "w1 has shape"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2, lg, 5), "top_k must be between 1 and min"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2, lg, 0), "top_k must be between"),
    (lambda x, w1, w2, lg: fused_moe(x.double(), w1.double(), w2.double(), lg, 2), "hidden_states has dtype"),
    (lambda x, w1, w2, lg: fused_moe(x, w1.half(), w2, lg, 2), "w1 has dtype"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2, lg.long(), 2), "router_logits has dtype"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2, lg, 2, activation="relu"), "activation must be one of"),
    (lambda x, w1, w2, lg: fused_moe(x, w1, w2, lg, 2, renormalize=None), "renormalize must be a bool"),
    (lambda x, w1, w2, lg: fused_experts(x, w1, w2, lg[:, :2], lg[:, :2]), "topk_ids has dtype"),
    (lambda x, w1, w2, lg: fused_experts(x, w1, w2, lg[:, :2], lg[:, :3].int()), "topk_weights .* and topk_ids"),
    (lambda x, w1, w2, lg: fused_experts(x, w1, w2, lg[:3, :2], lg[:3, :2].int()), "topk_weights .* and topk_ids"),
    (lambda x, w1, w2, lg: fused_experts(x, w1, w2, lg[:, :2].int(), lg[:, :2].int()), "topk_weights has dtype"),
])
def test_bad_input_raises_a_clear_error(device, call, match):
    x, w1, w2 = make_layer(6, 4, 32, 16, torch.float32, device)
    with pytest.raises((TypeError, ValueError), match=match):
        call(x, w1, w2, torch.randn(6, 4, device=device))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w1, w2 = make_layer(3, 4, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="hidden_states is on the CPU"):
        fused_moe(x, w1, w2, torch.randn(3, 4), 2)


@pytest.mark.gpu
def test_mixed_devices():
    x, w1, w2 = make_layer(3, 4, 32, 16, torch.float16, "cuda")
    with pytest.raises(ValueError, match="w2 is on cpu"):
        fused_moe(x, w1, w2.cpu(), torch.randn(3, 4, device="cuda"), 2)
    with pytest.raises(ValueError, match="router_logits is on"):
        fused_moe(x, w1, w2, torch.randn(3, 4), 2)


# (name, E, k, H, I, T): the benchmark's shapes at decode and prefill sizes.
REAL_SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, 1), ("qwen3-30b-a3b", 128, 8, 2048, 768, 256),
               ("mixtral-8x7b", 8, 2, 4096, 14336, 16), ("deepseek-v2-lite", 64, 6, 2048, 1408, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,E,k,H,I,T", REAL_SHAPES)
def test_bf16_real_shapes(name, E, k, H, I, T):
    x, w1, w2 = make_layer(T, E, H, I, torch.bfloat16, "cuda")
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    out = fused_moe(x, w1, w2, logits, k)
    # Reference and PyTorch's bf16 run use our routing: bf16 logits tie, and a tie broken the
    # other way changes the output without either being wrong (routing is tested on its own).
    weights, ids = moe_route(logits, k)
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
    check_against_reference(out, ref, fused_experts_torch(x, w1, w2, weights, ids), atol=1e-3)


@pytest.mark.gpu
def test_fp32_uses_tf32_within_its_precision():
    x, w1, w2 = make_layer(200, 16, 256, 128, torch.float32, "cuda")
    logits = torch.randn(200, 16, device="cuda")
    out = fused_moe(x, w1, w2, logits, 4)
    ref = fused_moe_torch(x.double(), w1.double(), w2.double(), logits.double(), 4)
    assert rel_error(out, ref) < 5e-3  # tf32 keeps 10 mantissa bits


@pytest.mark.gpu
def test_deterministic_and_no_host_sync():
    x, w1, w2 = make_layer(4096, 128, 2048, 768, torch.bfloat16, "cuda")
    logits = torch.randn(4096, 128, device="cuda")
    first = fused_moe(x, w1, w2, logits, 8)
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = fused_moe(x, w1, w2, logits, 8)
        decode = fused_moe(x[:3], w1, w2, logits[:3], 8)
        fused_experts(x[:3], w1, w2, *moe_route(logits[:3], 8))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, second)
    # The decode call runs other tiles (another order of the K sums): equal up to bf16 rounding.
    torch.testing.assert_close(decode, first[:3], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_cuda_graph_capture(T):
    E, k, H, I = 64, 6, 1024, 512
    x, w1, w2 = make_layer(T, E, H, I, torch.bfloat16, "cuda")
    logits = torch.randn(T, E, device="cuda")
    fused_moe(x, w1, w2, logits, k)  # compile outside the capture
    graph, static_out = captured_graph(lambda: fused_moe(x, w1, w2, logits, k))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.testing.assert_close(static_out, fused_moe(x, w1, w2, logits, k), rtol=0, atol=0)
