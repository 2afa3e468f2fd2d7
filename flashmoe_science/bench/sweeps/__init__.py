"""Tuning sweeps: time candidate kernel configurations on a GPU, to choose the entries of the
dispatch tables (`attention/configs.py`, `moe/configs.py`). For maintainers; users never need
them. Each module holds its candidates and its runner; the results files they write
(benchmarks/results/*_sweep*.json) are what the tables' comments cite.

- `attention_forward`: the generic forward's tiles (`bench attention --sweep`), the Hopper TMA
  and Gluon kernels' (`bench attention --sweep-hopper [--sweep-gluon]`).
- `attention_backward`: the backward's dK/dV and dQ tiles, Triton or Gluon
  (`python -m flashmoe_science.bench.sweeps.attention_backward`).
- `moe`: the grouped GEMMs' tiles per load bucket, forward and backward (`bench moe --sweep`).
- `moe_fp8_decode`: the FP8 experts' decode tiling
  (`python -m flashmoe_science.bench.sweeps.moe_fp8_decode`).
"""
