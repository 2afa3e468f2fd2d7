"""d [gate, up] kernel time inside fused_moe fwd+bwd (torch.profiler), one subprocess a variant:
VARIANTS of "triton" (the Triton kernel), "shipped" (the package's Gluon kernel), "gluon_gather_x"
(the Gluon kernel in the BACKWARD_GATHER_X entry too), and with DIAGS the 128 x 128 ping-pong
Gluon kernel of `bg_diag.py` with parts switched off (bit 1: no epilogue; bit 2: no dY copies:
wrong results, timing only). Every variant's gradients are compared with the Triton path's.
SHAPES, TOKENS: which cases. OUT: where ggu_diag.json goes."""
import json, os, subprocess, sys
from dataclasses import replace
import torch

ALL = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
       "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
SHAPES = {n: ALL[n] for n in os.environ.get("SHAPES", "qwen3-30b-a3b deepseek-v2-lite").split()}
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "4096 16384").split())


def kernel_ms(fn, name):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / 10 / 1000, 4) for e in prof.key_averages() if name in e.key}


def one(variant):
    from flashmoe_science import fused_moe
    from flashmoe_science.launch import KernelLauncher
    from flashmoe_science.moe import backward, configs
    if variant == "gluon_gather_x":  # the Gluon d [gate, up] in the BACKWARD_GATHER_X entry too (Mixtral)
        table = configs.BACKWARD_GATHER_X[90][2]
        table[128] = replace(table[128], gluon_stages=3)
    elif variant == "triton":
        for table in (configs.BACKWARD[90][2], configs.BACKWARD_GATHER_X[90][2]):
            table[128] = replace(table[128], gluon_stages=0)
    elif variant not in ("shipped", "gluon_gather_x"):
        sys.path.insert(0, os.path.dirname(__file__))
        mod = __import__(variant)
        launcher = KernelLauncher("moe_grad_gate_up_gluon_x", mod.grad_gate_up_gluon_kernel)
        from flashmoe_science.device import info_for
        from flashmoe_science.tma import gluon_descriptor

        def launch(key, plan, grad_out, w2, h, h_grads, topk_weights, sorted_pairs, block_expert, block_rows,
                   grad_gate_up, weighted_h, row_tokens, grad_weight_parts, need_weight_grads):
            # the ping-pong kernel's tiles: w2 boxes (64, 128), epilogue boxes (128, 32), 5 stages
            H, I, E = plan.hidden, plan.inter, plan.num_experts
            box = lambda t: gluon_descriptor(t, mod.TILE_M.value, mod.EPILOGUE_N.value)
            tiles = plan.num_blocks * -(-I // mod.BLOCK_N.value)
            launcher.launch(key, (min(tiles, info_for(grad_out).sm_count), 1, 1),
                (grad_out, gluon_descriptor(w2.view(E * H, I), mod.BLOCK_K.value, mod.BLOCK_N.value), box(h),
                 box(h_grads), topk_weights, box(grad_gate_up), grad_gate_up, box(weighted_h), row_tokens,
                 grad_weight_parts, sorted_pairs, block_expert, block_rows, plan.num_blocks,
                 plan.num_tokens * plan.top_k, H, I, plan.top_k, int(need_weight_grads), grad_out.stride(0),
                 plan.config.grad_gate_up.group_m, 5),
                num_warps=4, num_stages=1, device_index=plan.device_index)
        backward._launch_grad_gate_up_gluon = launch
    backward._PLANS.clear()
    torch.manual_seed(0)
    rows = []
    for name, (E, k, H, I) in SHAPES.items():
        for T in TOKENS:
            x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
            w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
            w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
            logits = torch.randn(T, E, device="cuda").requires_grad_()
            dy = torch.randn(T, H, device="cuda").bfloat16()

            def run():
                for t in (x, w1, w2, logits):
                    t.grad = None
                out = fused_moe(x, w1, w2, logits, k)
                out.backward(dy)
                return out, x.grad, w1.grad, w2.grad, logits.grad
            grads = [g.detach().float().clone() for g in run()]
            kern = kernel_ms(run, "grad_gate_up")
            ms = sum(kern.values())
            tflops = 2 * T * k * H * I / ms / 1e9
            torch.save(grads, f"/tmp/grads_{name}_{T}_{variant}_{os.environ.get('DIAG', '0')}.pt")
            rows.append(dict(variant=variant, diag=int(os.environ.get("DIAG", "0")),
                             shape=name, T=T, kernel_ms=round(ms, 4), tflops=round(tflops, 1), kernels=kern))
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
        sys.exit(0)
    runs = [(v, {}) for v in os.environ.get("VARIANTS", "triton shipped").split()] + [(v, {"DIAG": str(d)}) for v, d in
                                               [("bg_diag", int(x)) for x in os.environ.get("DIAGS", "").split()]]
    rows = []
    for variant, env in runs:
        p = subprocess.run([sys.executable, __file__, variant], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=240)
        print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
        rows += [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    base = {}
    for r in rows:
        f = f"/tmp/grads_{r['shape']}_{r['T']}_{r['variant']}_{r['diag']}.pt"
        g = torch.load(f)
        if r["variant"] == "triton":
            base[(r["shape"], r["T"])] = g
        ref = base.get((r["shape"], r["T"]))
        if ref is not None:
            r["max_rel_diff_vs_triton"] = {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                           for n, a, b in zip(("out", "dx", "dw1", "dw2", "dlogits"), g, ref)}
            r["finite"] = all(bool(torch.isfinite(a).all()) for a in g)
        print(r["variant"], r["diag"], r["shape"], r["T"], r["kernel_ms"], r["tflops"],
              r.get("max_rel_diff_vs_triton"), flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "ggu_diag.json"), "w"), indent=1)
