"""The split exp2 of the Hopper forwards (`_kernels/exp2.py`): its PTX, run here instruction by
instruction in float32 with each instruction's rounding, against float64 exp2. (The GPU tests run
the kernels that use it: `test_gpu_forwards_with_exp_poly_match_reference`.)"""
import re

import numpy as np
import pytest

from flashmoe_science.attention._kernels.exp2 import EXP2_POLY_FLOOR, exp2_split_asm


def _f32(text):
    """A PTX operand: 0fXXXXXXXX literal or a register value."""
    return np.array(int(text[2:], 16), dtype=np.uint32).view(np.float32)


def _round_down(exact: np.ndarray) -> np.ndarray:
    """float64 values (exact sums of two float32) rounded toward -inf to float32."""
    r = exact.astype(np.float32)
    low = r.astype(np.float64) > exact
    r[low] = np.nextafter(r[low], np.float32(-np.inf))
    return r


def run_ptx(asm: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Executes the subset of PTX `exp2_split_asm` emits on float32 arrays ($4..$7 in, $0..$3 out)."""
    regs = {f"${i + 4}": x.astype(np.float32) for i, x in enumerate(inputs)}

    def val(op):
        return _f32(op) if op.startswith("0f") else regs[op]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        opcode, operands = line.split(None, 1)
        dst, *src = [o.strip() for o in operands.split(",")]
        a = [val(o) if not re.fullmatch(r"\d+", o) else int(o) for o in src]
        if opcode == "ex2.approx.ftz.f32":
            out = np.exp2(a[0].astype(np.float64)).astype(np.float32)
        elif opcode == "max.f32":
            out = np.maximum(a[0], a[1])
        elif opcode == "add.rm.f32":
            out = _round_down(a[0].astype(np.float64) + a[1].astype(np.float64))
        elif opcode == "sub.f32":
            out = (a[0].astype(np.float64) - a[1].astype(np.float64)).astype(np.float32)
        elif opcode == "fma.rn.f32":
            out = (a[0].astype(np.float64) * a[1] + a[2]).astype(np.float32)
        elif opcode == "mov.b32":
            out = a[0]
        elif opcode == "shl.b32":
            out = (a[0].view(np.uint32) << np.uint32(a[1])).view(np.float32)
        elif opcode == "add.s32":
            out = (a[0].view(np.int32) + a[1].view(np.int32)).view(np.float32)
        else:
            raise AssertionError(f"unexpected instruction {line!r}")
        regs[dst] = np.broadcast_to(out, inputs[0].shape).astype(np.float32)
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("poly", [1, 2, 3])
def test_split_exp2_ptx_matches_float64(poly):
    """On exponents from 0 down past the clamp (scores minus the row maximum: <= 0), each output
    is exp2 within 2e-4 relative (bf16's half-ulp is 3.9e-3); below -126 the polynomial lanes
    give 2**-126 instead of underflowing. The first 4 - poly lanes are the MUFU's."""
    asm = exp2_split_asm(poly)
    assert asm.count("ex2.approx.ftz.f32") == 4 - poly and asm.count("add.rm.f32") == poly
    rng = np.random.default_rng(0)
    x = np.concatenate([-np.linspace(0, 140, 400_001), -rng.exponential(2.0, 100_000), [-0.0, -1e-30, -1.0, -2.0]])
    outs = run_ptx(asm, [x, x, x, x])
    ref = np.exp2(np.maximum(x.astype(np.float32).astype(np.float64), EXP2_POLY_FLOOR))
    for lane, out in enumerate(outs):
        assert np.isfinite(out).all() and (out > 0).all()
        rel = np.abs(out.astype(np.float64) - ref) / ref
        kept = x >= EXP2_POLY_FLOOR if lane < 4 - poly else np.ones_like(x, dtype=bool)
        assert rel[kept].max() < 2e-4, (lane, x[kept][rel[kept].argmax()])
    exact_integers = run_ptx(asm, [np.array([0.0, -1.0, -7.0, -126.0])] * 4)[3]
    assert np.allclose(exact_integers, [1.0, 0.5, 2.0 ** -7, 2.0 ** -126], rtol=2e-4, atol=0)


def test_split_exp2_asm_rejects_a_split_it_cannot_make():
    for poly in (0, 5):
        with pytest.raises(ValueError, match="poly"):
            exp2_split_asm(poly)
