"""pytest configuration of the test suite.

On the CPU suite (the kernels in the Pallas interpreter), every kernel becomes
a large XLA program whose compilation dominates the run, while the arrays are
tiny: XLA's optimizations cost far more than they save there. They are off
unless the suite runs compiled on a GPU (JFLASH_TEST_ON_GPU=1). Measured on 2
cores, three kernel tests: 22.2 s with optimizations, 13.0 s without. Results
are unchanged up to rounding, which the tolerance table covers.
"""

import atexit
import gc
import os
import shutil
import tempfile

import jax
import pytest

# Tracing and lowering make millions of short-lived Python objects; at
# CPython's default thresholds (700, 10, 10) the cyclic garbage collector
# ran ~6,000 times per test worker and took 21.6 s of the two workers' CPU
# over the suite (gc.callbacks, 2026-11-26); at these, 80 times and 4.2 s,
# the largest worker peaking at 1.9 GB. Cycles are still collected.
gc.set_threshold(50_000, 20, 100)

# .ci/run's second venv borrows the first venv's packages (its own jax
# first): it says which jax it installed, and the run stops if another one
# imports.
_EXPECTED_JAX = os.environ.get("JFLASH_CI_EXPECTED_JAX")
if _EXPECTED_JAX and jax.__version__ != _EXPECTED_JAX:
  raise RuntimeError(f"jax {jax.__version__} imported from {jax.__file__}, "
                     f"but .ci/run installed jax {_EXPECTED_JAX}")

if os.environ.get("JFLASH_TEST_ON_GPU") != "1":
  jax.config.update("jax_disable_most_optimizations", True)
  # XLA:CPU of jaxlib 0.11 still has its former fusion emitters (LLVM IR
  # straight from HLO) beside the MLIR ones: they compile an interpreted
  # kernel's fusions ~2.5x faster (an interpreted fwd+bwd program: 0.6-0.9 s
  # against 1.7-2.4 s), with bitwise the same results on it, and the whole
  # suite in ~310 s instead of ~540 s on 2 cores (measured 2026-11-26,
  # benchmarks/results/RECORD.md). jaxlib 0.12 has only the MLIR emitters
  # and ignores the option (an unknown backend option, not an error). Set
  # before any backend starts; subprocesses inherit it (and do not add it
  # twice).
  _FORMER_EMITTERS = (
      "--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters")
  if _FORMER_EMITTERS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " " + _FORMER_EMITTERS)

# XLA compilation is ~80% of the CPU time of the kernel test files, and some
# programs recur (measured on six of them: ~40 s of ~500 s of compilation
# was the same HLO, source locations aside, compiled again). JAX's
# compilation cache, keyed by the program without its source locations,
# compiles each once. It starts empty for every run: a new directory,
# shared by the xdist workers and the 8-device subprocesses through the
# environment, removed by the process that made it.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="jflash-tests-xla-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"],
                  ignore_errors=True)
jax.config.update("jax_compilation_cache_dir",
                  os.environ["JAX_COMPILATION_CACHE_DIR"])
# Programs that compile faster than the cache reads them back stay out.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

# Many codebases forbid implicit rank promotion; jflash must work there, so
# the whole suite runs with it forbidden.
jax.config.update("jax_numpy_rank_promotion", "raise")

# tests/sharding_test.py and tests/ring_attention_test.py need 8 devices,
# which must exist before JAX starts its backends. On the CPU suite every
# test process has 8 CPU devices, so their cases run in the workers like any
# other (single-device tests run on the first: jit's default placement);
# where a process has fewer (the GPU suite: one GPU), their EightDevicesTest
# runs them in a subprocess with JFLASH_TEST_CPU_DEVICES=8
# (test_util.run_file_on_cpu_devices). Measured on 2 cores (2026-11-26):
# ~45 s less CPU than the two subprocesses, which also ran as one 40-120 s
# item each at the end of a worker's queue.
CPU_DEVICES = os.environ.get(
    "JFLASH_TEST_CPU_DEVICES",
    "8" if os.environ.get("JFLASH_TEST_ON_GPU") != "1" else "")
if CPU_DEVICES:
  jax.config.update("jax_num_cpu_devices", int(CPU_DEVICES))


@pytest.fixture(autouse=True)
def _fresh_kernel_passes():
  """Each test traces jflash's kernel passes anew: `binding._shared_pass`
  is a `jax.jit` that keeps a call's traced pass for the process (equal
  calls in one program then share one kernel), so a test that patches a
  module the pass reads while tracing (e.g. a spy on `decode_call`) would
  otherwise see the trace another test made earlier in the same worker,
  and pass or fail by test order."""
  from jflash._src import binding  # pylint: disable=g-import-not-at-top
  binding.clear_traced_passes()
  yield
