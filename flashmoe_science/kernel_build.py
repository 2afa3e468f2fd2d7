"""`KernelBuild`: one kernel specialisation a dispatcher can launch, as each op's `builds.py`
lists them and `target_compile` compiles them. A leaf: it imports nothing of the package."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelBuild:
    """One kernel specialisation the dispatcher can launch."""

    label: str
    fn: object  # triton.JITFunction (or Gluon's)
    signature: dict  # argument name -> Triton type ("*fp16", "i32", "fp32", "constexpr")
    constexprs: dict
    num_warps: int
    num_stages: int
    aligned: tuple = field(default=())  # arguments known to be multiples of 16 (pointers: 16-byte aligned)
    maxnreg: int | None = None  # the launch's register bound, where the launcher sets one
