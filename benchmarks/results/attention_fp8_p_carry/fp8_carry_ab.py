"""FP8 attention forward (Gluon), P carried across iterations as fp32 (the tree) or fp16 (patch),
two or three consumer warpgroups (argv: label [c3]): FP8 TFLOP/s and error against our bf16."""
import json, sys, torch, triton
import flashmoe_science
from flashmoe_science import flash_attention_science
from flashmoe_science.attention import configs
from flashmoe_science.attention.fp8 import fp8_attention_inputs
label = sys.argv[1]
if "c3" in sys.argv[2:]:
    for d, c in list(configs.GLUON_FP8_FORWARD.items()):
        if d in (64, 128):
            configs.GLUON_FP8_FORWARD[d] = configs.AttentionConfig(192, c.block_n, c.num_warps, c.num_stages)
    label += "+c3"
print("#", label, flashmoe_science.__file__, {d: str(c) for d, c in configs.GLUON_FP8_FORWARD.items()}, flush=True)
torch.manual_seed(0)
for D, S, causal in ((64, 16384, False), (64, 4096, True), (128, 16384, False), (128, 4096, True), (256, 16384, False)):
    B, H = max(1, 65536 // S // (D // 64)), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f8 = fp8_attention_inputs(q, k, v)
    fb = lambda: flash_attention_science(q, k, v, causal=causal)
    ff = lambda: flash_attention_science(**f8, causal=causal)
    try:
        ob, o8 = fb(), ff()
    except Exception as e:  # a variant that does not compile or fit
        print(json.dumps(dict(variant=label, D=D, S=S, causal=causal, error=repr(e)[:300])), flush=True)
        continue
    err = float((o8.float() - ob.float()).norm() / ob.float().norm())
    tb = triton.testing.do_bench(fb, warmup=50, rep=300); t8 = triton.testing.do_bench(ff, warmup=50, rep=300)
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    print(json.dumps(dict(variant=label, D=D, S=S, B=B, causal=causal, bf16_ms=round(tb, 4), fp8_ms=round(t8, 4),
                          fp8_tflops=round(flops / t8 / 1e9), bf16_tflops=round(flops / tb / 1e9),
                          fp8_over_bf16_speed=round(tb / t8, 3), rel_err_vs_bf16=round(err, 5))), flush=True)
