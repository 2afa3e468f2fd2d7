"""Property-based tests: random members of whole input classes, each against the float64
reference, with our error within twice PyTorch's own in the same dtype (plus the dtype's
resolution of the result, the least any computation in it can miss by).

Attention: batch, heads and GQA ratio, lengths from 0, head dims off the powers of two (and v's
own head dim, as MLA's), layouts
(contiguous, the (B, S, H, D) views models pass, storage offsets, expanded stride-0 heads, a
non-unit stride in D), causal, windows, softcap, scales of either sign; forward and gradients.
Packed variable-length batches with empty sequences. FP8 inputs in any layout, against float64
of their dequantised values. MoE: token counts from 0, expert counts,
routings that send every token to one expert or leave experts empty, dropped slots, int32 and
int64 ids; forward and gradients.

Hypothesis profiles (tests/conftest.py): "cpu" runs a few examples per test through Triton's
interpreter in CI; "gpu" (where a GPU is) runs many more, and adds bf16.
"""
import itertools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashmoe_science import flash_attention_science, flash_attention_varlen, fused_experts
from flashmoe_science.attention import attention_reference, varlen_attention_reference
from flashmoe_science.moe.reference import fused_experts_torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# bf16 products are wrong under Triton's interpreter: bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _amax(x) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def _rms(x):
    return (x.double().norm() / math.sqrt(max(x.numel(), 1))).item()


def assert_within_pytorch(name, ours, theirs, ref, dtype, terms=0.0):
    """RMS error of ours <= 2 x PyTorch's own + 8 eps x (RMS of the reference + `terms`).

    `terms`: the RMS size of the terms whose sum the result is, where it can be much larger than
    the result (a gradient through a softmax row that is one-hot in the dtype is a difference of
    two dot products that agree to the last bit in exact arithmetic): the dtype's resolution of
    those terms is the least any kernel that forms them in the dtype can miss by."""
    assert ours.shape == ref.shape, name
    assert not ours.isnan().any() or ref.isnan().any(), f"{name}: NaN where the reference has none"
    finite = torch.isfinite(ref)
    err_ours = _rms((ours.double() - ref)[finite])
    err_torch = _rms((theirs.double() - ref)[finite])
    floor = 8 * EPS[dtype] * (_rms(ref[finite]) + terms + 1e-30)
    if not math.isfinite(err_torch):  # PyTorch's own composition overflowed (fp16 softcap 1e5 is inf)
        err_torch = 0.0
    assert err_ours <= 2 * err_torch + floor, (name, err_ours, err_torch, floor)


def gradient_terms(q, k, v, scale, grad_size=None):
    """The RMS size of the terms attention's gradients (dq, dk, dv) are sums of, for
    `assert_within_pytorch`: dq = scale dS K and dk = scale dS^T Q with dS = P (dO.v - dO.o),
    terms of |scale| |dO| |v| |k| (|q|) (softcap's derivative is at most 1); and P = exp(s - lse),
    recomputed from the saved lse, is off by eps |s| (in every FlashAttention backward), which
    dv = P^T dO and dS carry. Row norms of a unit-normal output gradient: sqrt(D_v)."""
    size = [_rms(t) * math.sqrt(t.shape[-1]) for t in (q, k, v)]
    grad_size = math.sqrt(v.shape[-1]) if grad_size is None else grad_size
    score = 1 + abs(scale) * size[0] * size[1]
    return (abs(scale) * grad_size * size[2] * size[1] * score, abs(scale) * grad_size * size[2] * size[0] * score,
            grad_size * score)


LAYOUTS = ["contiguous", "bshd", "offset", "expanded_heads", "strided_d"]


def _make(shape, layout, dtype, magnitude):
    """A leaf tensor and a view of it with `layout` and `shape` (B, H, S, D)."""
    B, H, S, D = shape
    if layout == "bshd":
        leaf = torch.randn(B, S, H, D, dtype=dtype, device=DEVICE) * magnitude
        return leaf, lambda t: t.transpose(1, 2)
    if layout == "offset":
        leaf = torch.randn(B, H, S + 3, D, dtype=dtype, device=DEVICE) * magnitude
        return leaf, lambda t: t[:, :, 3:]
    if layout == "expanded_heads":
        leaf = torch.randn(B, 1, S, D, dtype=dtype, device=DEVICE) * magnitude
        return leaf, lambda t: t.expand(B, H, S, D)
    if layout == "strided_d":
        leaf = torch.randn(B, H, S, 2 * D, dtype=dtype, device=DEVICE) * magnitude
        return leaf, lambda t: t[..., ::2]
    leaf = torch.randn(B, H, S, D, dtype=dtype, device=DEVICE) * magnitude
    return leaf, lambda t: t


@st.composite
def attention_cases(draw):
    heads_kv = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(0, 2)), heads_kv=heads_kv, heads_q=heads_kv * draw(st.sampled_from([1, 2, 3])),
        Sq=draw(st.integers(0, 33)), Sk=draw(st.integers(0, 33)), D=draw(st.sampled_from([16, 24, 32, 40, 64])),
        Dv=draw(st.sampled_from([None, None, None, 16, 24, 48])),  # None: v's head dim is D
        dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
        window=(draw(st.sampled_from([-1, 0, 3, 17])), draw(st.sampled_from([-1, 0, 5]))),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 20.0, 1e5])),
        scale=draw(st.sampled_from([None, None, 0.3, -0.4, 0.0])),
        layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(3)],
        magnitude=draw(st.sampled_from([1.0, 1.0, 0.01, 8.0])),
    )


@given(attention_cases())
def test_attention_matches_reference_on_any_input(case):
    c = case
    shapes = [(c["B"], c["heads_q"], c["Sq"], c["D"]), (c["B"], c["heads_kv"], c["Sk"], c["D"]),
              (c["B"], c["heads_kv"], c["Sk"], c["Dv"] or c["D"])]
    made = [_make(shape, layout, c["dtype"], c["magnitude"]) for shape, layout in zip(shapes, c["layouts"])]
    leaves = [leaf.requires_grad_() for leaf, _ in made]
    options = dict(causal=c["causal"], softmax_scale=c["scale"], window_size=c["window"], softcap=c["softcap"])

    def run(fn, dtype):
        xs = [leaf.detach().to(dtype).requires_grad_() for leaf in leaves]
        q, k, v = (view(x) for (_, view), x in zip(made, xs))
        out, lse = fn(q, k, v)
        grad_out = torch.Generator(device=DEVICE).manual_seed(7)
        g = torch.randn(out.shape, generator=grad_out, device=DEVICE).to(dtype)
        grads = torch.autograd.grad(out, xs, g, allow_unused=True) if out.numel() else [torch.zeros_like(x)
                                                                                        for x in xs]
        return out.detach(), lse.detach(), [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, xs)]

    def ours(q, k, v):
        return flash_attention_science(q, k, v, return_lse=True, **options)

    def pytorch(q, k, v):
        return attention_reference(q, k, v, upcast=False, **options)

    ref = run(pytorch, torch.float64)
    mine = run(ours, c["dtype"])
    theirs = run(pytorch, c["dtype"])
    blind = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(mine[1]), blind), "lse -inf exactly for rows that see no key"
    assert torch.equal(mine[0][blind], torch.zeros_like(mine[0][blind])), "rows that see no key are 0"
    assert_within_pytorch("out", mine[0], theirs[0], ref[0], c["dtype"])
    seen = ~blind
    scale = 1 / math.sqrt(c["D"]) if c["scale"] is None else c["scale"]
    # A score is a sum of D products: its rounding is eps |scale| |q| |k| (row norms), however
    # much the products cancel, and lse carries it.
    score_size = abs(scale) * _rms(leaves[0]) * _rms(leaves[1]) * c["D"]
    lse_floor = 8 * EPS[c["dtype"]] * (1 + score_size + (ref[1][seen].abs().max().item() if seen.any() else 0))
    assert ((mine[1][seen].double() - ref[1][seen]).abs().max().item() if seen.any() else 0.0) <= max(
        2 * ((theirs[1][seen].double() - ref[1][seen]).abs().max().item() if seen.any() else 0.0), lse_floor)
    terms = gradient_terms(*leaves, scale)
    for name, a, b, r, t in zip(("dq", "dk", "dv"), mine[2], theirs[2], ref[2], terms):
        assert_within_pytorch(name, a, b, r, c["dtype"], t)


@st.composite
def fp8_attention_cases(draw):
    heads_kv = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(0, 2)), heads_kv=heads_kv, heads_q=heads_kv * draw(st.sampled_from([1, 2, 3])),
        Sq=draw(st.integers(0, 33)), Sk=draw(st.integers(0, 33)), D=draw(st.sampled_from([32, 40, 64])),
        Dv=draw(st.sampled_from([None, None, 32, 48])), causal=draw(st.booleans()),
        window=(draw(st.sampled_from([-1, 0, 3, 17])), draw(st.sampled_from([-1, 0, 5]))),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 20.0])), scale=draw(st.sampled_from([None, None, 0.3, 0.0])),
        layouts=[draw(st.sampled_from(["contiguous", "bshd", "offset", "strided_d"])) for _ in range(3)],
        magnitude=draw(st.sampled_from([1.0, 0.01, 8.0])), rotate=draw(st.booleans()),
    )


@given(fp8_attention_cases())
def test_fp8_attention_matches_reference_on_any_input(case):
    """FP8 inputs from `fp8_attention_inputs` in any layout: against float64 of the dequantised
    inputs, within twice an FP8 emulation's error (P rounded to e4m3 after an exact softmax) plus
    bf16's rounding of the output; rows that see no key exactly 0 with lse -inf."""
    from flashmoe_science import fp8_attention_inputs
    from test_attention_fp8 import dequantized, emulated_fp8

    c = case
    shapes = [(c["B"], c["heads_q"], c["Sq"], c["D"]), (c["B"], c["heads_kv"], c["Sk"], c["D"]),
              (c["B"], c["heads_kv"], c["Sk"], c["Dv"] or c["D"])]
    q, k, v = (view(leaf) for leaf, view in (_make(shape, layout, torch.float32, c["magnitude"])
                                              for shape, layout in zip(shapes, c["layouts"])))
    inputs = fp8_attention_inputs(q, k, v, rotate=c["rotate"] and c["Dv"] is None)
    for name, shape, layout in zip("qkv", shapes, c["layouts"]):  # the FP8 tensors in the drawn layouts
        leaf, view = _make(shape, layout, torch.float32, 1.0)
        inputs[name] = view(leaf.to(torch.float8_e4m3fn)).copy_(inputs[name])
    options = dict(causal=c["causal"], softmax_scale=c["scale"], window_size=c["window"], softcap=c["softcap"])
    out, lse = flash_attention_science(**inputs, return_lse=True, **options)
    dq, dk, dv = dequantized(inputs)
    ref_out, ref_lse = attention_reference(dq, dk, dv, **options)
    blind = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), blind), "lse -inf exactly for rows that see no key"
    assert (out[blind] == 0).all(), "rows that see no key are 0"
    if out.numel() == 0 or blind.all():
        return
    emulated = emulated_fp8(dq, dk, dv, **options)
    err = _rms((out.double() - ref_out)[~blind])
    err_emulated = _rms((emulated - ref_out)[~blind])
    assert err <= 2 * err_emulated + 8 * EPS[torch.bfloat16] * _rms(ref_out[~blind]) + 1e-30, (err, err_emulated)
    score_size = (c["scale"] if c["scale"] is not None else 1 / math.sqrt(c["D"])) * _rms(dq) * _rms(dk) * c["D"]
    assert (lse[~blind].double() - ref_lse[~blind]).abs().max().item() <= 1e-3 * (1 + score_size + c["softcap"])


@st.composite
def varlen_cases(draw):
    heads_kv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 4))
    return dict(
        lengths_q=[draw(st.integers(0, 20)) for _ in range(batch)],
        lengths_k=[draw(st.integers(0, 20)) for _ in range(batch)],
        heads_kv=heads_kv, heads_q=heads_kv * draw(st.sampled_from([1, 2])), D=draw(st.sampled_from([16, 32, 48])),
        Dv=draw(st.sampled_from([None, None, 16, 40])),  # None: v's head dim is D
        dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
        window=(draw(st.sampled_from([-1, 0, 4])), draw(st.sampled_from([-1, 2]))),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])), slack=draw(st.integers(0, 5)),
    )


@given(varlen_cases())
def test_varlen_matches_reference_on_any_packing(case):
    c = case
    cu = [torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
          for lengths in (c["lengths_q"], c["lengths_k"])]
    q = torch.randn(sum(c["lengths_q"]), c["heads_q"], c["D"], dtype=c["dtype"], device=DEVICE, requires_grad=True)
    k = torch.randn(sum(c["lengths_k"]), c["heads_kv"], c["D"], dtype=c["dtype"], device=DEVICE, requires_grad=True)
    v = torch.randn(sum(c["lengths_k"]), c["heads_kv"], c["Dv"] or c["D"], dtype=c["dtype"], device=DEVICE,
                    requires_grad=True)
    options = dict(causal=c["causal"], window_size=c["window"], softcap=c["softcap"])
    # max_seqlen may exceed the longest sequence (it only sizes the launch).
    out, lse = flash_attention_varlen(q, k, v, *cu, max(c["lengths_q"]) + c["slack"], max(c["lengths_k"]),
                                      return_lse=True, **options)
    ref, ref_lse = varlen_attention_reference(q.detach().double(), k.detach().double(), v.detach().double(), *cu,
                                              **options)
    blind = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), blind)
    assert torch.equal(out[blind.T], torch.zeros_like(out[blind.T]))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[c["dtype"]]
    if ON_GPU and c["dtype"] == torch.float32:
        tol = 1e-4
    assert _amax(out.double() - ref) <= tol * max(1.0, _amax(ref))
    if out.numel():
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = varlen_attention_reference(*xs, *cu, **options)
        ref_grads = torch.autograd.grad(ref_out, xs, grad_out.double(), allow_unused=True)
        for g, r, x in zip(grads, ref_grads, xs):
            r = torch.zeros_like(x) if r is None else r
            assert _amax(g.double() - r) <= 4 * tol * max(1.0, _amax(r))


@st.composite
def moe_cases(draw):
    E = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(T=draw(st.integers(0, 40)), E=E, top_k=draw(st.integers(1, min(E, 3))),
                H=draw(st.sampled_from([16, 32, 48])), I=draw(st.sampled_from([16, 32])),
                dtype=draw(st.sampled_from(DTYPES)),
                activation=draw(st.sampled_from(["silu", "gelu", "swiglu_oai"])),
                routing=draw(st.sampled_from(["random", "one_expert", "skewed", "dropped"])),
                id_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                # gpt-oss's form, in any combination: weights stored transposed (passed as views),
                # gate/up rows interleaved, expert biases
                transposed=draw(st.booleans()), interleaved=draw(st.booleans()), biases=draw(st.booleans()))


@given(moe_cases())
def test_moe_experts_match_reference_on_any_routing(case):
    c = case
    T, E, k = c["T"], c["E"], c["top_k"]
    x = torch.randn(T, c["H"], device=DEVICE)
    w1 = torch.randn(E, 2 * c["I"], c["H"], device=DEVICE) / math.sqrt(c["H"])
    w2 = torch.randn(E, c["H"], c["I"], device=DEVICE) / math.sqrt(c["I"])
    if c["activation"] == "swiglu_oai":  # pre-activations past its clamps too
        w1 = w1 * 4
    ids = torch.stack([torch.randperm(E, device=DEVICE)[:k] for _ in range(T)]) if T else torch.empty(
        0, k, dtype=torch.int64, device=DEVICE)
    if c["routing"] == "one_expert":
        ids[:, 0] = 0
        ids = torch.where((ids == 0) & (torch.arange(k, device=DEVICE) > 0), -1, ids)
    elif c["routing"] == "skewed":
        ids = ids % max(E // 2, 1)
        ids = torch.where(ids == ids[:, :1], ids, -1) if k > 1 else ids
    elif c["routing"] == "dropped" and T:
        ids[torch.rand(T, k, device=DEVICE) < 0.3] = E + 7
    ids = ids.to(c["id_dtype"])
    weights = torch.rand(T, k, device=DEVICE)
    if c["transposed"]:  # stored (E, H, 2I) and (E, I, H): the leaves, passed as (E, 2I, H) and (E, H, I) views
        w1, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    leaves = [t.to(c["dtype"]).requires_grad_() for t in (x, w1, w2)] + [weights.requires_grad_()]
    if c["biases"]:
        leaves += [torch.randn(E, 2 * c["I"], device=DEVICE).to(c["dtype"]).requires_grad_(),
                   torch.randn(E, c["H"], device=DEVICE).to(c["dtype"]).requires_grad_()]

    def call(fn, tensors, ids):
        biases = dict(w1_bias=tensors[4], w2_bias=tensors[5]) if c["biases"] else {}
        return fn(*tensors[:4], ids, activation=c["activation"], gate_up_interleaved=c["interleaved"], **biases)

    out = call(fused_experts, leaves, ids)
    assert out.shape == (T, c["H"]) and out.dtype == c["dtype"]
    kept = torch.where((ids >= 0) & (ids < E), ids.long(), -1)
    xs64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = call(fused_experts_torch, xs64, kept)
    xs = [t.detach().clone().requires_grad_() for t in leaves]
    theirs = call(fused_experts_torch, xs, kept)
    assert_within_pytorch("out", out.detach(), theirs.detach(), ref.detach(), c["dtype"])
    if T:
        grad_out = torch.randn(T, c["H"], device=DEVICE)
        ours = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        # the weights' gradients in their parameters' layout (a transposed view's: no copy)
        assert ours[1].stride() == leaves[1].stride() and ours[2].stride() == leaves[2].stride()
        def grads_of(out, inputs, grad):  # every slot dropped: the loop reference never touches an input
            if not out.requires_grad:
                return [torch.zeros_like(t) for t in inputs]
            found = torch.autograd.grad(out, inputs, grad, allow_unused=True)
            return [torch.zeros_like(t) if g is None else g for g, t in zip(found, inputs)]

        refs = grads_of(ref, xs64, grad_out.double())
        pytorch = grads_of(theirs, xs, grad_out.to(theirs.dtype))
        # d weights[t, j] = grad_out[t] . y[t, j]: H terms of the size of an expert's output y.
        y_size = _rms(call(fused_experts_torch, [*xs64[:3], torch.ones_like(xs64[3]), *xs64[4:]], kept)) / math.sqrt(k)
        terms = (0.0, 0.0, 0.0, math.sqrt(c["H"]) * _rms(grad_out) * y_size, 0.0, 0.0)
        # The resolution is the compute dtype's for all: d weights sums the expert outputs, which
        # both sides hold in that dtype.
        names = ("dx", "dw1", "dw2", "dweights", "dw1_bias", "dw2_bias")
        for name, a, b, r, t in zip(names, ours, pytorch, refs, terms):
            assert_within_pytorch(name, a, b, r, c["dtype"], t)
