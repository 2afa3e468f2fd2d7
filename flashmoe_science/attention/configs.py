"""Attention kernel configurations: the one table of block sizes, warps and stages.

A configuration is picked from the device family (`DeviceInfo.arch_family`), the element size,
the padded head dimension and how much parallel work the call has. Families differ by how much
shared memory one block may take: Hopper (sm90) 227 KB, A100-class (sm80) 163 KB, and the 99 KB
parts (sm86, sm89). The K and V tiles of every pipeline stage live in shared memory, so the
99 KB parts get narrower key blocks or fewer stages at large head dims.

`shipped_builds(capability)` enumerates every specialisation `forward_config` can return, so the
CPU test compiles each for sm80, sm86, sm89 and sm90 and checks it fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..device import DeviceInfo


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} warps={self.num_warps} stages={self.num_stages}"


def head_dim_block(head_dim: int) -> int:
    """The head dimension padded to the power of two a tile holds (masked beyond head_dim)."""
    return max(16, 1 << (head_dim - 1).bit_length())


C = AttentionConfig
# FORWARD[family][element bytes][padded head dim] -> (config for long queries, config when the
# call has too few query blocks to fill the GPU with BLOCK_M = 128).
FORWARD = {
    90: {
        2: {16: (C(128, 128, 8, 3), C(64, 64, 4, 3)),
            32: (C(128, 128, 8, 3), C(64, 64, 4, 3)),
            64: (C(128, 128, 8, 3), C(64, 64, 4, 3)),
            128: (C(128, 128, 8, 3), C(64, 64, 4, 3)),
            256: (C(128, 64, 8, 2), C(64, 64, 4, 2))},
        4: {16: (C(128, 64, 8, 3), C(64, 64, 4, 3)),
            32: (C(128, 64, 8, 3), C(64, 64, 4, 3)),
            64: (C(128, 64, 8, 3), C(64, 64, 4, 3)),
            128: (C(128, 64, 8, 2), C(64, 32, 4, 3)),
            256: (C(64, 32, 4, 2), C(64, 32, 4, 2))},
    },
    80: {
        2: {16: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            32: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            64: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            128: (C(128, 64, 8, 3), C(64, 64, 4, 3)),
            256: (C(64, 64, 4, 2), C(64, 32, 4, 2))},
        4: {16: (C(128, 32, 4, 3), C(64, 32, 4, 3)),
            32: (C(128, 32, 4, 3), C(64, 32, 4, 3)),
            64: (C(128, 32, 4, 3), C(64, 32, 4, 3)),
            128: (C(64, 32, 4, 3), C(64, 32, 4, 2)),
            256: (C(64, 32, 4, 2), C(32, 32, 4, 2))},
    },
    89: {
        2: {16: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            32: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            64: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            128: (C(128, 32, 4, 3), C(64, 32, 4, 3)),
            256: (C(64, 32, 4, 2), C(32, 32, 4, 2))},
        4: {16: (C(64, 32, 4, 3), C(64, 32, 4, 3)),
            32: (C(64, 32, 4, 3), C(64, 32, 4, 3)),
            64: (C(64, 32, 4, 3), C(64, 32, 4, 3)),
            128: (C(64, 32, 4, 2), C(32, 32, 4, 2)),
            256: (C(32, 16, 4, 2), C(32, 16, 4, 2))},
    },
}
del C


def forward_config(device: DeviceInfo, element_size: int, head_dim: int, seqlen_q: int,
                   batch_heads: int) -> AttentionConfig:
    """The forward configuration for a call on `device`."""
    family = FORWARD[device.arch_family][element_size][head_dim_block(head_dim)]
    long_cfg, short_cfg = family
    # With few query blocks, halving BLOCK_M doubles the programs in flight; below that, the
    # short config also wastes less work on padding rows (decode: Sq = 1).
    programs = -(-seqlen_q // long_cfg.block_m) * batch_heads
    if seqlen_q <= short_cfg.block_m or programs < device.sm_count:
        return short_cfg
    return long_cfg


def forward_configs(capability: int):
    """Every (element size, padded head dim, config) the forward dispatcher can pick."""
    from ..device import SHARED_MEMORY_PER_BLOCK

    probe = DeviceInfo("", capability, 1, SHARED_MEMORY_PER_BLOCK[capability], 0)
    for element_size, by_dim in FORWARD[probe.arch_family].items():
        for block_d, pair in by_dim.items():
            for cfg in dict.fromkeys(pair):
                yield element_size, block_d, cfg


def shipped_builds(capability: int):
    from ..target_compile import KernelBuild
    from ._kernels.forward import attention_forward_kernel

    ptr = {2: "*fp16", 4: "*fp32"}
    for element_size, block_d, cfg in forward_configs(capability):
        for causal in (False, True):
            sig = {name: "i32" for name in attention_forward_kernel.arg_names}
            sig.update(Q=ptr[element_size], K=ptr[element_size], V=ptr[element_size], O=ptr[element_size],
                       LSE="*fp32", scale_log2="fp32")
            constexprs = dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              CAUSAL=causal, WRITE_LSE=True)
            sig.update({name: "constexpr" for name in constexprs})
            yield KernelBuild(
                label=f"attention_forward fp{8 * element_size} D={block_d} causal={causal} {cfg}",
                fn=attention_forward_kernel, signature=sig, constexprs=constexprs,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                aligned=("Q", "K", "V", "O", "LSE", "stride_qb", "stride_qh", "stride_qm", "stride_kb",
                         "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob",
                         "stride_oh", "stride_om"))
