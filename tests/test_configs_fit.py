"""Every configuration a dispatcher can pick compiles for sm80, sm86, sm89 and sm90 and fits
that target's shared memory. Compiling for a GPU target needs no GPU; it does need Triton's
compiler rather than its interpreter, so the check runs in a subprocess without
TRITON_INTERPRET."""
import itertools

import pytest

from flashmoe_science.attention.configs import forward_config, forward_configs
from flashmoe_science.device import SHARED_MEMORY_PER_BLOCK, SUPPORTED_TARGETS, DeviceInfo


@pytest.mark.targets
def test_every_shipped_build_compiles_and_fits(compiled_rows):
    assert {r["target"] for r in compiled_rows} == {f"sm{c}" for c in SUPPORTED_TARGETS}
    bad = [f"{r['target']} {r['label']}: " + (r["error"] or f"{r['shared']} > {r['limit']} bytes")
           for r in compiled_rows if not r["fits"]]
    assert not bad, "builds that do not compile or fit:\n" + "\n".join(bad)


# Register spills a build may have (bytes of spill stores, as ptxas reports them): a few registers
# saved around a loop. Exempt: the sm90 16-bit attention builds, whose tiles were picked by H100
# timings, spills included (`attention.configs`); and the fp32 attention builds at head dim 256,
# where 3xTF32 products (each operand held twice) need more registers than a thread has at any
# tile, down to 16 x 16 (`configs.BACKWARD`'s comment): they are held to FP32_D256_SPILL_LIMIT.
# The gate/up builds of gpt-oss's clamped SwiGLU ("swiglu_oai") are held to SWIGLU_OAI_SPILL_LIMIT:
# at the table's large tiles its epilogue (two clamps, the sigmoid and both local derivatives of a
# 64-128 x 128 tile, after the K loop) needs more registers than a thread has; the tiles are the
# SwiGLU table's, not chosen by timings of this activation.
SPILL_LIMIT = 64
FP32_D256_SPILL_LIMIT = 2048
SWIGLU_OAI_SPILL_LIMIT = 2048


def _spill_limit(row) -> float:
    if row["target"] == "sm90" and row["label"].startswith("attention_") and " fp32 " not in row["label"]:
        return float("inf")
    if row["label"].startswith("attention_") and " fp32 " in row["label"] and "D=256" in row["label"]:
        return FP32_D256_SPILL_LIMIT
    if row["label"].startswith("moe_gate_up") and " swiglu_oai" in row["label"]:
        return SWIGLU_OAI_SPILL_LIMIT
    return SPILL_LIMIT


@pytest.mark.targets
def test_builds_keep_register_spills_small(compiled_rows):
    assert all(r["spill_stores"] is not None for r in compiled_rows), "ptxas reported no spills for some builds"
    heavy = [f"{r['target']} {r['label']}: {r['spill_stores']} bytes" for r in compiled_rows
             if r["spill_stores"] > _spill_limit(r)]
    assert not heavy, "builds spilling registers:\n" + "\n".join(heavy)


@pytest.mark.targets
def test_hopper_attention_forward_uses_wgmma(compiled_rows):
    """Every 16-bit sm90 forward build (fp32's 3xTF32 tiles at D >= 128 are too small for wgmma)."""
    hopper = [r for r in compiled_rows if r["target"] == "sm90" and r["label"].startswith("attention_forward")
              and " fp32 " not in r["label"]]
    assert hopper and all(r["wgmma"] for r in hopper), [r["label"] for r in hopper if not r["wgmma"]]


@pytest.mark.targets
def test_hopper_fp8_attention_forward_keeps_p_in_packed_registers(compiled_rows):
    """The Gluon forward's FP8 builds convert P where the P V product reads it: an 8-bit P carried to
    the next iteration was held a byte a register, unpacked and repacked every iteration (256
    widenings in the PTX of each build, 0 in the 16-bit ones; benchmarks/results/attention_fp8_p_conversion/)."""
    fp8 = [r for r in compiled_rows if r["target"] == "sm90" and r["label"].startswith("attention_forward_gluon fp8")]
    assert fp8 and all(r.get("byte_unpacks") == 0 for r in fp8), [(r["label"], r.get("byte_unpacks")) for r in fp8]


@pytest.mark.targets
def test_decode_combine_launches_as_a_dependent_of_the_split_kernel_on_hopper_only(compiled_rows):
    """sm90's KV-cache split builds that hand over to the combine kernel signal it
    (griddepcontrol.launch_dependents) and its combine builds wait for them (griddepcontrol.wait);
    no other target's decode build holds the instruction, which needs sm90."""
    decode = [r for r in compiled_rows if r["label"].startswith(("attention_decode", "kv_cache_append"))]
    hopper = [r for r in decode if r["target"] == "sm90" and r["label"].startswith("attention_decode_combine")]
    hopper += [r for r in decode if r["target"] == "sm90" and r["label"].startswith("attention_decode_split")
               and "paged=False" in r["label"]]  # the builds with partials for the combine
    assert hopper and all(r["griddepcontrol"] for r in hopper), [r["label"] for r in hopper if not r["griddepcontrol"]]
    assert not any(r["griddepcontrol"] for r in decode if r["target"] != "sm90")
    assert not any(r["griddepcontrol"] for r in decode if r["label"].startswith("kv_cache_append"))


@pytest.mark.targets
def test_moe_decode_launches_chain_as_programmatic_dependents_on_hopper_only(compiled_rows):
    """sm90's MoE decode builds (configs' pdl entries: gate/up, down, their FP8 forms and the FP8
    tokens' quantisation, the combine) wait on griddepcontrol and the routing builds that release
    them signal it; no other MoE build holds the instruction, and only sm90 has such builds."""
    moe = [r for r in compiled_rows if r["label"].startswith("moe_")]
    chained = [r for r in moe if r["label"].endswith((" pdl", " release"))]
    assert {r["target"] for r in chained} == {"sm90"}
    assert {r["label"].split()[0] for r in chained} >= {"moe_gate_up", "moe_down", "moe_fp8_gate_up", "moe_fp8_down",
                                                        "moe_fp8_quantize", "moe_combine", "moe_route"}
    assert all(r["griddepcontrol"] for r in chained), [r["label"] for r in chained if not r["griddepcontrol"]]
    assert not any(r["griddepcontrol"] for r in moe if r not in chained)


@pytest.mark.targets
def test_hopper_attention_backward_tma_builds_use_wgmma_and_the_copy_engine(compiled_rows):
    """The backward builds that move tiles through descriptors (the Triton kernels' tma builds and
    the Gluon kernels) compile to bulk tensor copies and wgmma products on sm90; the pointer
    builds of the same tiles to no bulk copy."""
    backward = [r for r in compiled_rows if r["target"] == "sm90" and r["label"].startswith("attention_backward_d")]
    tma = [r for r in backward if " tma " in r["label"] or "_gluon " in r["label"]]
    assert any("_gluon " in r["label"] for r in tma)
    assert tma and all(r["wgmma"] and r["tma"] for r in tma), [r["label"] for r in tma]
    assert not any(r["tma"] for r in backward if r not in tma)


@pytest.mark.targets
def test_register_bounded_builds_compile_under_their_bound_with_room_for_the_programs_it_buys(compiled_rows):
    """Builds launched under a register bound (the sm90 D = 64 dK/dV kernel, `dkdv_maxnreg`)
    carry it into their PTX (.maxnreg), and their shared memory lets as many programs share an
    SM as the bound allows by registers (65536 a Hopper SM; 1 KB reserved per block), more than
    would share it unbounded (255 registers a thread)."""
    bounded = [r for r in compiled_rows if r["launch_maxnreg"]]
    assert any(r["target"] == "sm90" and r["label"].startswith("attention_backward_dkdv ") and "D=64" in r["label"]
               for r in bounded)
    for r in bounded:
        assert r["maxnreg"] == r["launch_maxnreg"], r["label"]
        programs = 65536 // (32 * r["num_warps"] * r["maxnreg"])
        assert programs > 65536 // (32 * r["num_warps"] * 255), r["label"]
        assert programs * (r["shared"] + 1024) <= 228 * 1024, r["label"]


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_dispatcher_only_picks_shipped_forward_configs(capability):
    shipped = {(es, bd, cfg) for es, bd, cfg in forward_configs(capability)}
    for sm_count in (1, 46, 132):
        device = DeviceInfo("probe", capability, sm_count, SHARED_MEMORY_PER_BLOCK[capability], 0)
        for element_size in (2, 4):
            for head_dim in (16, 24, 40, 64, 80, 96, 128, 160, 192, 256):
                for seqlen_q in (1, 64, 200, 4096):
                    for batch_heads, packed in itertools.product((1, 8, 512), (False, True)):
                        cfg = forward_config(device, element_size, head_dim, seqlen_q, batch_heads, packed)
                        block_d = max(16, 1 << (head_dim - 1).bit_length())
                        assert (element_size, block_d, cfg) in shipped


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_dispatcher_only_picks_shipped_decode_configs(capability):
    """Over KV-cache calls of every regime, `decode_schedule` picks a tile that `decode_configs`
    ships for the GPU (so the target compile proved it fits) and 1 to DECODE_MAX_SPLITS splits."""
    from flashmoe_science.attention.configs import DECODE_MAX_SPLITS, decode_configs, decode_schedule
    from flashmoe_science.float8 import FP8_MIN_CAPABILITY

    caches = [(2, None), (4, None)] + ([(2, 1)] if capability >= FP8_MIN_CAPABILITY else [])
    for (element_size, cache), sm_count in itertools.product(caches, (46, 108, 132)):
        shipped = set(decode_configs(cache, capability))
        device = DeviceInfo("probe", capability, sm_count, SHARED_MEMORY_PER_BLOCK[capability], 0)
        for block_d, rows, sequence_heads, capacity, paged in itertools.product(
                (16, 32, 64, 128, 256), (1, 8, 17, 33, 64), (1, 8, 64, 93, 133, 265, 512, 4096),
                (100, 4096, 65536, 262144), (0, 16, 256)):
            cfg, splits = decode_schedule(device, element_size, block_d, rows, cache, sequence_heads, capacity,
                                          paged)
            assert (element_size, block_d, cfg) in shipped, (element_size, cache, block_d, rows, sequence_heads)
            assert 1 <= splits <= DECODE_MAX_SPLITS


def test_paged_decode_follows_the_contiguous_schedule_on_hopper():
    """sm90, 16-bit, D 64/128, one tile of 16 rows: a paged call takes the contiguous call's stream
    and few-tile schedules, DECODE_PAGED_BUSY_TILE past two tiles an SM or where a stream tile's
    block spans more than DECODE_PAGED_MAX_BLOCK_PAGES pages, and page-aligned key
    blocks where its page size meets the block and its two-stage grid stays within
    DECODE_ALIGNED_PAGES_TWO_STAGE_WAVES programs an SM; other GPUs keep the per-key path and their
    paged schedule."""
    from flashmoe_science.attention.configs import (DECODE_ALIGNED_PAGES_TWO_STAGE_WAVES, DECODE_FEW_TILE,
                                                    DECODE_LATENCY_TILE, DECODE_PAGED_BUSY_TILE,
                                                    DECODE_PAGED_MAX_BLOCK_PAGES, AttentionConfig,
                                                    decode_aligned_pages, decode_schedule, decode_stream_tile)
    sm90, sm80 = (DeviceInfo("probe", cap, 132, SHARED_MEMORY_PER_BLOCK[cap], 0) for cap in (90, 80))
    for block_d, sequence_heads, capacity in itertools.product((64, 128), (1, 8, 64, 128, 256, 512, 1024),
                                                               (1024, 4096, 65536)):
        contiguous = decode_schedule(sm90, 2, block_d, 4, None, sequence_heads, capacity, 0)
        regimes = {decode_stream_tile(1, block_d), decode_stream_tile(2, block_d), DECODE_FEW_TILE}
        for page_size in (16, 64, 256):
            paged = decode_schedule(sm90, 2, block_d, 4, None, sequence_heads, capacity, page_size)
            many_pages = contiguous[0].block_n > DECODE_PAGED_MAX_BLOCK_PAGES * page_size
            if sequence_heads > 2 * 132 or (contiguous[0] in regimes and many_pages):
                assert paged[0] == DECODE_PAGED_BUSY_TILE, (block_d, sequence_heads, page_size)
            elif contiguous[0] in regimes:
                assert paged == contiguous, (block_d, sequence_heads, capacity, page_size)
            else:  # the latency tile stays contiguous caches' (17% slower paged)
                assert paged[0] != DECODE_LATENCY_TILE
    assert decode_schedule(sm90, 2, 64, 4, None, 8, 131072, 16)[0] == DECODE_PAGED_BUSY_TILE  # 256 keys: 16 pages
    assert decode_schedule(sm90, 2, 128, 4, None, 8, 8192, 16)[0] == DECODE_FEW_TILE
    two_stage = AttentionConfig(16, 64, 4, 2)
    limit = DECODE_ALIGNED_PAGES_TWO_STAGE_WAVES * 132
    assert decode_aligned_pages(sm90, DECODE_PAGED_BUSY_TILE, 16, 2, 10 * limit)
    assert decode_aligned_pages(sm90, DECODE_PAGED_BUSY_TILE, 256, 2, 10 * limit)
    assert decode_aligned_pages(sm90, two_stage, 16, 2, limit)
    assert not decode_aligned_pages(sm90, two_stage, 16, 2, limit + 1)
    assert not decode_aligned_pages(sm90, two_stage, 48, 2, 1)  # neither a multiple nor a divisor of 64 keys
    assert not decode_aligned_pages(sm90, two_stage, 0, 2, 1)  # a contiguous cache
    assert not decode_aligned_pages(sm90, DECODE_PAGED_BUSY_TILE, 256, 1, 1)  # FP8 caches: unmeasured
    assert not decode_aligned_pages(sm90, DECODE_PAGED_BUSY_TILE, 256, 4, 1)  # fp32
    assert not decode_aligned_pages(sm80, DECODE_PAGED_BUSY_TILE, 256, 2, 1)
    assert decode_schedule(sm80, 2, 128, 4, None, 512, 4096, 16)[0] != DECODE_PAGED_BUSY_TILE


def test_hopper_forward_dispatch_picks_gluon_where_it_was_measured_faster():
    """sm90, 16-bit, above HOPPER_MIN_FLOPS: the Gluon kernel per `GLUON_FORWARD` (head dim, masked or
    not, key count) unless softcapped; the Triton TMA kernel otherwise; the generic kernel off
    sm90, for fp32 and for small calls. Causal calls run persistent up to
    GLUON_PERSISTENT_MAX_CAUSAL_KEYS keys, others always."""
    from flashmoe_science.attention.configs import (GLUON_PERSISTENT_MAX_CAUSAL_KEYS, HOPPER_FORWARD,
                                                    HOPPER_MIN_FLOPS, AttentionConfig, gluon_persistent,
                                                    hopper_forward_config)
    sm90 = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)
    big = 2 * HOPPER_MIN_FLOPS
    two, three, wide = AttentionConfig(128, 128, 4, 2), AttentionConfig(192, 128, 4, 2), AttentionConfig(128, 64, 4, 2)
    expected = [  # (head dim, masked, keys, softcap) -> what runs
        ((128, True, 1024, False), (True, two)), ((128, True, 1023, False), (False, HOPPER_FORWARD[128])),
        ((128, False, 512, False), (True, two)), ((128, False, 4096, True), (False, HOPPER_FORWARD[128])),
        ((200, False, 512, False), (True, wide)), ((256, True, 512, False), (True, wide)),
        ((64, False, 2047, False), (True, two)), ((48, False, 2048, False), (True, three)),
        ((64, True, 8192, False), (True, three)), ((64, True, 8191, False), (True, two)),
        ((64, True, 2048, False), (True, two)), ((64, True, 2047, False), (False, HOPPER_FORWARD[64])),
        ((64, False, 4096, True), (False, HOPPER_FORWARD[64])),
    ]
    for (head_dim, masked, keys, softcap), runs in expected:
        assert hopper_forward_config(sm90, 2, head_dim, big, softcap, masked, keys) == runs, (head_dim, masked, keys)
    many = 1 << 14
    assert hopper_forward_config(sm90, 2, 128, HOPPER_MIN_FLOPS / 2, masked=False, seqlen_k=many) is None
    assert hopper_forward_config(sm90, 4, 128, big, masked=False, seqlen_k=many) is None
    assert gluon_persistent(False, many) and gluon_persistent(True, GLUON_PERSISTENT_MAX_CAUSAL_KEYS)
    assert not gluon_persistent(True, GLUON_PERSISTENT_MAX_CAUSAL_KEYS + 1)
    sm80 = DeviceInfo("probe", 80, 108, SHARED_MEMORY_PER_BLOCK[80], 0)
    assert hopper_forward_config(sm80, 2, 128, big, masked=False, seqlen_k=many) is None


def test_decode_split_counts_follow_the_measured_regimes():
    """`decode_splits` on an H100 (132 SMs), the cases its comment cites: one key block a split
    while the (batch, KV head) tiles leave SMs idle (B 1, Hkv 8), at least DECODE_MIN_SPLIT_BLOCKS
    once they fill them; DECODE_WAVES programs per SM, rounded down where the last split would
    add at most a quarter of the tiles' programs (256 tiles: one split, 192: two, 64: four); an
    empty cache or batch still one split. FP8 caches take one stage more than 16-bit ones."""
    from flashmoe_science.attention.configs import (DECODE_FP8_CACHE_EXTRA_STAGES, DECODE_MIN_SPLIT_BLOCKS,
                                                    decode_config, decode_splits)
    h100 = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)
    assert decode_splits(h100, 8, 1024, 128) == 8  # B 1, D 64: eight blocks, one a split
    assert decode_splits(h100, 8, 1024, 64) == 16
    assert decode_splits(h100, 8, 4096, 64) == 33  # 2 x 132 programs over 8 tiles
    assert decode_splits(h100, 64, 1024, 64) == 4  # 4.13 splits wanted
    assert decode_splits(h100, 128, 4096, 64) == 2  # 2.06
    assert decode_splits(h100, 192, 4096, 64) == 2 and 4096 // 64 // 2 >= DECODE_MIN_SPLIT_BLOCKS  # 1.38
    assert decode_splits(h100, 256, 4096, 64) == 1  # 1.03
    assert decode_splits(h100, 160, 1024, 64) == 1  # 16 blocks: not two splits of DECODE_MIN_SPLIT_BLOCKS
    assert decode_splits(h100, 1024, 131072, 64) == 1
    assert decode_splits(h100, 0, 0, 64) == 1 and decode_splits(h100, 8, 0, 64) == 1
    plain, fp8 = decode_config(h100, 2, 128, 4), decode_config(h100, 2, 128, 4, cache_element_size=1)
    assert fp8.num_stages == plain.num_stages + DECODE_FP8_CACHE_EXTRA_STAGES and fp8.block_n == plain.block_n


def test_decode_key_block_fits_a_tail_into_one_wave():
    """At head dim 64 (bf16, Hkv 8, GQA 4) on an H100 the doubled key block (128) stays, but for
    grids just over one wave of its programs (1 to DECODE_TAIL_WAVES waves), which take the table's
    64 keys: the cases `DECODE_TAIL_WAVES`' comment measured. FP8 caches and D 128 are untouched."""
    from flashmoe_science.attention.configs import decode_config
    h100 = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)

    def keys(batch, seqlen, block_d=64, cache=None):
        return decode_config(h100, 2, block_d, 4, cache, sequence_heads=batch * 8, capacity=seqlen).block_n

    assert [keys(b, 4096) for b in (1, 32, 40, 48)] == [128] * 4
    assert keys(8, 4096) == keys(16, 4096) == 256  # DECODE_STREAM_TILES' one-program tile
    assert [keys(b, 4096) for b in (56, 64)] == [64, 64] and keys(64, 1024) == keys(64, 32768) == 64
    assert [keys(b, 4096) for b in (96, 128)] == [128, 128]
    assert keys(64, 4096, block_d=128) == 64 and keys(64, 4096, cache=1) == 128
    assert decode_config(None, 2, 64, 4).block_n == 128  # no device: the table's tile


def test_decode_regimes_by_how_the_tiles_fill_the_sms():
    """At head dim 128 (bf16, one tile of query rows) on an H100, a contiguous cache of 4k keys
    takes, by its (sequence, KV head) tiles: up to DECODE_FEW_SEQUENCE_HEADS, DECODE_FEW_TILE at
    about a program an SM; fewer than DECODE_STREAM_FILL of the SMs, DECODE_LATENCY_TILE; up to one
    and two an SM, DECODE_STREAM_TILES in one split; beyond, the table's tile. D = 64 streams with
    twice the keys. Paged and FP8 caches, fp32, D = 256, tiles of more than 16 rows keep what they
    had, GPUs other than Hopper the latency tile and the table's; paged calls aim at
    DECODE_PAGED_WAVES programs an SM."""
    from flashmoe_science.attention.configs import (DECODE, DECODE_FEW_TILE, DECODE_LATENCY_TILE,
                                                    DECODE_PAGED_BUSY_TILE, DECODE_STREAM_TILES, AttentionConfig,
                                                    decode_config, decode_schedule)
    h100 = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)
    a100 = DeviceInfo("probe", 80, 108, SHARED_MEMORY_PER_BLOCK[80], 0)

    def schedule(sequence_heads, *, rows=8, block_d=128, element_size=2, cache=None, page_size=0, device=h100):
        return decode_schedule(device, element_size, block_d, rows, cache, sequence_heads, 4096, page_size)

    def tiles(*counts, **options):
        return [schedule(n, **options)[0] for n in counts]

    assert tiles(1, 4, 8) == [DECODE_FEW_TILE] * 3 and schedule(4)[1] == 33 and schedule(8)[1] == 17
    assert tiles(9, 32, 40, 92) == [DECODE_LATENCY_TILE] * 4
    assert [schedule(n) for n in (93, 128, 132)] == [(DECODE_STREAM_TILES[0], 1)] * 3
    assert [schedule(n) for n in (133, 192, 264)] == [(DECODE_STREAM_TILES[1], 1)] * 3
    table = AttentionConfig(16, DECODE[2].block_n, DECODE[2].num_warps, DECODE[2].num_stages)
    assert tiles(265, 512, 1024) == [table] * 3
    assert [t.block_n for t in tiles(128, 256, block_d=64)] == [2 * t.block_n for t in DECODE_STREAM_TILES]
    assert schedule(40, block_d=64)[0].block_n == 2 * table.block_n
    assert schedule(128, page_size=16) == schedule(128) and schedule(264, page_size=256) == schedule(264)
    assert schedule(265, page_size=16) == (DECODE_PAGED_BUSY_TILE, 2)
    assert schedule(128, page_size=16, device=a100) == (table, 3) and schedule(256, page_size=16, device=a100) == (table, 2)
    assert schedule(128, cache=1)[0].block_n == table.block_n and schedule(128, cache=1)[1] == 2
    assert schedule(8, rows=32)[0].block_m == 32 and schedule(128, rows=32)[0].block_n == table.block_n
    assert schedule(128, block_d=256)[0].block_n == table.block_n // 2
    assert schedule(8, element_size=4)[0].block_n == DECODE[4].block_n
    assert tiles(4, 100, 108, device=a100) == [DECODE_LATENCY_TILE, DECODE_LATENCY_TILE, table]
    assert decode_config(None, 2, 128, 8) == table  # no device: the table's tile
    forced = AttentionConfig(16, 32, 2, 4)
    assert decode_schedule(h100, 2, 128, 8, None, 128, 4096, False, forced) == (forced, 1)


def test_decode_long_caches_split_for_a_program_an_sm():
    """Few tiles over long caches (bound by bandwidth) take DECODE_STREAM_TILES' one-program tile,
    split for at most a program an SM while each split keeps DECODE_STREAM_MIN_SPLIT_KEYS; the few-
    tile regime keeps splits of at most DECODE_FEW_MAX_SPLIT_KEYS, the latency tile the rest."""
    from flashmoe_science.attention.configs import (DECODE_FEW_TILE, DECODE_LATENCY_TILE, DECODE_STREAM_TILES,
                                                    AttentionConfig, decode_schedule, decode_split_length)
    h100 = DeviceInfo("probe", 90, 132, SHARED_MEMORY_PER_BLOCK[90], 0)

    def schedule(batch, heads_kv, capacity, block_d=128):
        return decode_schedule(h100, 2, block_d, 32 // heads_kv, None, batch * heads_kv, capacity, False)

    one = DECODE_STREAM_TILES[0]
    assert schedule(1, 8, 65536) == (one, 16) and schedule(1, 8, 32768) == (one, 16)
    assert decode_split_length(32768, 16, one.block_n) == 2048
    assert schedule(1, 8, 16384)[0] == DECODE_LATENCY_TILE  # few-tile splits of 1k keys: too long
    assert schedule(1, 8, 8192)[0] == DECODE_FEW_TILE and schedule(1, 4, 16384)[0] == DECODE_FEW_TILE
    assert schedule(8, 8, 4096) == (one, 2)  # 64 tiles, two splits of 2k keys
    assert schedule(8, 4, 4096)[0] == DECODE_LATENCY_TILE  # 32 tiles: four splits of 1k keys
    wide = AttentionConfig(16, 2 * one.block_n, one.num_warps, one.num_stages)
    assert schedule(1, 8, 131072, block_d=64) == (wide, 16) and schedule(8, 8, 4096, block_d=64) == (wide, 2)
    assert schedule(1, 8, 16384, block_d=64)[0].num_stages == 2  # splits of 1k keys: the table's tile
