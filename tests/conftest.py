"""pytest configuration of the test suite.

On the CPU suite (the kernels in the Pallas interpreter), every kernel becomes
a large XLA program whose compilation dominates the run, while the arrays are
tiny: XLA's optimizations cost far more than they save there. They are off
unless the suite runs compiled on a GPU (JFLASH_TEST_ON_GPU=1). Measured on 2
cores, three kernel tests: 22.2 s with optimizations, 13.0 s without. Results
are unchanged up to rounding, which the tolerance table covers.
"""

import os

import jax

if os.environ.get("JFLASH_TEST_ON_GPU") != "1":
  jax.config.update("jax_disable_most_optimizations", True)

# Many codebases forbid implicit rank promotion; jflash must work there, so
# the whole suite runs with it forbidden.
jax.config.update("jax_numpy_rank_promotion", "raise")

# tests/sharding_test.py and tests/ring_attention_test.py run their cases in a
# subprocess with 8 CPU devices (test_util.run_file_on_cpu_devices), which
# must be set before JAX starts its backends.
if os.environ.get("JFLASH_TEST_CPU_DEVICES"):
  jax.config.update("jax_num_cpu_devices",
                    int(os.environ["JFLASH_TEST_CPU_DEVICES"]))
