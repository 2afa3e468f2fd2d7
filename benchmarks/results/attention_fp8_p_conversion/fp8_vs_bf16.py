"""FP8 attention forward (Gluon) with P converted at the product against bf16, same run: time and error."""
import json, torch, triton
from flashmoe_science import flash_attention_science
from flashmoe_science.attention.fp8 import fp8_attention_inputs
torch.manual_seed(0)
for D in (64, 128, 256):
    for S, causal in ((4096, False), (16384, False), (16384, True)):
        B, H = max(1, 65536 // S // (D // 64)), 16
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        f8 = fp8_attention_inputs(q, k, v)
        fb = lambda: flash_attention_science(q, k, v, causal=causal)
        ff = lambda: flash_attention_science(**f8, causal=causal)
        ob, o8 = fb(), ff()
        err = float((o8.float() - ob.float()).norm() / ob.float().norm())
        tb = triton.testing.do_bench(fb, warmup=50, rep=300); t8 = triton.testing.do_bench(ff, warmup=50, rep=300)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        print(json.dumps(dict(D=D, S=S, B=B, causal=causal, bf16_ms=round(tb, 4), fp8_ms=round(t8, 4),
                              fp8_tflops=round(flops / t8 / 1e9), bf16_tflops=round(flops / tb / 1e9),
                              fp8_over_bf16_speed=round(tb / t8, 3), rel_err_vs_bf16=round(err, 4))), flush=True)
