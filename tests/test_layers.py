"""FlashMoELayer and FlashMoEScienceAttention: the same outputs and gradients as plain PyTorch
reimplementations on the same weights (Hugging Face's Mixtral / Qwen-MoE / DeepSeek-MoE blocks,
SDPA attention), the router's losses and counts, bad arguments, and torch.compile of a model
built from both layers."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashmoe_science.layers import FlashMoELayer, FlashMoEScienceAttention, router_losses
from flashmoe_science.launch import clear_records, last_launch


def rel_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class HFExpert(nn.Module):
    """One expert of a Hugging Face block, in either naming: Mixtral's w1 (gate), w3 (up), w2
    (down) or Qwen-MoE's gate_proj, up_proj, down_proj."""

    def __init__(self, hidden, inter, naming):
        super().__init__()
        self.names = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}[naming]
        gate, up, down = self.names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(F.silu(gate(x)) * up(x))


class HFSparseMoeBlock(nn.Module):
    """The Mixtral / Qwen-MoE sparse block as transformers writes it: softmax router in fp32,
    top-k, optional renormalisation, a loop over experts with index_add; DeepSeek-MoE's ungated
    shared experts when shared_inter > 0."""

    def __init__(self, hidden, num_experts, inter, top_k, naming, norm_topk_prob=True, shared_inter=0):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(HFExpert(hidden, inter, naming) for _ in range(num_experts))
        self.shared_experts = HFExpert(hidden, shared_inter, "qwen") if shared_inter else None

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens, slots = torch.where(selected == e)
            out.index_add_(0, tokens, expert(x[tokens]) * weights[tokens, slots, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)


def parameter_grads(module, x, grad_out):
    x = x.detach().requires_grad_()
    out = module(x)
    return out, torch.autograd.grad(out, [x, *module.parameters()], grad_out)


@pytest.mark.parametrize("naming,norm_topk_prob,shared_inter", [("mixtral", True, 0), ("qwen", False, 0),
                                                                ("qwen", True, 32)])
def test_moe_layer_reproduces_hugging_face_blocks(device, naming, norm_topk_prob, shared_inter):
    """Outputs and gradients (input, router, every expert projection) equal the plain block's
    on the same weights, read through from_hf_experts."""
    H, E, I, k = 32, 6, 16, 2
    block = HFSparseMoeBlock(H, E, I, k, naming, norm_topk_prob, shared_inter).to(device)
    layer = FlashMoELayer.from_hf_experts(block, k, renormalize=norm_topk_prob)
    assert (layer.num_experts, layer.hidden_size, layer.expert_dim) == (E, H, I)
    assert layer.num_shared_experts == shared_inter // I
    x = torch.randn(3, 11, H, device=device)
    grad_out = torch.randn_like(x)
    out, grads = parameter_grads(layer, x, grad_out)
    ref, ref_grads = parameter_grads(block, x, grad_out)
    tolerance = 1e-5 if device.type == "cpu" else 5e-3  # tf32 products on the GPU
    assert rel_error(out, ref) < tolerance
    assert rel_error(grads[0], ref_grads[0]) < tolerance
    ref_params = dict(zip((n for n, _ in block.named_parameters()), ref_grads[1:]))
    params = dict(zip((n for n, _ in layer.named_parameters()), grads[1:]))
    assert rel_error(params["router.weight"], ref_params["gate.weight"]) < tolerance
    gate, up, down = block.experts[0].names
    for e in range(E):
        routed = ref_params[f"experts.{e}.{gate}.weight"].abs().sum() > 0
        for ours, theirs in ((params["w1"][e, :I], ref_params[f"experts.{e}.{gate}.weight"]),
                             (params["w1"][e, I:], ref_params[f"experts.{e}.{up}.weight"]),
                             (params["w2"][e], ref_params[f"experts.{e}.{down}.weight"])):
            if routed:
                assert rel_error(ours, theirs) < tolerance
            else:
                assert torch.all(ours == 0)
    if shared_inter:
        shared = torch.cat([ref_params["shared_experts.gate_proj.weight"], ref_params["shared_experts.up_proj.weight"]])
        assert rel_error(params["shared_w1"], shared) < tolerance
        assert rel_error(params["shared_w2"], ref_params["shared_experts.down_proj.weight"]) < tolerance


def test_load_hf_experts_refuses_what_it_cannot_reproduce():
    H, E, I = 32, 4, 16
    state = HFSparseMoeBlock(H, E, I, 2, "mixtral").state_dict()
    layer = FlashMoELayer(H, E, I)
    with pytest.raises(KeyError, match="experts.3.w2.weight"):
        layer.load_hf_experts({k: v for k, v in state.items() if k != "experts.3.w2.weight"})
    with pytest.raises(ValueError, match=r"gate.weight has shape \(4, 32\), expected \(4, 48\)"):
        FlashMoELayer(48, E, I).load_hf_experts(state)
    with pytest.raises(ValueError, match=r"gate.weight has shape \(4, 32\), expected \(3, 32\)"):
        FlashMoELayer(H, 3, I).load_hf_experts(state)
    with pytest.raises(KeyError, match="neither Mixtral's"):
        layer.load_hf_experts({"gate.weight": state["gate.weight"]})
    with pytest.raises(ValueError, match="gated shared expert"):
        layer.load_hf_experts({**state, "shared_expert_gate.weight": torch.zeros(1, H)})
    with pytest.raises(ValueError, match="num_shared_experts > 0"):
        layer.load_hf_experts({**state, "shared_experts.gate_proj.weight": torch.zeros(I, H)})
    with pytest.raises(TypeError, match="source must be an nn.Module or a state dict"):
        layer.load_hf_experts([1, 2])


def test_router_losses_and_counts(device):
    H, E, I, k = 32, 8, 16, 2
    layer = FlashMoELayer(H, E, I, k, router_aux_loss_coef=0.02, router_z_loss_coef=1e-3, device=device)
    x = torch.randn(4, 9, H, device=device)
    layer(x)
    logits = layer.router(x.reshape(-1, H)).double()
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, k, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=E)
    assert torch.equal(layer.tokens_per_expert, counts) and layer.tokens_per_expert.dtype == torch.int64
    expected_aux = 0.02 * E * ((counts / (x.shape[0] * x.shape[1] * k)) * probs.mean(dim=0)).sum()
    expected_z = 1e-3 * torch.logsumexp(logits, dim=-1).square().mean()
    torch.testing.assert_close(layer.aux_loss.double(), expected_aux, rtol=1e-5, atol=0)
    torch.testing.assert_close(layer.z_loss.double(), expected_z, rtol=1e-5, atol=0)
    router_grad, = torch.autograd.grad(router_losses(layer), layer.router.weight)
    assert router_grad.abs().sum() > 0
    plain = FlashMoELayer(H, E, I, k, device=device)
    model = nn.Sequential(layer, plain)
    model(x)
    assert plain.aux_loss.item() == 0 and plain.z_loss.item() == 0
    torch.testing.assert_close(router_losses(model), layer.aux_loss + layer.z_loss)


def test_moe_layer_shapes_and_empty_input(device):
    H, E, I = 32, 4, 16
    layer = FlashMoELayer(H, E, I, router_aux_loss_coef=0.1, device=device)
    for shape in ((H,), (5, H), (2, 3, 4, H)):
        assert layer(torch.randn(shape, device=device)).shape == shape
    out = layer(torch.randn(0, 7, H, device=device))
    assert out.shape == (0, 7, H)
    assert layer.aux_loss.item() == 0 and layer.tokens_per_expert.sum().item() == 0


def test_moe_layer_initialisation_and_layout(device):
    H, E, I = 64, 4, 32
    layer = FlashMoELayer(H, E, I, num_shared_experts=2, dtype=torch.float16, device=device)
    assert layer.w1.shape == (E, 2 * I, H) and layer.w2.shape == (E, H, I) and layer.router.weight.shape == (E, H)
    assert layer.shared_w1.shape == (4 * I, H) and layer.shared_w2.shape == (H, 2 * I)
    assert layer.w1.dtype == torch.float16 and layer.w1.device.type == device.type
    assert layer.w1.abs().max() <= 1 / math.sqrt(H) and layer.w2.abs().max() <= 1 / math.sqrt(I)
    assert layer.w1.std() > 0.5 / math.sqrt(3 * H)  # uniform on +-1/sqrt(H): std 1/sqrt(3H)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(hidden_size=40), ValueError, "hidden_size must be a multiple of 16"),
    (dict(expert_dim=8), ValueError, "expert_dim must be at least 16"),
    (dict(num_experts=0), ValueError, "num_experts must be between 1 and 256"),
    (dict(top_k=5), ValueError, "top_k must be between 1 and 4"),
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool"),
    (dict(num_shared_experts=-1), ValueError, "num_shared_experts must be at least 0"),
    (dict(router_aux_loss_coef=-0.1), ValueError, "router_aux_loss_coef must be finite and non-negative"),
    (dict(router_z_loss_coef="1"), TypeError, "router_z_loss_coef must be a float"),
])
def test_moe_layer_bad_arguments(kwargs, error, match):
    args = dict(hidden_size=32, num_experts=4, expert_dim=16, top_k=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        FlashMoELayer(args.pop("hidden_size"), args.pop("num_experts"), args.pop("expert_dim"), **args)


def test_moe_layer_bad_input(device):
    layer = FlashMoELayer(32, 4, 16, device=device)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., hidden_size = 32\)"):
        layer(torch.randn(3, 16, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.float16 but the layer's parameters are torch.float32"):
        layer(torch.randn(3, 32, device=device).half())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([0.0] * 32)


def sdpa_attention(layer, x):
    """The same attention in plain PyTorch ops on the layer's weights: SDPA with K and V
    repeated for grouped-query attention."""
    batch, seqlen, _ = x.shape
    heads, kv_heads, head_dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = layer.qkv(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(batch, seqlen, heads, head_dim).transpose(1, 2)
    k, v = (t.view(batch, seqlen, kv_heads, head_dim).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=layer.causal)
    return layer.out(out.transpose(1, 2).reshape(batch, seqlen, heads * head_dim))


@pytest.mark.parametrize("n_heads,n_kv_heads,causal,bias", [(4, None, False, False), (4, 2, True, True),
                                                            (4, 1, True, False)])
def test_attention_layer_matches_sdpa(device, n_heads, n_kv_heads, causal, bias):
    dim = 64
    layer = FlashMoEScienceAttention(dim, n_heads, n_kv_heads, causal=causal, bias=bias, device=device)
    x = torch.randn(2, 21, dim, device=device)
    grad_out = torch.randn_like(x)
    out, grads = parameter_grads(layer, x, grad_out)
    x_ref = x.detach().requires_grad_()
    ref = sdpa_attention(layer, x_ref)
    ref_grads = torch.autograd.grad(ref, [x_ref, *layer.parameters()], grad_out)
    assert out.shape == x.shape
    tolerance = 1e-5 if device.type == "cpu" else 5e-3  # tf32 products on the GPU
    assert rel_error(out, ref) < tolerance
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < tolerance


def test_attention_layer_reads_strided_views(device):
    """q, k, v reach the kernel as views of the projection (no copy is made for them)."""
    layer = FlashMoEScienceAttention(64, 4, 2, device=device)
    x = torch.randn(2, 9, 64, device=device)
    clear_records()
    layer(x)
    assert last_launch("attention_forward") is not None
    qkv = layer.qkv(x).view(2, 9, 8, 16)
    q = qkv[:, :, :4].transpose(1, 2)
    assert q.stride() == (9 * 8 * 16, 16, 8 * 16, 1)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((60, 8), {}, ValueError, r"dim \(60\) must be a multiple of n_heads \(8\)"),
    ((64, 4, 3), {}, ValueError, r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
    ((64, 8), {}, ValueError, "head_dim = dim / n_heads = 8 must be between 16 and 256"),
    ((64, 0), {}, ValueError, "n_heads must be positive"),
    ((64.0, 4), {}, TypeError, "dim must be an int"),
    ((64, 4), {"causal": 1}, TypeError, "causal must be a bool"),
])
def test_attention_layer_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        FlashMoEScienceAttention(*args, **kwargs)


def test_attention_layer_bad_input(device):
    layer = FlashMoEScienceAttention(64, 4, device=device)
    with pytest.raises(ValueError, match=r"x must be \(batch, seqlen, dim = 64\)"):
        layer(torch.randn(2, 9, 32, device=device))
    with pytest.raises(ValueError, match=r"x must be \(batch, seqlen, dim = 64\)"):
        layer(torch.randn(9, 64, device=device))


class TinyMoETransformer(nn.Module):
    """Embedding, blocks of [norm, attention, norm, MoE] with residuals, and a head."""

    def __init__(self, vocab, dim, heads, kv_heads, experts, expert_dim, top_k, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.ModuleList([
            nn.LayerNorm(dim), FlashMoEScienceAttention(dim, heads, kv_heads, causal=True),
            nn.LayerNorm(dim), FlashMoELayer(dim, experts, expert_dim, top_k, router_aux_loss_coef=0.01,
                                             router_z_loss_coef=1e-3)]) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for attention_norm, attention, moe_norm, moe in self.blocks:
            x = x + attention(attention_norm(x))
            x = x + moe(moe_norm(x))
        return self.head(x)


def loss_and_grads(model, tokens):
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + router_losses(model)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def test_compiled_model_of_the_layers_equals_eager(device):
    """torch.compile(fullgraph=True): no graph break in a model of both layers, forward and
    backward, with the router statistics set as module attributes; a second sequence length
    recompiles with dynamic shapes."""
    torch.manual_seed(0)
    model = TinyMoETransformer(vocab=50, dim=64, heads=4, kv_heads=2, experts=4, expert_dim=32, top_k=2).to(device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for seqlen in (13, 22):
        tokens = torch.randint(0, 50, (2, seqlen), device=device)
        loss, grads = loss_and_grads(compiled, tokens)
        counts = [block[3].tokens_per_expert.clone() for block in model.blocks]
        eager_loss, eager_grads = loss_and_grads(model, tokens)
        assert all(torch.equal(c, block[3].tokens_per_expert) for c, block in zip(counts, model.blocks))
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for c, e in zip(grads, eager_grads):
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_inductor_compiled_model_matches_eager():
    torch.manual_seed(0)
    model = TinyMoETransformer(vocab=512, dim=512, heads=8, kv_heads=2, experts=16, expert_dim=256,
                               top_k=4).cuda().to(torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, 512, (4, 256), device="cuda")
    clear_records()
    loss, grads = loss_and_grads(compiled, tokens)
    # d w1 on the Triton kernel or, on Hopper, the Gluon one (`configs.BackwardConfig`)
    assert last_launch("moe_grad_w1") is not None or last_launch("moe_grad_w1_gluon") is not None
    assert last_launch("attention_backward_dq") is not None
    eager_loss, eager_grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=1e-2)
    # Inductor rounds the bf16 router logits differently, which can flip a near-tied routing
    # choice and move one expert's gradient: compare the gradient of the whole model.
    assert all(torch.isfinite(c).all() for c in grads)
    assert rel_error(torch.cat([c.flatten() for c in grads]), torch.cat([e.flatten() for e in eager_grads])) < 3e-2
