"""torch.compile traces `flash_attention_science` through its torch.library ops: no graph break
(fullgraph=True), forward and backward, and the same results as eager.

On the CPU the `aot_eager` backend traces forward and backward with the fake implementations and
runs the kernels through Triton's interpreter (inductor would also work, but compiling its C++
takes longer than this whole file); the GPU test uses the default inductor backend.
"""
import pytest
import torch

from flashmoe_science import flash_attention_science
from flashmoe_science.launch import clear_records, last_launch
from test_attention_forward import make_qkv


class TinyAttentionBlock(torch.nn.Module):
    """Projections around grouped-query causal attention, with q, k, v as (B, S, H, D) views."""

    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(dim, heads * head_dim)
        self.kv_proj = torch.nn.Linear(dim, 2 * kv_heads * head_dim)
        self.out_proj = torch.nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(batch, seqlen, 2, self.kv_heads, self.head_dim).unbind(2)
        out = flash_attention_science(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seqlen, -1))


def _loss_and_grads(model, x):
    x = x.detach().requires_grad_()
    loss = model(x).square().mean()
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return loss.detach(), grads


def test_compiled_attention_function_equals_eager(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 24, 40, 32, torch.float32, device, layout="bshd"))
    grad_out, grad_lse = torch.randn_like(q), torch.randn(1, 4, 24, device=device)

    def attention(q, k, v):
        return flash_attention_science(q, k, v, causal=True, return_lse=True)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    clear_records()
    out, lse = compiled(q, k, v)
    compiled_grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    assert last_launch("attention_backward_dkdv") is not None and last_launch("attention_backward_dq") is not None
    eager_out, eager_lse = attention(q, k, v)
    eager_grads = torch.autograd.grad((eager_out, eager_lse), (q, k, v), (grad_out, grad_lse))
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    for c, e in zip(compiled_grads, eager_grads):
        assert torch.equal(c, e)


def test_compiled_model_fullgraph_forward_and_backward(device):
    torch.manual_seed(0)
    model = TinyAttentionBlock(dim=48, heads=4, kv_heads=2, head_dim=16).to(device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for seqlen in (20, 37):  # the second length recompiles with dynamic shapes
        x = torch.randn(2, seqlen, 48, device=device)
        loss, grads = _loss_and_grads(compiled, x)
        eager_loss, eager_grads = _loss_and_grads(model, x)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for c, e in zip(grads, eager_grads):
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_inductor_compiled_model_matches_eager():
    torch.manual_seed(0)
    model = TinyAttentionBlock(dim=512, heads=8, kv_heads=2, head_dim=64).cuda().to(torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 300, 512, device="cuda", dtype=torch.bfloat16)
    clear_records()
    loss, grads = _loss_and_grads(compiled, x)
    assert last_launch("attention_backward_dkdv") is not None
    eager_loss, eager_grads = _loss_and_grads(model, x)
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=1e-3)
    for c, e in zip(grads, eager_grads):
        assert torch.isfinite(c).all()
        rel = ((c.float() - e.float()).norm() / e.float().norm()).item()
        assert rel < 2e-2, rel


@pytest.mark.parametrize("paged", [False, True])
def test_compiled_kv_cache_decode_step_equals_eager(device, paged):
    """A decode step (append the new key and value, attend) under torch.compile(fullgraph=True):
    one custom op that mutates the caches; outputs, lse and caches as eager."""
    from flashmoe_science import flash_attention_with_kvcache

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, cached = 2, 4, 2, 32, 40
    q = torch.randn(batch, 1, heads, dim, device=device)
    k_new, v_new = (torch.randn(batch, 1, kv_heads, dim, device=device) for _ in range(2))
    seqlens = torch.tensor([cached, 17], dtype=torch.int32, device=device)
    if paged:
        cache = torch.randn(8, 16, kv_heads, dim, device=device)
        table = torch.tensor([[3, 0, 5, 6], [1, 2, 4, 7]], dtype=torch.int32, device=device)
    else:
        cache, table = torch.randn(batch, 64, kv_heads, dim, device=device), None
    caches = [(cache.clone(), cache.clone() * 0.5) for _ in range(2)]

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                            return_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, *caches[0], k_new, v_new, seqlens)
    eager_out, eager_lse = step(q, *caches[1], k_new, v_new, seqlens)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[0][0], cache)  # the new key was written
    out_int = torch.compile(lambda q, kc, vc: flash_attention_with_kvcache(q, kc, vc, cache_seqlens=17,
                                                                           block_table=table),
                            fullgraph=True, backend="aot_eager")(q, *caches[0])
    assert torch.equal(out_int, flash_attention_with_kvcache(q, *caches[1], cache_seqlens=17, block_table=table))


def test_compiled_fp8_kv_cache_step_equals_eager(device):
    """An FP8 cache with per-token descales under torch.compile(fullgraph=True): the custom op
    writes the appended tokens' values and descales as eager does."""
    from flashmoe_science import flash_attention_with_kvcache

    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 32, device=device)
    k_new, v_new = (torch.randn(2, 1, 2, 32, device=device) for _ in range(2))
    seqlens = torch.tensor([40, 17], dtype=torch.int32, device=device)
    cache = torch.randn(2, 64, 2, 32, device=device).to(torch.float8_e4m3fn)
    descale = torch.rand(2, 64, 2, device=device) + 0.5
    states = [(cache.clone(), cache.clone(), descale.clone(), descale.clone()) for _ in range(2)]

    def step(q, k_cache, v_cache, k_descale, v_descale, k, v, seqlens):
        return flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, k_descale=k_descale,
                                            v_descale=v_descale)

    out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *states[0], k_new, v_new, seqlens)
    eager = step(q, *states[1], k_new, v_new, seqlens)
    assert torch.equal(out, eager)
    for ours, theirs in zip(states[0], states[1]):
        assert torch.equal(ours.view(torch.uint8) if ours.dtype == torch.float8_e4m3fn else ours,
                           theirs.view(torch.uint8) if theirs.dtype == torch.float8_e4m3fn else theirs)
    assert not torch.equal(states[0][2], descale)  # the new tokens' descales were written
