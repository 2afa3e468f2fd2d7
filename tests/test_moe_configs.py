"""MoE configurations: every build the launchers can pick compiles for sm80, sm86, sm89 and sm90
and fits that target's shared memory; the dispatcher picks only shipped configurations; and
what the launchers actually run is one of the shipped builds.

The compile check shares the session's `compiled_rows` (tests/conftest.py)."""
import pytest
import torch

from flashmoe_science.bench.moe import SHAPES
from flashmoe_science.device import SHARED_MEMORY_PER_BLOCK, SUPPORTED_TARGETS, DeviceInfo, info_for
from flashmoe_science.launch import last_launch
from flashmoe_science.moe import builds, configs, experts, fused_experts, fused_moe, moe_route


@pytest.mark.targets
def test_every_moe_build_compiles_and_fits(compiled_rows):
    for cap in SUPPORTED_TARGETS:
        moe_rows = [r for r in compiled_rows if r["target"] == f"sm{cap}" and r["label"].startswith("moe_")]
        assert len(moe_rows) == len(list(builds.shipped_builds(cap)))
    bad = [f"{r['target']} {r['label']}: " + (r["error"] or f"{r['shared']} > {r['limit']} bytes")
           for r in compiled_rows if r["label"].startswith("moe_") and not r["fits"]]
    assert not bad, "builds that do not compile or fit:\n" + "\n".join(bad)


@pytest.mark.targets
def test_hopper_prefill_gemms_use_wgmma(compiled_rows):
    """Decode tiles (BLOCK_M 16 and 32) are below wgmma's 64 rows and run mma.sync."""
    gemms = [r for r in compiled_rows if r["target"] == "sm90" and r["label"].startswith(("moe_gate_up", "moe_down"))
             and int(r["label"].split("BLOCK_M=")[1].split()[0]) >= 64]
    assert gemms and all(r["wgmma"] for r in gemms), [r["label"] for r in gemms if not r["wgmma"]]


def test_tables_are_well_formed():
    pow2 = {16, 32, 64, 128, 256}
    for family, by_size in configs.EXPERTS.items():
        for element_size, table in by_size.items():
            bounds = [b for b, _ in table]
            assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), (family, element_size)
            for _, cfg in table:
                assert cfg.block_m in pow2 and cfg.block_m <= configs.MAX_BLOCK_M
                for gemm in (cfg.gate_up, cfg.down):
                    assert gemm.block_n in pow2 and gemm.block_k in pow2 and gemm.num_warps in (4, 8)


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_dispatcher_only_picks_shipped_configs(capability):
    shipped = set(configs.experts_configs(capability))
    device = DeviceInfo("probe", capability, 132, SHARED_MEMORY_PER_BLOCK[capability], 0)
    for element_size in (2, 4):
        for T in (1, 7, 64, 300, 4096, 100_000):
            for k in (1, 2, 8):
                for E in (8, 64, 128, 256):
                    cfg = configs.experts_config(device, element_size, T, k, E, 2048, 768)
                    assert (element_size, cfg) in shipped


@pytest.mark.targets
def test_hopper_fp8_decode_gemms_run_fp8_wgmma(compiled_rows):
    """The swapped FP8 entries (BLOCK_M 16 and 32: FP8Config.swap_ab) put the weight tiles on
    wgmma's M side instead of running mma.sync on operands converted to fp16."""
    swapped = [r for r in compiled_rows if r["target"] == "sm90" and "swap_ab" in r["label"]]
    assert swapped and all(r["wgmma"] for r in swapped), [r["label"] for r in swapped if not r["wgmma"]]
    assert {int(r["label"].split("BLOCK_M=")[1].split()[0]) for r in swapped} == {16, 32}


def test_fp8_down_split_only_where_few_tiles_hold_long_k():
    """The down GEMM's K splits where its tiles are fewer than the SMs and each split keeps its
    minimum of K steps: Mixtral-8x7B at T = 1 (two experts of K = 14336), not at T = 4 (eight
    experts' tiles), not Qwen3-30B-A3B or DeepSeek-V2-Lite (K = 768, 1408), nor an entry without
    a split."""
    hopper = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)
    for name, T, split in (("mixtral-8x7b", 1, 2), ("mixtral-8x7b", 4, 1), ("qwen3-30b-a3b", 1, 1),
                           ("deepseek-v2-lite", 1, 1)):
        E, k, H, I = SHAPES[name]
        cfg = configs.fp8_config(hopper, T, k, E)
        assert cfg.down_split_k == 2
        assert configs.fp8_down_split(cfg, hopper, T, k, E, H, I) == split, (name, T)
    E, k, H, I = SHAPES["mixtral-8x7b"]
    assert configs.fp8_down_split(configs.fp8_config(hopper, 512, k, E), hopper, 512, k, E, H, I) == 1


def test_fp8_dispatch_takes_the_gluon_gemms_only_where_they_can_run(monkeypatch):
    """Hopper past 128 pairs an expert: the Gluon entry, unless the weights are not
    TMA-addressable or kernels run in the interpreter (then the Triton prefill entry); every pick
    is a shipped config."""
    hopper = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)
    monkeypatch.setattr(configs, "interpreter_active", lambda: False)
    for T, k, E, gluon in ((1, 8, 128, False), (2048, 8, 128, False), (2064, 8, 128, True), (16384, 2, 8, True)):
        assert configs.fp8_config(hopper, T, k, E).gluon == gluon, (T, k, E)
        assert not configs.fp8_config(hopper, T, k, E, gluon_ok=False).gluon
        for tma in (True, False):
            assert configs.fp8_config(hopper, T, k, E, tma) in set(configs.fp8_configs(90))
    monkeypatch.setattr(configs, "interpreter_active", lambda: True)
    assert configs.fp8_config(hopper, 16384, 2, 8) == configs.FP8_TRITON_FALLBACK[90]
    ada = DeviceInfo("probe", 89, 128, SHARED_MEMORY_PER_BLOCK[89], 0)
    assert not any(cfg.gluon for cfg in configs.fp8_configs(89))
    assert not configs.fp8_config(ada, 16384, 2, 8).gluon


# Arguments that are 1 at run time in one layout or another (Triton specialises them as constants).
UNIT_STRIDES = {"stride_wk", "stride_wn", "stride_wi", "stride_wh", "stride_om", "stride_on"}


def _launched_build(op, capability):
    record = last_launch(op)
    assert record is not None, op
    # DOT_PRECISION follows torch's float32 matmul precision at launch time; the compile check
    # builds the default's (3xTF32) for every build, so it is not part of a build's constexprs.
    launched = {name: value for name, value in record.constexprs.items() if name != "DOT_PRECISION"}
    # A build's constexprs also fix the strides that are 1 at run time (Triton specialises them),
    # which the launch record, holding the kernel's own constexpr parameters, leaves out.
    matches = [b for b in builds.shipped_builds(capability)
               if b.fn.__name__ == record.kernel
               and {name: b.constexprs[name] for name in launched if name in b.constexprs} == launched
               and not set(b.constexprs) - set(launched) - UNIT_STRIDES
               and record.num_warps in (None, b.num_warps) and record.num_stages in (None, b.num_stages)]
    assert matches, f"{op} ran {record.kernel} {record.constexprs}, which no shipped build covers"
    return matches[0]


@pytest.mark.parametrize("T", [1, 3, 200])
def test_launches_are_shipped_builds(device, T):
    """One token and a few (routing builds the layout) and more (route, count and align; from
    given ids: align alone for one dispatch chunk, else count and align)."""
    E, k, H, I = 8, 2, 32, 16
    x = torch.randn(T, H, device=device)
    w1 = torch.randn(E, 2 * I, H, device=device) / H**0.5
    w2 = torch.randn(E, H, I, device=device) / I**0.5
    logits = torch.randn(T, E, device=device)
    capability = info_for(x).capability
    one_launch = configs.route_layout(T, k) != "none"
    fused_moe(x, w1, w2, logits, k)
    route = _launched_build("moe_route", capability)
    assert route.constexprs["LAYOUT"] == ("one_token" if T == 1 else "full" if one_launch else "none")
    assert route.constexprs["E_PAD"] == 16  # the 8 experts padded to the smallest pad
    for op in ["moe_gate_up", "moe_down", "moe_combine"] + ([] if one_launch else ["moe_count", "moe_align"]):
        _launched_build(op, capability)
    weights, ids = moe_route(logits, k)
    assert _launched_build("moe_route", capability).constexprs["LAYOUT"] == "none"
    fused_experts(x, w1, w2, weights, ids)
    several_chunks = T > configs.CHUNK_TOKENS
    for op in ["moe_align", "moe_gate_up", "moe_down", "moe_combine"] + (["moe_count"] if several_chunks else []):
        _launched_build(op, capability)


def test_tune_picks_a_table_entry_and_later_calls_use_it(device, monkeypatch):
    """The autotuned fallback: with a timer that favours one entry (real timings would make the
    test flaky), tune() must cache that entry for the shape and bucket, and fused_moe must run it."""
    T, E, k, H, I = 5, 4, 2, 32, 16
    x = torch.randn(T, H, device=device)
    w1 = torch.randn(E, 2 * I, H, device=device) / H**0.5
    w2 = torch.randn(E, H, I, device=device) / I**0.5
    logits = torch.randn(T, E, device=device)
    default = configs.experts_config(info_for(x), 4, T, k, E, H, I)
    table = configs.EXPERTS[info_for(x).arch_family][4]
    favourite = next(cfg for _, cfg in table if cfg != default)
    timed = []

    def fake_timer(fn):
        out = fn()
        timed.append(out)
        return 1.0 if last_launch("moe_gate_up").constexprs["BLOCK_M"] == favourite.block_m else 2.0

    monkeypatch.setattr(experts, "_median_call_ms", fake_timer)
    monkeypatch.setattr(configs, "TUNED", {})
    fused_moe(x, w1, w2, logits, k)
    assert last_launch("moe_gate_up").constexprs["BLOCK_M"] == default.block_m
    assert experts.tune(x, w1, w2, logits, k) == favourite
    assert len(timed) == len(dict.fromkeys(cfg for _, cfg in table))
    out = fused_moe(x, w1, w2, logits, k)
    assert last_launch("moe_gate_up").constexprs["BLOCK_M"] == favourite.block_m
    torch.testing.assert_close(out, timed[0], rtol=1e-2, atol=1e-3)  # other tiles; tf32 on the GPU
    fused_moe(x[:, :16], w1[:, :, :16], w2[:, :16], logits, k)  # another shape keeps the table's choice
    assert last_launch("moe_gate_up").constexprs["BLOCK_M"] == default.block_m


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_gluon_grad_gate_up_only_on_hopper_prefill(capability):
    """The Gluon d [gate, up] kernel (sm90, 128-row blocks, 16-bit) at every prefill shape, Mixtral's
    widths (the gather_x entry) included. Its tiles are no narrower than the Triton entry's, so the
    d topk_weights table the backward allocates per column tile fits either kernel."""
    from flashmoe_science.moe._kernels import backward_gluon

    device = DeviceInfo("probe", capability, 132, SHARED_MEMORY_PER_BLOCK[capability], 0)
    for _, _, H, I in (SHAPES[name] for name in ("mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b", "olmoe-1b-7b")):
        for load in (256, configs.GATHER_X_MIN_LOAD):
            assert bool(configs.backward_config(device, 2, 128, H, I, load).gluon_stages) == (capability == 90)
        assert not configs.backward_config(device, 2, 64, H, I, 64).gluon_stages
        assert not configs.backward_config(device, 4, 64, H, I, 64).gluon_stages
    for element_size, block_m, cfg in configs.backward_configs(capability):
        if cfg.gluon_stages:
            assert (element_size, block_m) == (2, backward_gluon.TILE_M.value)
            assert cfg.grad_gate_up.block_n <= backward_gluon.BLOCK_N.value


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_gluon_down_only_in_hoppers_16_bit_prefill_entry(capability):
    """The Gluon down GEMM (sm90, 128-row blocks, descriptors, 16-bit) runs in the prefill bucket
    of Hopper's 16-bit table, and its builds are shipped there."""
    from flashmoe_science.moe._kernels import forward_gluon

    for element_size, cfg in configs.experts_configs(capability):
        if cfg.gluon_down_stages:
            assert (element_size, cfg.block_m, cfg.tma) == (2, forward_gluon.TILE_M.value, True)
    prefill = dict(configs.EXPERTS[configs.family_of(capability)][2])[None]
    assert bool(prefill.gluon_down_stages) == (capability == 90)
    labels = [b.label for b in builds.shipped_builds(capability) if b.label.startswith("moe_down_gluon")]
    assert sorted(label.split()[1] for label in labels) == (["bf16", "fp16"] if capability == 90 else [])


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_gluon_weight_gradients_on_hopper_from_64_row_blocks_but_mixtrals_largest_d_w1(capability):
    """The Gluon weight-gradient kernel (sm90, 16-bit, layout blocks of whole 64-row K steps) for both
    weight gradients, but for d w2 alone at Mixtral's widths from GATHER_X_MIN_LOAD pairs an
    expert, where d w1 is faster reading x copied into layout order (gather_x)."""
    from flashmoe_science.moe._kernels import backward_gluon

    device = DeviceInfo("probe", capability, 132, SHARED_MEMORY_PER_BLOCK[capability], 0)
    largest = configs.GATHER_X_MIN_LOAD
    for name, load, gluon in (("mixtral-8x7b", largest, ("grad_w2",)),
                              ("mixtral-8x7b", largest // 2, ("grad_w1", "grad_w2")),
                              ("deepseek-v2-lite", largest, ("grad_w1", "grad_w2")),
                              ("qwen3-30b-a3b", largest, ("grad_w1", "grad_w2"))):
        _, _, H, I = SHAPES[name]
        for kernel in ("grad_w1", "grad_w2"):
            wanted = kernel in gluon and capability == 90
            assert bool(configs.backward_config(device, 2, 128, H, I, load).gluon_weight_grad(kernel)) == wanted
            on_64_rows = configs.backward_config(device, 2, 64, H, I, 64).gluon_weight_grad(kernel)
            assert bool(on_64_rows) == (capability == 90)
            assert not configs.backward_config(device, 2, 32, H, I, 32).gluon_weight_grad(kernel)
            assert not configs.backward_config(device, 4, 64, H, I, 64).gluon_weight_grad(kernel)
    for element_size, block_m, cfg in configs.backward_configs(capability):
        if cfg.gluon_weight_grad_stages:
            assert element_size == 2 and block_m % backward_gluon.BLOCK_K.value == 0


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_backward_gathers_x_into_layout_order_only_for_experts_wider_than_the_model(capability):
    """gather_x (dW1 from a layout-order copy of x) needs descriptors, so it comes with tma; on
    Hopper the 16-bit prefill backward takes it where H < I (Mixtral's widths) from
    GATHER_X_MIN_LOAD pairs an expert, not below (the Gluon d w1 is faster there), nor where the
    (rows, H) copy costs more of the peak memory than it saves time (DeepSeek-V2-Lite,
    Qwen3-30B-A3B, OLMoE), nor at the decode tiles."""
    assert all(cfg.tma for _, _, cfg in configs.backward_configs(capability) if cfg.gather_x)
    device = DeviceInfo("probe", capability, 132, SHARED_MEMORY_PER_BLOCK[capability], 0)
    largest = configs.GATHER_X_MIN_LOAD
    for (_, _, H, I), gathers in ((SHAPES["mixtral-8x7b"], True), (SHAPES["deepseek-v2-lite"], False),
                                  (SHAPES["qwen3-30b-a3b"], False), (SHAPES["olmoe-1b-7b"], False)):
        assert configs.backward_config(device, 2, 128, H, I, largest).gather_x == (gathers and capability == 90)
        assert not configs.backward_config(device, 2, 128, H, I, largest - 1).gather_x
        assert not configs.backward_config(device, 2, 16, H, I, 8).gather_x
        assert not configs.backward_config(device, 4, 64, H, I, 64).gather_x
