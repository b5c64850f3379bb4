"""Measured tiles for kernels/fp8_gemv.py: {card name: {"N,K,blocked,one_row": config}}.

Written by `python -m pdserve.bench.fp8_gemv_tune` on the card itself (each shape's fastest of a
sweep, triton.testing.do_bench medians); a card or shape missing here takes fp8_gemv.default_config.
Measured tiles are a table, not a run-time autotuner, so a worker picks the same tiles (and
computes the same bits) on every start.
"""

CONFIGS: dict[str, dict[str, dict]] = {}
