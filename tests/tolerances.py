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
