"""sm90 SASS of the decode split kernel's main loop (compiled on the CPU, read with Triton's
nvdisasm), contiguous and paged, the per-key path and the page-aligned one (ALIGNED_PAGES), like
for like (fp16, D 128, 4 warps, 3 stages, no softcap, split output): instructions in the loop,
shared memory, the commonest opcodes. python benchmarks/results/decode_regimes/paged_sass.py"""
import collections, dataclasses, os, re, subprocess, tempfile
import triton
from flashmoe_science import target_compile as tc

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
base = next(x for x in tc.shipped_builds(90)
            if x.label.startswith("attention_decode_split fp16 D=128 paged=False BLOCK_M=16 BLOCK_N=64 warps=4 stages=3"))


def loop_mix(sass):
    addr, labels = [], {}
    lines = sass.splitlines()
    for i, l in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", l)
        if m:
            for j in range(i + 1, len(lines)):
                mm = re.match(r"\s+/\*([0-9a-f]+)\*/", lines[j])
                if mm:
                    labels[m.group(1)] = int(mm.group(1), 16)
                    break
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*)", l)
        if m:
            addr.append((int(m.group(1), 16), m.group(2)))
    best = None
    for a, ins in addr:
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", ins)
        if m and labels.get(m.group(1), 1 << 40) < a:
            body = [x for x in addr if labels[m.group(1)] <= x[0] <= a]
            if best is None or len(body) > len(best):
                best = body
    return collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", x[1]).group(1) for x in best)


def report(page, block_n=64, stages=3, **extra):
    extra = {"ALIGNED_PAGES": False, **extra}
    b = dataclasses.replace(base, signature={**base.signature, **{k: "constexpr" for k in extra}}, constexprs={**base.constexprs, "PAGE_SIZE": page, "BLOCK_N": block_n, **extra},
                            num_stages=stages)
    k = tc.compile_build(b, 90)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True).stdout
    c = loop_mix(sass)
    print(f"{'aligned' if extra['ALIGNED_PAGES'] else 'per-key'} page={page:3d} N={block_n} s={stages}: loop {sum(c.values())} instr, "
          f"shared {k.metadata.shared} | " + ", ".join(f"{o}:{n}" for o, n in c.most_common(10)), flush=True)


for page, n in ((0, 64), (16, 64), (256, 64), (0, 128), (16, 128), (256, 128)):
    report(page, n)
    if page:
        report(page, n, ALIGNED_PAGES=True)
