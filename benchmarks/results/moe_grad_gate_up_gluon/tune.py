"""grad_gate_up: the Triton kernel against the Gluon one at several stages / GROUP_M, each alone
(torch.profiler, GPU time of the kernel inside fused_moe fwd+bwd), plus the whole layer's fwd+bwd
time alternating the Triton and the best Gluon choice three times. One H200 call."""
import json, os
import torch, triton
from flashmoe_science.moe._kernels import backward_gluon as bg
if "PENDING" in os.environ:
    bg.PENDING.value = int(os.environ["PENDING"])
from ab import SHAPES, run, use, kernel_ms

CHOICES = [(False, 0, 8), (True, 5, 8), (True, 6, 8)]
TOKENS = [int(t) for t in os.environ.get("TOKENS", "4096 16384").split()]


def main():
    rows = []
    torch.manual_seed(0)
    for name, (E, k, H, I) in SHAPES.items():
        for T in TOKENS:
            x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
            w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
            w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
            logits = torch.randn(T, E, device="cuda").requires_grad_()
            dy = torch.randn(T, H, device="cuda").bfloat16()
            kern, diffs, base = {}, {}, None
            for gluon, stages, group_m in CHOICES:
                use(gluon, stages, group_m)
                grads = [g.detach().float().clone() for g in run(x, w1, w2, logits, k, dy)]
                if base is None:
                    base = grads
                else:
                    diffs[f"s{stages}"] = [float((a - b).abs().max()) for a, b in zip(grads, base)]
                ms = kernel_ms(lambda: run(x, w1, w2, logits, k, dy), "grad_gate_up")
                kern[f"{'gluon' if gluon else 'triton'} s{stages} g{group_m}"] = sum(ms.values())
            best = min((v, c) for c, v in kern.items() if c.startswith("gluon"))[1]
            s, g = int(best.split()[1][1:]), int(best.split()[2][1:])
            layer = {"triton": [], best: []}
            for _ in range(3):
                for gluon in (False, True):
                    use(gluon, s, g)
                    layer[best if gluon else "triton"].append(
                        triton.testing.do_bench(lambda: run(x, w1, w2, logits, k, dy), warmup=25, rep=150))
            row = dict(shape=name, T=T, pending=bg.PENDING.value, max_abs_diff_vs_triton=diffs, grad_gate_up_ms=kern, layer_fwd_bwd_ms={c: min(v) for c, v in layer.items()},
                       layer_speedup=round(min(layer["triton"]) / min(layer[best]), 4))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del x, w1, w2, logits, dy
            torch.cuda.empty_cache()
    json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/ggu_tune_p{bg.PENDING.value}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
