"""Host cost of a custom-op call against the same Python function called directly."""
import time
import torch
from flashmoe_science.moe import backward, experts, moe_route, ops, routing

torch.manual_seed(0)
T, E, k, H, I = 256, 128, 8, 2048, 768
x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16()
w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16()
logits = torch.randn(T, E, device="cuda")
dy = torch.randn(T, H, device="cuda").bfloat16()
weights, ids = moe_route(logits, k)
h, hg, sp, be, br = experts.gate_up_for_backward(x, w1, w2, weights, ids, "silu")
ggu = torch.randn(hg.shape, device="cuda").bfloat16()


def host_us(f, n=200):
    for _ in range(10):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) / n * 1e6, 1), round((time.perf_counter() - t0) / n * 1e6, 1)


cases = {
    "route": (lambda: ops.route_op(logits, k, True, "softmax"), lambda: routing.route(logits, k, True, "softmax")),
    "gate_up": (lambda: ops.experts_gate_up_op(x, w1, w2, weights, ids, "silu"),
                lambda: experts.gate_up_for_backward(x, w1, w2, weights, ids, "silu")),
    "down": (lambda: ops.experts_down_op(x, w1, w2, weights, ids, h, hg, sp, be, br),
             lambda: experts.down_for_backward(x, w1, w2, weights, ids, h, sp, be, br)),
    "down_backward": (lambda: ops.experts_down_backward_op(dy, x, w1, w2, weights, ids, h, hg, sp, be, br, True, True),
                      lambda: backward.down_backward(dy, x, w1, w2, weights, ids, h, hg, sp, be, br, True, True)),
    "gate_up_backward": (lambda: ops.experts_gate_up_backward_op(ggu, x, w1, w2, ids, sp, be, br, True, True),
                         lambda: backward.gate_up_backward(ggu, x, w1, w2, ids, sp, be, br, True, True)),
}
for name, (op, direct) in cases.items():
    print(name, "op (host, loop) us:", host_us(op), " direct:", host_us(direct), flush=True)
