"""Hugging Face transformers models on our kernels (`flashmoe_science.integrations.transformers`):
tiny random configurations of real model classes, attn_implementation="fms" and
experts_implementation="fms" against the model's own "eager" implementations, on the CPU through
the interpreter in fp32 (on the GPU where there is one): logits, parameter gradients, padded
batches, greedy generation."""
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from flashmoe_science.integrations.transformers import register  # noqa: E402
from flashmoe_science.launch import clear_records, last_launch  # noqa: E402

register()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Small widths (multiples of 16, as the kernels need), two layers, weights drawn large enough
# (initializer_range) that each layer moves the residual stream well above fp32 rounding.
_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=128, initializer_range=0.2)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                     num_experts_per_tok=2, **_COMMON),
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                  **_COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                              **{k: v for k, v in _COMMON.items() if k != "head_dim"}),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=32, num_experts=4,
                                                     num_experts_per_tok=2,
                                                     **{k: v for k, v in _COMMON.items() if k != "head_dim"}),
    # Multi-head latent attention: q/k head dim 48 (32 + 16 rotary), v head dim 32, through our
    # attention as it is (no padding of v); sigmoid group routing with a shared expert.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=128, initializer_range=0.2),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=128, initializer_range=0.2),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                                   num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                                                   first_k_dense_replace=1, **_COMMON),
    "granitemoe": lambda: transformers.GraniteMoeConfig(intermediate_size=32, num_local_experts=4,
                                                        num_experts_per_tok=2,
                                                        **{k: v for k, v in _COMMON.items() if k != "head_dim"}),
    # gated delta-net layers (transformers' PyTorch fallback) with full attention every 4th layer
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, **{**_COMMON, "num_hidden_layers": 4}),
    "minimax": lambda: transformers.MiniMaxConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                  **_COMMON),
    "phimoe": lambda: transformers.PhimoeConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                **{k: v for k, v in _COMMON.items() if k != "head_dim"}),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                            moe_num_experts=4, moe_k=2, **_COMMON),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(intermediate_size=32, num_experts=4, moe_topk=2,
                                                              **_COMMON),
}
# Families whose router draws random numbers in training mode (PhiMoE's jitter and sparsemixer
# sampling): compared in eval mode, where it is deterministic.
RANDOM_IN_TRAINING = {"phimoe"}


def models(family, attn="fms", experts="fms"):
    """(eager model, ours) with the same weights, fp32, on DEVICE. Each model has its own config:
    from_config records the implementations in the config it is given, and a model reads them
    from there at every call, so a shared config would run both models on the last one's."""
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager",
                                                          experts_implementation="eager").float()
    ours = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation=attn,
                                                         experts_implementation=experts).float()
    assert (eager.config._attn_implementation, ours.config._attn_implementation) == ("eager", attn)
    ours.load_state_dict(eager.state_dict())
    return eager.to(DEVICE), ours.to(DEVICE)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_gradients_match_eager(family):
    eager, ours = models(family)
    if family in RANDOM_IN_TRAINING:
        eager.eval(), ours.eval()
    ids = torch.randint(0, 96, (2, 24), device=DEVICE)
    clear_records()
    out = ours(ids, labels=ids)
    assert last_launch("attention_forward") is not None and last_launch("moe_gate_up") is not None
    ref = eager(ids, labels=ids)
    assert rel(out.logits, ref.logits) < 1e-5
    out.loss.backward()
    ref.loss.backward()
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), eager.named_parameters()):
        if p_ref.grad is not None and p_ref.grad.norm() > 0:
            assert rel(p.grad, p_ref.grad) < 1e-4, name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_padded_batches_go_through_packed_sequences(family):
    eager, ours = models(family)
    ids = torch.randint(0, 96, (3, 20), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[2, 15:] = 0  # right padding
    clear_records()
    logits = ours(ids, attention_mask=mask).logits
    assert last_launch("attention_forward").constexprs["VARLEN"] is True
    ref = eager(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert rel(logits[valid], ref[valid]) < 1e-5


def test_a_padding_mask_is_read_once_a_forward_not_once_a_layer(monkeypatch):
    """Packing a padded batch and checking a left-padded one read the mask back to the host (a
    sync): done once per mask, which every layer of a forward shares, with every layer still
    matching eager."""
    from flashmoe_science.integrations import transformers as integration

    found = {"packing": 0, "left padding": 0}
    for name, what in (("_packing", "packing"), ("_left_padding", "left padding")):
        def counted(*args, _find=getattr(integration, name), _what=what):
            found[_what] += 1
            return _find(*args)
        monkeypatch.setattr(integration, name, counted)
    eager, ours = models("qwen3_moe")
    ids = torch.randint(0, 96, (3, 20), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, 15:] = 0
    valid = mask.bool()
    assert rel(ours(ids, attention_mask=mask).logits[valid], eager(ids, attention_mask=mask).logits[valid]) < 1e-5
    assert found == {"packing": 1, "left padding": 0}  # two layers, one reading
    prompt, options = _prompt(padded=True)
    options.update(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    out, ref = ours.generate(prompt, **options), eager.generate(prompt, **options)
    assert all(rel(a, b) < 1e-5 for a, b in zip(out.logits, ref.logits))
    assert found == {"packing": 1, "left padding": 4}  # the prompt and each of 3 decode steps: one reading


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_rows_packed_by_position_ids_attend_within_each_sequence(family):
    """Padding-free training (transformers' DataCollatorWithFlattening): sequences packed into rows
    with no mask, told apart by position ids that start again: each attends to itself only, as
    transformers' eager masks cut them (logits and every gradient) and as each run alone; the
    same with flash-attn's cu_seq_lens / max_length arguments."""
    eager, ours = models(family)
    ids = torch.randint(0, 96, (2, 12), device=DEVICE)
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.arange(12)]).to(DEVICE)
    clear_records()
    out = ours(ids, position_ids=positions, labels=ids, use_cache=False)
    assert last_launch("attention_forward").constexprs["VARLEN"] is True
    ref = eager(ids, position_ids=positions, labels=ids, use_cache=False)
    alone = [eager(ids[:1, :5], use_cache=False).logits, eager(ids[:1, 5:], use_cache=False).logits,
             eager(ids[1:], use_cache=False).logits]
    assert rel(out.logits, ref.logits) < 1e-5
    assert rel(out.logits, torch.cat([torch.cat(alone[:2], 1), alone[2]])) < 1e-5
    out.loss.backward()
    ref.loss.backward()
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), eager.named_parameters()):
        if p_ref.grad is not None and p_ref.grad.norm() > 0:
            assert rel(p.grad, p_ref.grad) < 1e-4, name
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    with torch.no_grad():
        logits = ours(ids[:1], position_ids=positions[:1], use_cache=False, **flash_kwargs).logits
    assert rel(logits, torch.cat(alone[:2], 1)) < 1e-5


def test_compiled_rows_packed_by_position_ids_come_out_nan():
    """Under torch.compile position ids are not read back: a row of packed sequences comes out NaN
    (visible) rather than attending across them; rows of one sequence are unchanged."""
    from flashmoe_science.integrations.transformers import fms_attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    query, key, value = (torch.randn(2, 2, 8, 16, device=DEVICE) for _ in range(3))
    positions = torch.stack([torch.arange(8), torch.cat([torch.arange(3), torch.arange(5)])]).to(DEVICE)

    def attention(query, key, value, positions):
        return fms_attention_forward(module, query, key, value, None, position_ids=positions)[0]

    out = torch.compile(attention, fullgraph=True, backend="aot_eager")(query, key, value, positions)
    assert out[1].isnan().all() and not out[0].isnan().any()
    dense = fms_attention_forward(module, query, key, value, None)[0]
    assert torch.equal(out[0], dense[0])


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_greedy_generation_gives_eager_tokens(family):
    eager, ours = models(family)
    prompt = torch.randint(0, 96, (1, 6), device=DEVICE)
    tokens = ours.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(tokens, eager.generate(prompt, max_new_tokens=16, do_sample=False))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [True, False])
def test_generation_gives_eager_logits(cache, padded):
    """Every step's logits of greedy decoding, of a left-padded batch or of one sequence given no
    mask. A static cache hands the attention all its slots, the unfilled ones too, with a padding
    mask as long as the tokens so far or (transformers 5.24, nothing padded) none; the last step fills
    the cache."""
    eager, ours = models("qwen3_moe")
    prompt, options = _prompt(padded)
    options.update(max_new_tokens=5, do_sample=False, cache_implementation=cache, return_dict_in_generate=True,
                   output_logits=True)
    clear_records()
    out, ref = ours.generate(prompt, **options), eager.generate(prompt, **options)
    if padded or cache == "static":  # the decode steps: the KV-cache kernels (one sequence of 6 to 10
        # keys and a dynamic cache: the dense kernels, `configs.takes_decode`)
        assert last_launch("attention_decode_split") is not None
    assert torch.equal(out.sequences, ref.sequences)
    for step, (logits, ref_logits) in enumerate(zip(out.logits, ref.logits)):
        assert rel(logits, ref_logits) < 1e-5, step


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_every_family_generates_eager_logits_with_a_static_cache(family):
    """One sequence with no mask and a static cache, each family: the attention gets every slot of
    the cache, the unfilled ones too, and must be told which hold tokens (transformers 5.24
    passes no mask there)."""
    eager, ours = (m.eval() for m in models(family))
    prompt, options = _prompt(padded=False)
    # Not compiled on a GPU (two compilations a family): the compiled steps are tested on Qwen3 above.
    options.update(max_new_tokens=3, do_sample=False, cache_implementation="static", return_dict_in_generate=True,
                   output_logits=True, disable_compile=True)
    out, ref = ours.generate(prompt, **options), eager.generate(prompt, **options)
    for step, (logits, ref_logits) in enumerate(zip(out.logits, ref.logits)):
        assert rel(logits, ref_logits) < 1e-5, step


def _prompt(padded: bool):
    """(prompt, generate's options): two sequences of 6 tokens, the first left-padded by 2, or one
    sequence and no mask."""
    if not padded:
        return torch.randint(0, 96, (1, 6), device=DEVICE), {}
    prompt = torch.randint(0, 96, (2, 6), device=DEVICE)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    return prompt, dict(attention_mask=mask)


def test_static_cache_mask_has_one_shape_for_the_whole_generation():
    """Our mask function, called with the sizes transformers passes: flash-attn's masks with a
    dynamic cache (None when nothing is padded); with a static cache (its layer's offset a tensor,
    or fewer tokens so far than key slots) one (B, 2, cache length) shape whatever the step, the
    full cache and no mask at all included, holding the mask and the filled slots, and returned as
    it is when asked again (transformers asks once before the compiled step and once inside it)."""
    from flashmoe_science.integrations.transformers import fms_attention_mask

    full = torch.ones(2, 12, dtype=torch.bool)
    assert fms_attention_mask(2, 1, 12, q_offset=11, attention_mask=full) is None
    padded = full.clone()
    padded[0, :3] = False
    assert torch.equal(fms_attention_mask(2, 1, 12, q_offset=11, attention_mask=padded), padded)
    slots = torch.arange(12)
    for filled in (6, 7, 11, 12):
        for mask in (padded[:, :filled], None):
            static = fms_attention_mask(2, 1, 12, q_offset=torch.tensor(filled - 1), attention_mask=mask)
            assert static.shape == (2, 2, 12) and static.dtype == torch.bool
            expected = (slots < filled).expand(2, -1)
            assert torch.equal(static[:, 0], expected if mask is None else expected & F.pad(mask, (0, 12 - filled)))
            assert torch.equal(static[:, 1], expected)
            assert fms_attention_mask(2, 1, 12, q_offset=torch.tensor(filled), attention_mask=static) is static
    prompt = fms_attention_mask(2, 6, 12, q_offset=0, attention_mask=None, device=torch.device("cpu"))  # prefill
    assert torch.equal(prompt, (slots < 6).expand(2, 2, -1))


@pytest.mark.parametrize("form", ["short", "static"])
@pytest.mark.parametrize("hole", [False, True])
def test_decoding_attention_takes_each_sequence_from_its_start_or_packs_a_mask_with_holes(hole, form):
    """A decode step's attention with a static cache's padding mask, as a 2-D mask shorter than the
    keys or in the fixed-shape form our mask function gives (static_cache_mask): left padding
    runs the KV-cache kernels on the keys in place; a mask with a hole (not a sequence start per
    row) packs the valid tokens instead. Both against SDPA with the mask."""
    from flashmoe_science.integrations.transformers import fms_attention_forward, static_cache_mask

    module = torch.nn.Module()
    module.is_causal = True
    query = torch.randn(2, 4, 1, 16, device=DEVICE)
    key, value = (torch.randn(2, 2, 10, 16, device=DEVICE) for _ in range(2))
    mask = torch.ones(2, 8, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False
    if hole:
        mask[1, 2:4] = False
    clear_records()
    out, _ = fms_attention_forward(module, query, key, value, mask if form == "short" else static_cache_mask(mask, 10))
    ran_decode = last_launch("attention_decode_split") is not None
    assert ran_decode != hole and (last_launch("attention_forward") is not None) == hole
    keys_mask = torch.cat([mask, torch.zeros(2, 2, dtype=torch.bool, device=DEVICE)], 1)  # slots 8, 9: unfilled
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=keys_mask[:, None, None, :])
    assert rel(out, ref.transpose(1, 2)) < 1e-5


@given(st.data())
def test_any_padding_layout_attends_as_its_mask_says(data):
    """Property: the attention as transformers calls it, on any padding layout of its masks: no
    mask, a 2-D padding mask or the static-cache form (unfilled slots past the tokens so far),
    left or right padding or holes; one query up to the whole prompt, GQA groups, sliding windows
    (not with holes: there the window counts packed tokens, as transformers' flash-attention path
    does, where its eager masks count cache slots; `_padded_attention`). Against a float64 reference on the valid queries: query i, at slot
    filled - Sq + i, sees the valid slots j <= it (and within the window)."""
    from flashmoe_science.integrations.transformers import fms_attention_forward, static_cache_mask

    draw = data.draw
    batch, heads_kv, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    filled = draw(st.integers(1, 12))
    seqlen_q = draw(st.sampled_from(sorted({1, min(2, filled), filled})))
    form = draw(st.sampled_from(["none", "2d", "static"]))
    kind = "full" if form == "none" else draw(st.sampled_from(["full", "left", "right", "hole"]))
    window = None if kind == "hole" else draw(st.sampled_from([None, 3]))
    cache_len = filled + (draw(st.integers(1, 5)) if form == "static" else 0)
    mask = torch.ones(batch, filled, dtype=torch.bool)
    for b in range(batch):
        if kind == "left":
            mask[b, :draw(st.integers(0, filled - 1))] = False
        elif kind == "right":
            mask[b, draw(st.integers(1, filled)):] = False
        elif kind == "hole" and filled > 2:
            mask[b, draw(st.integers(1, filled - 2))] = False
    torch.manual_seed(draw(st.integers(0, 2**16)))
    query = torch.randn(batch, heads_kv * group, seqlen_q, 16, device=DEVICE)
    key, value = (torch.randn(batch, heads_kv, cache_len, 16, device=DEVICE) for _ in range(2))
    key[:, :, filled:] = value[:, :, filled:] = 0  # unfilled slots
    mask = mask.to(DEVICE)
    attention_mask = {"none": None, "2d": mask, "static": static_cache_mask(mask, cache_len)}[form]
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fms_attention_forward(module, query, key, value, attention_mask, scaling=0.25, sliding_window=window)
    assert out.shape == (batch, seqlen_q, heads_kv * group, 16)
    slots = torch.arange(cache_len, device=DEVICE)
    for b in range(batch):
        for i in range(seqlen_q):
            at = filled - seqlen_q + i
            if not mask[b, at]:
                continue  # a padding query: no defined output
            seen = (slots <= at) & F.pad(mask[b], (0, cache_len - filled))
            if window is not None:
                seen &= slots > at - window
            k, v = (t[b].double().repeat_interleave(group, 0)[:, seen] for t in (key, value))
            ref = torch.softmax(query[b, :, i, None].double() @ k.transpose(1, 2) * 0.25, -1) @ v
            assert (out[b, i].double() - ref[:, 0]).abs().max() < 1e-4, (b, i)


def test_experts_that_the_kernels_cannot_express_fall_back_with_one_warning(monkeypatch):
    from flashmoe_science.integrations import transformers as integration

    eager, ours = models("qwen3_moe")
    monkeypatch.setattr(integration, "_WARNED", set())
    for layer in ours.model.layers:  # an identity norm: the same results by another path
        layer.mlp.experts.has_post_expert_norm = True
        layer.mlp.experts.post_expert_norm = torch.nn.Identity()
    ids = torch.randint(0, 96, (2, 12), device=DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clear_records()
        logits = ours(ids).logits
    assert last_launch("moe_gate_up") is None
    assert sum("grouped_mm" in str(w.message) and "has_post_expert_norm" in str(w.message) for w in caught) == 1
    assert rel(logits, eager(ids).logits) < 1e-5


def gpt_oss_models():
    """(eager, ours) gpt-oss models with the same weights; sliding-window and full layers, sinks
    drawn away from zero (a zero-initialised sink would leave them untested)."""
    def config():
        return transformers.GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=8, **_COMMON)

    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="eager",
                                                          experts_implementation="eager").float()
    for layer in eager.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    ours = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="fms",
                                                         experts_implementation="fms").float()
    ours.load_state_dict(eager.state_dict())
    return eager.to(DEVICE), ours.to(DEVICE)


def test_gpt_oss_runs_our_kernels_forward_and_backward():
    """gpt-oss on our kernels: the experts (weights stored transposed, gate and up interleaved,
    biases, the clamped SwiGLU) and the attention with its sinks: inference logits, training logits
    and every parameter's gradient (the biases' and the sinks' included) equal eager's."""
    eager, ours = gpt_oss_models()
    ids = torch.randint(0, 96, (2, 12), device=DEVICE)
    with torch.no_grad():
        clear_records()
        logits = ours(ids).logits
        assert last_launch("moe_gate_up").constexprs["ACTIVATION"] == "swiglu_oai"
        assert rel(logits, eager(ids).logits) < 1e-5
    clear_records()
    out, ref = ours(ids, labels=ids), eager(ids, labels=ids)
    assert last_launch("moe_gate_up") is not None and rel(out.logits, ref.logits) < 1e-5
    out.loss.backward()
    ref.loss.backward()
    assert last_launch("moe_grad_w1") is not None
    checked = set()
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), eager.named_parameters()):
        if p_ref.grad is not None and p_ref.grad.norm() > 0:
            assert rel(p.grad, p_ref.grad) < 1e-4, name
            checked.add(name.split(".")[-1])
    assert {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "sinks"} <= checked


def test_gpt_oss_gate_at_other_constants_falls_back_naming_them(monkeypatch):
    """gpt-oss's gate with another alpha and limit than our kernels' runs transformers' grouped_mm
    experts, with one warning naming them, and eager's results."""
    from flashmoe_science.integrations import transformers as integration

    monkeypatch.setattr(integration, "_WARNED", set())
    eager, ours = gpt_oss_models()
    for model in (eager, ours):
        for layer in model.model.layers:
            layer.mlp.experts.limit, layer.mlp.experts.alpha = 5.0, 1.5
    ids = torch.randint(0, 96, (2, 12), device=DEVICE)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clear_records()
        logits = ours(ids).logits
    assert last_launch("moe_gate_up") is None
    assert sum("alpha=1.5, limit=5.0" in str(w.message) for w in caught) == 1
    assert rel(logits, eager(ids).logits) < 1e-5


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [True, False])
def test_gpt_oss_generation_gives_eager_logits(cache, padded):
    """Sinks through every attention path: the prompt as packed sequences, the decode steps
    through the KV-cache kernels, on a left-padded batch or one sequence; sliding layers too."""
    eager, ours = gpt_oss_models()
    prompt, options = _prompt(padded)
    options.update(max_new_tokens=4, do_sample=False, cache_implementation=cache, return_dict_in_generate=True,
                   output_logits=True)
    out, ref = ours.generate(prompt, **options), eager.generate(prompt, **options)
    assert torch.equal(out.sequences, ref.sequences)
    for step, (logits, ref_logits) in enumerate(zip(out.logits, ref.logits)):
        assert rel(logits, ref_logits) < 1e-5, step


def test_what_the_attention_cannot_honour_is_refused():
    _, ours = models("qwen3_moe")
    ours.config.attention_dropout = 0.1
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.1
    ours.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(torch.randint(0, 96, (1, 8), device=DEVICE))


def test_importing_the_package_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, flashmoe_science; flashmoe_science.fused_moe; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"TRITON_INTERPRET": "1",
                         "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of the benchmark")
def test_bench_model_runs_tiny_configurations_through_the_interpreter():
    import argparse

    from flashmoe_science.bench import model

    parser = argparse.ArgumentParser()
    model.add_arguments(parser)
    args = parser.parse_args(["--models", "qwen3-30b-a3b", "--impls", "ours", "eager"])
    args.progress, args.checkpoint = (lambda items, desc="": items), (lambda rows: None)
    result = model.run(args)
    assert [r["impl"] for r in result["rows"]] == ["ours", "eager"]
    assert all("error" not in r and r["train_tokens_per_s"] > 0 for r in result["rows"])
    assert "qwen3-30b-a3b ours" in model.summarize(result)
    args.static_cache = True
    result = model.run(args)
    assert result["name"] == "model_static_decode"
    assert all("error" not in r and r["decode_b1_tokens_per_s"] > 0 and "train_tokens_per_s" not in r
               and isinstance(r["cudagraph_counters"], dict) for r in result["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of the benchmark")
def test_bench_model_measures_a_model_without_sdpa_against_eager_attention():
    """gpt-oss has no sdpa attention: its sdpa + grouped_mm row records the error, eager +
    grouped_mm is measured in its place, and the report takes ratios against it."""
    import argparse

    from flashmoe_science.bench import model, report

    parser = argparse.ArgumentParser()
    model.add_arguments(parser)
    args = parser.parse_args(["--models", "gpt-oss-20b", "--impls", "ours", "sdpa_grouped_mm"])
    args.progress, args.checkpoint = (lambda items, desc="": items), (lambda rows: None)
    result = model.run(args)
    assert [r["impl"] for r in result["rows"]] == ["ours", "sdpa_grouped_mm", "eager_grouped_mm"]
    assert "error" in result["rows"][1] and "error" not in result["rows"][2]
    assert model.baseline(result["rows"], "gpt-oss-20b") == ("eager + grouped_mm", result["rows"][2])
    table = report.render_model("model", {**result, "meta": {**result["meta"], "date": "", "command": ""}})
    assert "| gpt-oss-20b (2, 1 x 16) | fms + fms |" in table and "x) |" in table


def _fp8_experts_module(block_size):
    """transformers' FP8 experts module (FineGrainedFP8 checkpoints) of a tiny Qwen3-MoE config,
    dispatched to "fms", with weights quantised from random ones."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "FP8ExpertsInterface"):
        pytest.skip(f"transformers {transformers.__version__} has no FP8 experts interface")
    from transformers.integrations.moe import use_experts_implementation

    from flashmoe_science.moe.fp8 import quantize_fp8_blockwise

    register()
    config = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=128, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=256, vocab_size=32)
    config._experts_implementation = "fms"
    cls = use_experts_implementation(experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    module = cls(config=config, block_size=block_size).to(DEVICE)
    torch.manual_seed(0)
    for name, shape in (("gate_up_proj", (4, 256, 128)), ("down_proj", (4, 128, 128))):
        q, s = quantize_fp8_blockwise(torch.randn(shape, device=DEVICE) / 128**0.5)
        getattr(module, name).data = q
        getattr(module, f"{name}_scale_inv").data = s
    return module


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores need sm89 or newer")
def test_fp8_checkpoint_experts_run_our_fp8_kernels():
    from flashmoe_science.integrations.transformers import _fp8_fallback_reason
    from flashmoe_science.moe import fused_experts, moe_route

    module = _fp8_experts_module((128, 128))
    x = torch.randn(6, 128, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = moe_route(torch.randn(6, 4, device=DEVICE), 2)
    with torch.no_grad():
        assert _fp8_fallback_reason(module, x, 2) is None
        clear_records()
        out = module(x, ids, weights)
        assert last_launch("moe_fp8_down") is not None
        expected = fused_experts(x, module.gate_up_proj, module.down_proj, weights, ids,
                                 w1_scale=module.gate_up_proj_scale_inv, w2_scale=module.down_proj_scale_inv,
                                 block_shape=(128, 128))
    assert torch.equal(out, expected)
    module.block_size = None  # per-tensor scales: transformers' own FP8 path
    assert "block_size=None" in _fp8_fallback_reason(module, x, 2)
    module.block_size = (128, 128)
    assert "training" in _fp8_fallback_reason(module, x.requires_grad_(), 2)


def test_compiled_left_padded_decode_reads_no_mask_back():
    """Under torch.compile the left-padded decode path checks the mask on the device: a left-padded
    batch gives eager's outputs in one graph, and a sequence whose mask has a hole (which eager
    packs instead) comes out NaN, never silently wrong, while the others stay exact."""
    from flashmoe_science.integrations.transformers import _left_padded_short_queries

    torch.manual_seed(0)
    query = torch.randn(3, 4, 1, 32, device=DEVICE)
    key, value = (torch.randn(3, 2, 12, 32, device=DEVICE) for _ in range(2))
    mask = torch.ones(3, 12, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False  # left padding
    mask[2, :5] = False
    compiled = torch.compile(_left_padded_short_queries, fullgraph=True, backend="aot_eager")
    options = dict(softmax_scale=None, window_size=(-1, -1), softcap=0.0)
    with torch.no_grad():
        out = compiled(query, key, value, mask, True, options)
        expected = _left_padded_short_queries(query, key, value, mask, True, options)
        assert torch.equal(out, expected)
        holed = mask.clone()
        holed[1, 6] = False  # a hole: eager packs this batch instead
        assert _left_padded_short_queries(query, key, value, holed, True, options) is None
        out = compiled(query, key, value, holed, True, options)
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[0], expected[0]) and torch.equal(out[2], expected[2])
