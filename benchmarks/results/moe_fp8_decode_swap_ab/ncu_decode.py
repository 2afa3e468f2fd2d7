"""One decode layer, bf16 and FP8, for ncu: SHAPE T."""
import sys, torch
from flashmoe_science.moe import fused_moe
from flashmoe_science.bench.moe import SHAPES
from flashmoe_science.bench.sweeps.moe_fp8_decode import layer_weights
name, T = sys.argv[1], int(sys.argv[2])
E, k, H, I = SHAPES[name]
g, w1, w2, (q1, s1), (q2, s2) = layer_weights(SHAPES[name])
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
logits = torch.randn(T, E, device="cuda", generator=g)
for _ in range(3):
    fused_moe(x, w1, w2, logits, k)
    fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
torch.cuda.synchronize()
