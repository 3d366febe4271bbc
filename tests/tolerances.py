"""The one tolerance table of the test suite.

A kernel result passes when

    max|kernel - reference| <= FACTOR * max|jax.nn_low - reference|
                               + FLOOR[dtype] * max(1, max|reference|)

where `reference` is jax.nn.dot_product_attention on float32-upcast inputs at
HIGHEST precision and `jax.nn_low` is jax.nn run in the input dtype: the kernel
may be at most FACTOR times less exact than jax.nn itself, plus a small
relative floor (jax.nn can be luckily exact on a given input).
"""

FACTOR = 3.0

FLOOR = {
    "float32": 2e-5,
    "bfloat16": 4e-3,
    "float16": 5e-4,
}

# FP8 (tests/fp8_test.py).
# - FP8_DEQUANTIZED: max|FP8 call - float64 attention of its real values|
#   / max(1, max|reference|). The dequantizing path rounds the real values
#   to bfloat16 (2^-9 relative), then runs the bfloat16 kernels (P in
#   bfloat16, the output rounded: ~2^-8 relative each). Measured <= 4.7e-3
#   on tests/fp8_test.py's cases.
# - FP8_ROUNDING: relative error of rounding a normal value to the dtype
#   (half a unit in the last place: 3 mantissa bits for e4m3, 2 for e5m2);
#   values below the smallest normal are off by at most half the smallest
#   subnormal step (FP8_SUBNORMAL_STEP / 2), times their descale.
# - FP8_ATTENTION: max|attention of quantized q/k/v - unquantized| /
#   max|unquantized| on normal data (measured ~0.03 at these shapes;
#   FP8.md: ~2.4% relative from P's rounding alone, more with outliers).
FP8_DEQUANTIZED = 1e-2
# - FP8_KERNEL: as FP8_DEQUANTIZED, for a native FP8 kernel (Mosaic's,
#   Hopper), which also rounds P to e4m3 (1/16 relative per probability):
#   its relative RMS error on normal inputs is ~0.025 (RECORD 2026-11-25,
#   "FP8 forward"); the max error of a row with few keys is larger.
FP8_KERNEL = 8e-2
FP8_ROUNDING = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}
FP8_SUBNORMAL_STEP = {"float8_e4m3fn": 2.0**-9, "float8_e5m2": 2.0**-16}
FP8_ATTENTION = 0.1

# Two computations of the same function in the inputs' dtype that the table
# above cannot judge (no jax.nn run in the input dtype to scale by): e.g. a
# backend against jflash's XLA path, or a composition of calls (merged key
# shards) against one call. Both round their outputs to the input dtype, so
# they may differ by a few of its ulps (bf16: 2^-8 relative per rounding).
DIRECT = {
    "float32": 2e-5,
    "bfloat16": 2e-2,
    "float16": 2e-3,
}


def direct(dtype, float32: float = DIRECT["float32"]) -> float:
  """rtol = atol for comparing two results of inputs of `dtype`; a test
  that holds float32 inputs to a tighter bound passes it as `float32`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  name = np.dtype(dtype).name
  return float32 if name == "float32" else DIRECT[name]
