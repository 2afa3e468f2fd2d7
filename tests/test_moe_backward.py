"""Gradients of fused_moe and fused_experts against autograd through the float64 reference of the
formula, on the CPU interpreter (fp32 and fp16, small shapes) and on the GPU (bf16 at real model
shapes); which backward kernels run; determinism; torch.compile; the tensor-descriptor (TMA)
variants against the pointer kernels."""
import dataclasses
import functools
import gc
import weakref

import pytest
import torch
from test_moe_configs import _launched_build
from test_moe_experts import config_forcer, has_tma, make_layer, rel_error
from test_moe_routing import poisoned  # noqa: F401  (fixture: every launcher buffer starts as poison)

from flashmoe_science.bench.timing import captured_graph
from flashmoe_science.device import SUPPORTED_TARGETS, info_for
from flashmoe_science.launch import clear_records, last_launch
from flashmoe_science.moe import backward as moe_backward
from flashmoe_science.moe import builds, configs, experts, fused_experts, fused_moe, moe_route
from flashmoe_science.moe.reference import fused_experts_torch, fused_moe_torch

BACKWARD_OPS = ("moe_grad_gate_up", "moe_grad_x", "moe_grad_w1", "moe_grad_w2")


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads_of(fn, inputs, grad_out):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, grad_out)


def check_grads(grads, ref64, torch_grads, names, *, atol):
    """MEASURING.md: each gradient within 2x of PyTorch's own error in the input precision plus a
    small absolute term; no poison (NaN) left anywhere. Returns the relative errors."""
    errors = {}
    for name, g, r, t in zip(names, grads, ref64, torch_grads):
        assert g.shape == r.shape, name
        assert not torch.isnan(g).any(), f"d {name}: an element the kernels should have written was left as poison"
        ours, theirs = rel_error(g, r), rel_error(t, r)
        assert ours <= 2 * theirs + atol, f"d {name}: relative error {ours:.2e}, PyTorch's own {theirs:.2e}"
        errors[name] = ours
    return errors


def moe_gradient_check(device, T, E, k, H, I, dtype, **options):
    x, w1, w2 = make_layer(T, E, H, I, dtype, device)
    logits = torch.randn(T, E, device=device)
    grad_out = torch.randn(T, H, device=device).to(dtype)
    inputs = leaves(x, w1, w2, logits)
    out, grads = grads_of(lambda *a: fused_moe(*a, k, **options), inputs, grad_out)
    _, ref = grads_of(lambda *a: fused_moe_torch(*a, k, **options), leaves(*(t.double() for t in inputs)),
                      grad_out.double())
    # fp32 runs tf32 tensor-core products on the GPU (10 mantissa bits): PyTorch's own error is
    # taken in the same precision, its matmuls in tf32 too. The router logits' gradient, a
    # softmax Jacobian applied to near-equal per-expert terms, magnifies the rounding of each.
    tf32 = dtype == torch.float32 and device.type == "cuda"
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32 or previous
    try:
        _, torch_grads = grads_of(lambda *a: fused_moe_torch(*a, k, **options), leaves(*inputs), grad_out)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert grads[3].dtype == logits.dtype and grads[0].dtype == dtype
    atol = 1e-6 if dtype == torch.float32 and device.type == "cpu" else (5e-3 if dtype == torch.float32 else 2e-3)
    return check_grads(grads, ref, torch_grads, ("x", "w1", "w2", "router_logits"), atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k,H,I", [
    (1, 4, 2, 32, 16),      # decode: one token, most experts idle
    (5, 8, 8, 16, 32),      # top_k = E
    (33, 8, 3, 64, 48),     # T and I not multiples of any block
    (300, 4, 2, 32, 16),    # several dispatch chunks, prefill configuration
])
def test_fused_moe_gradients_match_reference(device, poisoned, T, E, k, H, I, dtype):  # noqa: F811
    errors = moe_gradient_check(device, T, E, k, H, I, dtype)
    if dtype == torch.float32 and device.type == "cpu":
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("activation,scoring,renormalize", [("gelu", "softmax", True), ("silu", "softmax", False),
                                                            ("silu", "sigmoid", True), ("gelu", "sigmoid", False),
                                                            ("swiglu_oai", "softmax", True)])
def test_fused_moe_gradient_options(device, poisoned, activation, scoring, renormalize):  # noqa: F811
    errors = moe_gradient_check(device, 21, 8, 2, 32, 32, torch.float32, activation=activation, scoring=scoring,
                                renormalize=renormalize)
    assert max(errors.values()) < (1e-5 if device.type == "cpu" else 5e-3), errors


def test_user_routing_gradients_with_dropped_and_repeated_ids(device, poisoned):  # noqa: F811
    """fused_experts with int64 ids (repeats within a row, ids outside [0, E) that drop a slot)
    and half-precision weights: their gradient comes back in half precision, zero on dropped slots."""
    T, E, k, H, I = 40, 8, 3, 48, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    ids = torch.randint(0, E, (T, k), device=device)
    ids[::5, 1] = ids[::5, 0]
    ids[::3, 2] = -1
    ids[1::4, 0] = E
    weights = torch.rand(T, k, device=device).half()
    grad_out = torch.randn(T, H, device=device)
    inputs = leaves(x, w1, w2, weights)
    _, grads = grads_of(lambda x, w1, w2, w: fused_experts(x, w1, w2, w, ids), inputs, grad_out)
    _, ref = grads_of(lambda x, w1, w2, w: fused_experts_torch(x, w1, w2, w, ids),
                      leaves(*(t.double() for t in inputs)), grad_out.double())
    assert grads[3].dtype == torch.float16
    dropped = (ids < 0) | (ids >= E)
    assert torch.all(grads[3][dropped] == 0)
    for name, g, r in zip(("x", "w1", "w2"), grads, ref):
        assert rel_error(g, r) < (1e-5 if device.type == "cpu" else 5e-3), name
    tolerance = 2e-3 if device.type == "cpu" else 1e-2  # an fp16 gradient (and tf32 products on the GPU)
    torch.testing.assert_close(grads[3].double(), ref[3], rtol=tolerance, atol=tolerance)


def gpt_oss_gradient_check(device, T, E, k, H, I, dtype, transposed=True, interleaved=True, atol=1e-6):
    """gpt-oss's form with gradients: weights stored transposed (E, H, 2I) and (E, I, H), passed
    as views (or stored as ours); gate/up rows interleaved or not; both biases; the clamped
    SwiGLU with pre-activations past its clamps; a dropped slot. Every input's gradient, the
    biases' and the routing weights' included, against autograd through the float64 reference;
    the weights' gradients come back in their parameters' layout (contiguous: no copy). Returns
    the relative errors."""
    gate_up_proj = torch.randn(E, H, 2 * I, device=device) * 4 / H**0.5
    down_proj = torch.randn(E, I, H, device=device) / I**0.5
    if not transposed:  # stored as ours, (E, 2I, H) and (E, H, I), and passed as transposed views here
        gate_up_proj, down_proj = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up_proj, down_proj))
    x = torch.randn(T, H, device=device)
    b1, b2 = torch.randn(E, 2 * I, device=device), torch.randn(E, H, device=device)
    weights, ids = moe_route(torch.randn(T, E, device=device), k)
    ids = ids.long()
    ids[::7, 1] = -1
    grad_out = torch.randn(T, H, device=device)

    def run(fn, tensors):
        inputs = leaves(*tensors)
        x, gate_up, down, w, b1, b2 = inputs
        out = fn(x, gate_up.transpose(1, 2), down.transpose(1, 2), w, ids, activation="swiglu_oai", w1_bias=b1,
                 w2_bias=b2, gate_up_interleaved=interleaved)
        return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))

    tensors = (x.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype), weights, b1.to(dtype), b2.to(dtype))
    grads = run(fused_experts, tensors)
    ref = run(fused_experts_torch, [t.double() for t in tensors])
    torch_grads = run(fused_experts_torch, tensors)
    errors = check_grads(grads, ref, torch_grads, ("x", "gate_up_proj", "down_proj", "weights", "b1", "b2"),
                         atol=atol)
    assert torch.all(grads[3][ids < 0] == 0)
    assert grads[1].stride() == gate_up_proj.stride() and grads[2].stride() == down_proj.stride()
    return errors


@pytest.mark.parametrize("transposed,interleaved", [(True, True), (True, False), (False, True)])
def test_gpt_oss_experts_gradients(device, poisoned, transposed, interleaved):  # noqa: F811
    errors = gpt_oss_gradient_check(device, 37, 8, 2, 48, 32, torch.float32, transposed, interleaved,
                                    atol=1e-6 if device.type == "cpu" else 5e-3)
    if device.type == "cpu":
        assert max(errors.values()) < 1e-5, errors


def test_gpt_oss_experts_gradients_for_one_token_and_none(device, poisoned):  # noqa: F811
    """One token (its second slot dropped), and no token at all: zero weight gradients, written in
    the parameters' layout too."""
    gpt_oss_gradient_check(device, 1, 8, 2, 48, 32, torch.float32, atol=1e-6 if device.type == "cpu" else 5e-3)
    E, k, H, I = 8, 2, 48, 32
    gate_up_proj = torch.randn(E, H, 2 * I, device=device, requires_grad=True)
    down_proj = torch.randn(E, I, H, device=device, requires_grad=True)
    x = torch.randn(0, H, device=device, requires_grad=True)
    weights, ids = torch.rand(0, k, device=device), torch.zeros(0, k, dtype=torch.int64, device=device)
    out = fused_experts(x, gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2), weights, ids,
                        activation="swiglu_oai", gate_up_interleaved=True)
    assert out.shape == (0, H)
    grads = torch.autograd.grad(out.sum(), (gate_up_proj, down_proj))
    for g, w in zip(grads, (gate_up_proj, down_proj)):
        assert g.stride() == w.stride() and torch.all(g == 0)


def test_idle_experts_and_one_expert_for_every_token(device, poisoned):  # noqa: F811
    """Every token routed to expert 2 (top-1): the other experts' weight gradients are exactly zero;
    and a logit bias that makes expert 5 everyone's first choice (heavy imbalance, top-2)."""
    T, E, H, I = 37, 8, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    ids = torch.full((T, 1), 2, device=device, dtype=torch.int32)
    weights = torch.rand(T, 1, device=device)
    grad_out = torch.randn(T, H, device=device)
    inputs = leaves(x, w1, w2, weights)
    _, grads = grads_of(lambda x, w1, w2, w: fused_experts(x, w1, w2, w, ids), inputs, grad_out)
    _, ref = grads_of(lambda x, w1, w2, w: fused_experts_torch(x, w1, w2, w, ids),
                      leaves(*(t.double() for t in inputs)), grad_out.double())
    idle = torch.arange(E, device=device) != 2
    assert torch.all(grads[1][idle] == 0) and torch.all(grads[2][idle] == 0)
    for g, r in zip(grads, ref):
        assert rel_error(g, r) < (1e-5 if device.type == "cpu" else 5e-3)
    logits = torch.randn(T, E, device=device)
    logits[:, 5] += 20.0
    inputs = leaves(x, w1, w2, logits)
    _, grads = grads_of(lambda *a: fused_moe(*a, 2, scoring="sigmoid"), inputs, grad_out)
    _, ref = grads_of(lambda *a: fused_moe_torch(*a, 2, scoring="sigmoid"), leaves(*(t.double() for t in inputs)),
                      grad_out.double())
    for g, r in zip(grads, ref):
        assert rel_error(g, r) < (1e-5 if device.type == "cpu" else 5e-3)


def test_no_tokens(device):
    x, w1, w2 = make_layer(0, 4, 32, 16, torch.float16, device)
    inputs = leaves(x, w1, w2, torch.randn(0, 4, device=device))
    out = fused_moe(*inputs, 2)
    assert out.shape == (0, 32)
    dx, dw1, dw2, dlogits = torch.autograd.grad(out.float().sum(), inputs)
    assert dx.shape == (0, 32) and dlogits.shape == (0, 4)
    assert torch.all(dw1 == 0) and torch.all(dw2 == 0)


@pytest.mark.parametrize("needs", ["x", "weights", "w1", "w2", "routing"])
def test_only_the_needed_gradients_run(device, needs):
    """Frozen experts skip the weight-gradient kernels (each weight its own); a frozen input skips grad_x."""
    T, E, k, H, I = 19, 4, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    logits = torch.randn(T, E, device=device)
    x.requires_grad_(needs == "x")
    w1.requires_grad_(needs in ("weights", "w1"))
    w2.requires_grad_(needs in ("weights", "w2"))
    logits.requires_grad_(needs == "routing")
    wanted = [t for t in (x, w1, w2, logits) if t.requires_grad]
    clear_records()
    grads = torch.autograd.grad(fused_moe(x, w1, w2, logits, k).square().sum(), wanted)
    assert all(not torch.isnan(g).any() for g in grads)
    assert last_launch("moe_grad_gate_up") is not None
    assert (last_launch("moe_grad_x") is not None) == (needs == "x")
    assert (last_launch("moe_grad_w1") is not None) == w1.requires_grad
    assert (last_launch("moe_grad_w2") is not None) == w2.requires_grad


def test_backward_frees_the_down_halfs_tensors_before_the_weight_gradient_of_w1(device, monkeypatch):
    """h, which only the down half's backward reads, is gone (autograd released it with that
    node) when the gate/up half's backward allocates d w1, and the activation's derivatives live
    on only as d [gate, up], which that backward wrote over them: the backward's peak holds no
    more than an autograd of the plain formula."""
    x, w1, w2 = make_layer(37, 4, 32, 16, torch.float32, device)
    x, w1, w2 = leaves(x, w1, w2)
    logits = torch.randn(37, 4, device=device)
    saved, alive_at_gate_up_backward = [], []
    gate_up_for_backward, gate_up_backward = experts.gate_up_for_backward, moe_backward.gate_up_backward

    def keeping_references(*args):
        out = gate_up_for_backward(*args)
        saved.extend(weakref.ref(t) for t in out[:2])
        return out

    def checking_references(grad_gate_up, *args):
        gc.collect()
        alive_at_gate_up_backward.extend(ref() is not None for ref in saved)
        assert grad_gate_up is saved[1]()
        return gate_up_backward(grad_gate_up, *args)

    monkeypatch.setattr(experts, "gate_up_for_backward", keeping_references)
    monkeypatch.setattr(moe_backward, "gate_up_backward", checking_references)
    out = fused_moe(x, w1, w2, logits, 2)
    gc.collect()
    assert len(saved) == 2 and all(ref() is not None for ref in saved)  # kept for the backward
    torch.autograd.grad(out.square().sum(), (x, w1, w2))
    assert alive_at_gate_up_backward == [False, True]


def test_down_backward_overwriting_the_saved_activations_gives_the_same_gradients(device, poisoned):  # noqa: F811
    """down_backward with overwrite_saved: d [gate, up] in h_grads' memory and w_p * h_p in h's,
    each element the same as in buffers of their own (every program reads an element before it
    writes it, and no other reads it)."""
    T, E, k, H, I = 37, 4, 2, 64, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    weights, ids = moe_route(torch.randn(T, E, device=device), k)
    grad_out = torch.randn(T, H, device=device)
    saved = experts.gate_up_for_backward(x, w1, w2, weights, ids, "silu")
    separate = moe_backward.down_backward(grad_out, x, w1, w2, weights, ids, *saved, True, True)
    h, h_grads = saved[0].clone(), saved[1].clone()
    overwritten = moe_backward.down_backward(grad_out, x, w1, w2, weights, ids, h, h_grads, *saved[2:], True, True,
                                             overwrite_saved=True)
    assert overwritten[0] is h_grads
    for a, b in zip(separate, overwritten):
        assert torch.equal(a, b)
    assert not torch.equal(h, saved[0])  # w_p * h_p, d w2's operand, written over h
    with pytest.raises(ValueError, match="interleaved"):
        moe_backward.down_backward(grad_out, x, w1, w2, weights, ids, *saved, True, True, True, overwrite_saved=True)


def test_second_backward_through_a_retained_graph_recomputes_the_overwritten_activations(device):
    """The first backward wrote its gradients over the saved h and derivatives; a second one
    (retain_graph=True) recomputes them and gives the same gradients, bit for bit."""
    T, E, k, H, I = 37, 4, 2, 64, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    inputs = leaves(x, w1, w2, torch.randn(T, E, device=device))
    grad_out = torch.randn(T, H, device=device)
    out = fused_moe(*inputs, k)
    first = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
    assert out.grad_fn.saved_overwritten
    for a, b in zip(first, torch.autograd.grad(out, inputs, grad_out)):
        assert torch.equal(a, b)


def test_gradient_of_any_layout(device):
    """The incoming gradient may be broadcast (out.sum(): stride 0) or a strided view."""
    T, E, k, H, I = 13, 4, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    logits = torch.randn(T, E, device=device)
    inputs = leaves(x, w1, w2, logits)
    ref_inputs = leaves(*(t.double() for t in inputs))
    for loss in (lambda out: out.sum(), lambda out: (out[:, ::2] * torch.arange(H // 2, device=out.device)).sum()):
        grads = torch.autograd.grad(loss(fused_moe(*inputs, k)), inputs)
        ref = torch.autograd.grad(loss(fused_moe_torch(*ref_inputs, k)), ref_inputs)
        for g, r in zip(grads, ref):
            assert rel_error(g, r) < (1e-5 if device.type == "cpu" else 5e-3)


@pytest.mark.parametrize("row_stride", [40, 48])
def test_token_rows_of_any_row_stride(device, row_stride):
    """Token rows whose stride is not a multiple of 16 elements (40) are copied before the
    kernels read them (read in place they load narrowly, several times slower); a stride that is
    (48) is read in place. Either way the forward and every gradient equal the contiguous call's
    bit for bit, the incoming gradient in such rows too."""
    T, E, k, H, I = 13, 4, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    logits = torch.randn(T, E, device=device)
    grad_out = torch.randn(T, H, device=device)
    rows = torch.full((T, row_stride), float("nan"), device=device)
    rows[:, :H] = x
    grad_rows = torch.full((T, row_stride), float("nan"), device=device)
    grad_rows[:, :H] = grad_out
    assert experts.rows_read_in_place(rows[:, :H]) == (row_stride % 16 == 0)
    results = []
    experts._EXPERTS_PLANS.clear()
    moe_backward._PLANS.clear()
    for buffer, grad in ((x, grad_out), (rows, grad_rows[:, :H])):
        buffer, *weights = leaves(buffer, w1, w2, logits)
        tokens = buffer[:, :H]  # a view of the leaf: its strides reach the kernels
        assert tokens.stride(0) == buffer.stride(0)
        out = fused_moe(tokens, *weights, k)
        grads = torch.autograd.grad(out, [buffer, *weights], grad)
        results.append((out, grads[0][:, :H], *grads[1:]))
    for contiguous, strided in zip(*results):
        assert torch.equal(contiguous, strided)
    for plans in (experts._EXPERTS_PLANS, moe_backward._PLANS):  # the forward's and the backward's
        assert any(plan.copy_x for plan in plans.values()) == (row_stride % 16 != 0)


@pytest.mark.parametrize("T", [3, 200])
def test_backward_launches_are_shipped_builds(device, T):
    E, k, H, I = 8, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    inputs = leaves(x, w1, w2, torch.randn(T, E, device=device))
    clear_records()
    torch.autograd.grad(fused_moe(*inputs, k).square().sum(), inputs)
    capability = info_for(x).capability
    for op in ("moe_gate_up", "moe_route_backward") + BACKWARD_OPS:
        _launched_build(op, capability)


def test_backward_tables_cover_every_forward_block_m():
    for family, by_size in configs.EXPERTS.items():
        for element_size, table in by_size.items():
            forward_block_m = {cfg.block_m for _, cfg in table}
            assert set(configs.BACKWARD[family][element_size]) == forward_block_m, (family, element_size)


@pytest.mark.targets
def test_every_backward_build_compiles_and_fits(compiled_rows):
    for cap in SUPPORTED_TARGETS:
        rows = [r for r in compiled_rows if r["target"] == f"sm{cap}" and r["label"].startswith(BACKWARD_OPS)]
        assert {r["label"] for r in rows} == {b.label for b in builds.shipped_builds(cap)
                                              if b.label.startswith(BACKWARD_OPS)}
        assert all(r["fits"] for r in rows), [(r["label"], r["error"] or r["shared"]) for r in rows if not r["fits"]]


@pytest.mark.targets
def test_hopper_prefill_backward_gemms_use_wgmma(compiled_rows):
    """16-bit backward GEMMs with 64 rows or more per tile run wgmma on sm90."""
    def tile_rows(label):
        return int(label.split("BLOCK_M=")[1].split()[0])

    gemms = [r for r in compiled_rows if r["target"] == "sm90" and r["label"].startswith(BACKWARD_OPS)
             and r["label"].split()[1] in ("fp16", "bf16") and tile_rows(r["label"]) >= 64]
    assert gemms and all(r["wgmma"] for r in gemms), [r["label"] for r in gemms if not r["wgmma"]]


@pytest.fixture
def forced_backward(monkeypatch):
    """force(change): the backward runs change(the table's BackwardConfig) from here on."""
    return config_forcer(monkeypatch, moe_backward, "_PLANS", "backward_config")


def experts_gradients(x, w1, w2, weights, ids, grad_out):
    return grads_of(lambda x, w1, w2, w: fused_experts(x, w1, w2, w, ids), leaves(x, w1, w2, weights), grad_out)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [5, 37])
def test_tma_gradients_are_the_pointer_gradients(device, poisoned, forced_backward, T, dtype):  # noqa: F811
    """With BackwardConfig.tma every backward GEMM reads its dense tiles through tensor descriptors
    and gives the pointer kernels' bits. T = 5: layout blocks of 16 rows, which the weight
    gradients' 32-row steps overrun (into the next expert's rows, or unused blocks that hold
    poison); T = 37: blocks of 32 (fp16) or 64 (fp32) rows, whole steps. Expert 3 receives no
    token; H = I = 48 leaves a ragged last tile in every GEMM, and the last block of an expert
    is ragged."""
    E, k, H, I = 8, 2, 48, 48
    x, w1, w2 = make_layer(T, E, H, I, dtype, device)
    ids = torch.randint(0, E - 1, (T, k), device=device, dtype=torch.int32)
    ids[ids >= 3] += 1
    weights = torch.rand(T, k, device=device)
    grad_out = torch.randn(T, H, device=device).to(dtype)
    grads = {}
    for tma in (False, True):
        forced_backward(functools.partial(dataclasses.replace, tma=tma))
        clear_records()
        grads[tma] = experts_gradients(x, w1, w2, weights, ids, grad_out)
        assert {op: last_launch(op).constexprs["TMA"] for op in BACKWARD_OPS} == dict.fromkeys(
            BACKWARD_OPS, tma and has_tma(device))
    for name, pointer, tma in zip(("x", "w1", "w2", "topk_weights"), grads[False], grads[True]):
        assert torch.equal(pointer, tma), name
    assert torch.all(grads[True][1][3] == 0) and torch.all(grads[True][2][3] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [5, 37])
def test_grad_w1_from_x_in_layout_order_gives_the_gathering_bits(device, poisoned, forced_backward,  # noqa: F811
                                                                 T, dtype):
    """BackwardConfig.gather_x: grad_w1 reads x copied into layout order (zero padding rows)
    through a descriptor instead of gathering it by token, with the gathering kernel's bits.
    T = 5: 32-row steps overrun blocks of 16 rows into the next expert's rows or poisoned unused
    blocks, so the copy's rows past an expert must count as zero: token 0, routed to experts 1
    and 2 only, holds an inf that must not reach expert 0's gradient. Expert 3 gets no token."""
    E, k, H, I = 8, 2, 48, 48
    x, w1, w2 = make_layer(T, E, H, I, dtype, device)
    x[0, 5] = float("inf")
    ids = torch.randint(0, E - 1, (T, k), device=device, dtype=torch.int32)
    ids[ids >= 3] += 1
    ids[0] = torch.tensor([1, 2], dtype=torch.int32)
    ids[1:, 0] = 0
    weights = torch.rand(T, k, device=device)
    grad_out = torch.randn(T, H, device=device).to(dtype)
    grads = {}
    for gather_x in (False, True):
        forced_backward(functools.partial(dataclasses.replace, tma=True, gather_x=gather_x))
        clear_records()
        grads[gather_x] = experts_gradients(x, w1, w2, weights, ids, grad_out)
        assert last_launch("moe_grad_w1").constexprs["X_ROWS"] == (gather_x and has_tma(device))
        assert (last_launch("moe_gather_rows") is not None) == (gather_x and has_tma(device))
    for name, gathered, dense in zip(("x", "w1", "w2", "topk_weights"), grads[False], grads[True]):
        torch.testing.assert_close(dense, gathered, rtol=0, atol=0, equal_nan=True, msg=name)
    grad_w1 = grads[True][1]
    assert torch.all(grad_w1[3] == 0) and torch.isfinite(grad_w1[0]).all()
    keep = ~torch.isinf(x[:, 5])
    x64, w1_64, w2_64 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    out = fused_experts_torch(x64, w1_64, w2_64, weights.double(), ids)
    ref = torch.autograd.grad(out[keep], w1_64, grad_out.double()[keep])[0]
    assert rel_error(grad_w1[0], ref[0]) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_tma_falls_back_where_tensors_are_not_addressable(device, poisoned, forced_backward):  # noqa: F811
    """w2 starting 2 bytes past a 16-byte boundary: grad_gate_up reads it through pointers, the
    other GEMMs still through descriptors, with the same bits as the pointer kernels."""
    T, E, k, H, I = 21, 4, 2, 32, 16
    x, w1, w2 = make_layer(T, E, H, I, torch.float16, device)
    weights, ids = moe_route(torch.randn(T, E, device=device), k)
    grad_out = torch.randn(T, H, device=device).to(torch.float16)
    grads = {}
    for tma in (False, True):
        forced_backward(functools.partial(dataclasses.replace, tma=tma))
        inputs = leaves(x, w1, torch.cat([w2.new_zeros(1), w2.flatten()]), weights)
        shifted_w2 = inputs[2][1:].view(w2.shape)
        assert shifted_w2.data_ptr() % 16 == 2 and not experts.tma_addressable(shifted_w2)
        out = fused_experts(inputs[0], inputs[1], shifted_w2, inputs[3], ids)
        grads[tma] = torch.autograd.grad(out, inputs, grad_out)
    assert last_launch("moe_grad_gate_up").constexprs["TMA"] is False
    assert all(last_launch(op).constexprs["TMA"] == has_tma(device) for op in BACKWARD_OPS[1:])
    for pointer, tma in zip(grads[False], grads[True]):
        assert torch.equal(pointer, tma)


def test_tma_addressable():
    t = torch.zeros(64, 64, dtype=torch.float16)
    assert experts.tma_addressable(t, t[8:], t[:, 8:], t.view(4, 16, 64))
    for bad in (t.flatten()[1:65].view(8, 8),       # base 2 bytes past a 16-byte boundary
                t.as_strided((60, 64), (66, 1)),  # rows 132 bytes apart
                t.t(),                            # last stride not 1
                t[:0]):                           # empty
        assert not experts.tma_addressable(bad)


@pytest.mark.targets
def test_hopper_tma_backward_builds_use_the_copy_engine(compiled_rows):
    """The sm90 builds of entries with `tma` (shipped next to their pointer builds) compile to
    bulk tensor copies for every backward GEMM; the pointer builds to none."""
    backward = [r for r in compiled_rows if r["target"] == "sm90" and r["label"].startswith(BACKWARD_OPS)]
    gluon = [r for r in backward if r["label"].split()[0].endswith("_gluon")]  # TMA by construction
    assert {r["label"].split()[0] for r in gluon} == {f"{op}_gluon" for op in ("moe_grad_gate_up", "moe_grad_w1",
                                                                             "moe_grad_w2")}
    assert all(r["tma"] and r["wgmma"] for r in gluon), [r["label"] for r in gluon]
    backward = [r for r in backward if r not in gluon]
    tma = [r for r in backward if r["label"].endswith(" tma")]
    assert {r["label"].split()[0] for r in tma} == set(BACKWARD_OPS)
    assert all(r["tma"] for r in tma), [r["label"] for r in tma if not r["tma"]]
    assert not any(r["tma"] for r in backward if r not in tma)


def test_eager_autograd_skips_the_custom_op_wrappers_with_the_same_results(device):
    """Outside torch.compile, autograd records fused_moe as torch.autograd.Functions running the
    custom ops' forwards and backwards (not through torch.library's per-call wrappers): the same
    output and gradients, bit for bit, as the ops called themselves."""
    T, E, k, H, I = 37, 4, 2, 64, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
    inputs = leaves(x, w1, w2, torch.randn(T, E, device=device))
    grad_out = torch.randn(T, H, device=device)
    out = fused_moe(*inputs, k)
    assert type(out.grad_fn).__name__ == "_EagerDownBackward"
    grads = torch.autograd.grad(out, inputs, grad_out)
    ops = torch.ops.flashmoe_science
    weights, ids = ops.moe_route(inputs[3], k, True, "softmax")
    saved = ops.moe_experts_gate_up(*inputs[:3], weights, ids, "silu", None, False)
    out_ops = ops.moe_experts_down(*inputs[:3], weights, ids, *saved, False)
    assert "_EagerDown" not in type(out_ops.grad_fn).__name__
    assert torch.equal(out, out_ops)
    for a, b in zip(grads, torch.autograd.grad(out_ops, inputs, grad_out)):
        assert torch.equal(a, b)


def test_compiled_fused_moe_matches_eager(device):
    """torch.compile(fullgraph=True) traces routing, experts and their backward as custom ops;
    the second token count recompiles with a dynamic T."""
    E, k, H, I = 8, 2, 32, 16

    def loss_fn(x, w1, w2, logits):
        weights, ids = moe_route(logits, k)
        return fused_experts(x, w1, w2, weights, ids).square().mean() + fused_moe(x, w1, w2, logits, k).mean()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    for T in (24, 37):
        x, w1, w2 = make_layer(T, E, H, I, torch.float32, device)
        inputs = leaves(x, w1, w2, torch.randn(T, E, device=device))
        loss = compiled(*inputs)
        grads = torch.autograd.grad(loss, inputs)
        eager_loss = loss_fn(*inputs)
        eager_grads = torch.autograd.grad(eager_loss, inputs)
        assert torch.equal(loss, eager_loss)
        for g, e in zip(grads, eager_grads):
            assert torch.equal(g, e)


# (name, E, k, H, I, T): model shapes at a training-sized token count.
REAL_SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, 512), ("deepseek-v2-lite", 64, 6, 2048, 1408, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,E,k,H,I,T", REAL_SHAPES)
def test_bf16_gradients_real_shapes(name, E, k, H, I, T):
    """Gradients for x, w1, w2 and the routing weights (our routing, as bf16 logits tie)."""
    x, w1, w2 = make_layer(T, E, H, I, torch.bfloat16, "cuda")
    weights, ids = moe_route(torch.randn(T, E, device="cuda", dtype=torch.bfloat16), k)
    grad_out = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    inputs = leaves(x, w1, w2, weights)
    _, grads = grads_of(lambda x, w1, w2, w: fused_experts(x, w1, w2, w, ids), inputs, grad_out)
    _, torch_grads = grads_of(lambda x, w1, w2, w: fused_experts_torch(x, w1, w2, w, ids), leaves(*inputs), grad_out)
    _, ref = grads_of(lambda x, w1, w2, w: fused_experts_torch(x, w1, w2, w, ids),
                      leaves(*(t.double() for t in inputs)), grad_out.double())
    check_grads(grads, ref, torch_grads, ("x", "w1", "w2", "topk_weights"), atol=1e-3)


@pytest.mark.gpu
def test_gpt_oss_bf16_gradients_real_width():
    """gpt-oss-20b's experts' widths (top-4, H = I = 2880) in bf16, as transformers stores them, with 8
    of its 32 experts (the float64 reference of all 32 holds tens of GB)."""
    gpt_oss_gradient_check("cuda", 512, 8, 4, 2880, 2880, torch.bfloat16, atol=1e-3)


@pytest.mark.gpu
def test_backward_deterministic_and_no_host_sync():
    T, E, k, H, I = 4096, 128, 8, 2048, 768
    x, w1, w2 = make_layer(T, E, H, I, torch.bfloat16, "cuda")
    inputs = leaves(x, w1, w2, torch.randn(T, E, device="cuda"))
    grad_out = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    first = torch.autograd.grad(fused_moe(*inputs, k), inputs, grad_out)
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = torch.autograd.grad(fused_moe(*inputs, k), inputs, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# (name, E, k, H, I, T, the Gluon d w1): on Hopper, layouts of 128-row blocks run the Gluon
# grad_gate_up, those of 64 rows the Triton one; both run the Gluon weight-gradient kernel, for d w1
# too but where 2I is not a multiple of its 128-row tiles (I = 1120, which also ends in one of three
# epilogue chunks) and where H < I from GATHER_X_MIN_LOAD pairs an expert (the gather_x entry);
# I = 2880 (gpt-oss's width) ends in a partial column tile of both.
GLUON_SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, 2048, True), ("i-2880", 8, 2, 3072, 2880, 1024, True),
                ("h-below-i", 4, 2, 1024, 1120, 1024, False), ("h-below-i-small-load", 4, 2, 1024, 1536, 1024, True),
                ("h-below-i-gather-x", 4, 2, 1024, 1536, 2 * configs.GATHER_X_MIN_LOAD, False),
                ("64-row-blocks", 64, 6, 2048, 1408, 1024, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,E,k,H,I,T,gluon_w1", GLUON_SHAPES)
def test_gluon_backward_gradients(name, E, k, H, I, T, gluon_w1):
    """The Gluon d [gate, up] and weight-gradient kernels (sm90) against the float64 reference: every
    gradient, with a dropped slot (id -1) and an idle expert (its weight gradients zero), and the
    kernels it ran named."""
    if info_for(torch.empty(0, device="cuda")).capability != 90:
        pytest.skip("the Gluon backward kernel runs on sm90")
    x, w1, w2 = make_layer(T, E, H, I, torch.bfloat16, "cuda")
    weights, ids = moe_route(torch.randn(T, E, device="cuda", dtype=torch.bfloat16), k)
    ids = torch.where(ids == E - 1, 0, ids)  # expert E - 1 gets no token
    ids[0, 0] = -1  # a dropped slot: no gradient flows through it
    grad_out = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    inputs = leaves(x, w1, w2, weights)
    clear_records()
    _, grads = grads_of(lambda x, w1, w2, w: fused_experts(x, w1, w2, w, ids), inputs, grad_out)
    rows_128 = configs.experts_config(info_for(x), 2, T, k, E, H, I).block_m == 128
    assert (last_launch("moe_grad_gate_up_gluon") is not None) == rows_128
    assert (last_launch("moe_grad_gate_up") is None) == rows_128
    for name, gluon in (("grad_w1", gluon_w1), ("grad_w2", True)):
        assert (last_launch(f"moe_{name}_gluon") is not None) == gluon
        assert (last_launch(f"moe_{name}") is None) == gluon
    assert not grads[1][E - 1].any() and not grads[2][E - 1].any()
    _, torch_grads = grads_of(lambda x, w1, w2, w: fused_experts_torch(x, w1, w2, w, ids), leaves(*inputs), grad_out)
    _, ref = grads_of(lambda x, w1, w2, w: fused_experts_torch(x, w1, w2, w, ids),
                      leaves(*(t.double() for t in inputs)), grad_out.double())
    check_grads(grads, ref, torch_grads, ("x", "w1", "w2", "topk_weights"), atol=1e-3)


def test_gluon_backward_needs_the_gpu_and_its_layout(device, poisoned, forced_backward):  # noqa: F811
    """A configuration asking for the Gluon backward kernels runs the Triton ones where the Gluon
    kernels cannot: in the interpreter (and on the CPU), over blocks other than 128 rows (d [gate,
    up]) or of part of a 64-row K step (the weight gradients)."""
    forced_backward(lambda cfg: dataclasses.replace(cfg, gluon_stages=3, gluon_weight_grad_stages=3))
    T, E, k, H, I = 37, 4, 2, 64, 32
    x, w1, w2 = make_layer(T, E, H, I, torch.float16, device)
    inputs = leaves(x, w1, w2, torch.randn(T, E, device=device))
    clear_records()
    torch.autograd.grad(fused_moe(*inputs, k).square().sum(), inputs)
    for name in ("grad_gate_up", "grad_w1", "grad_w2"):
        assert last_launch(f"moe_{name}") is not None and last_launch(f"moe_{name}_gluon") is None


@pytest.mark.gpu
def test_gluon_backward_replays_in_a_cuda_graph():
    """forward+backward with the Gluon d [gate, up] and weight-gradient kernels, captured in a CUDA
    graph: its replay gives the eager call's gradients bit for bit."""
    if info_for(torch.empty(0, device="cuda")).capability != 90:
        pytest.skip("the Gluon backward kernel runs on sm90")
    T, E, k, H, I = 2048, 16, 2, 512, 256
    x, w1, w2 = make_layer(T, E, H, I, torch.bfloat16, "cuda")
    inputs = leaves(x, w1, w2, torch.randn(T, E, device="cuda"))
    grad_out = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(fused_moe(*inputs, k), inputs, grad_out)

    clear_records()
    eager = step()
    for name in ("grad_gate_up", "grad_w1", "grad_w2"):
        assert last_launch(f"moe_{name}_gluon") is not None
    graph, captured = captured_graph(step)
    for g in captured:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
