"""Compile time per new shape: tracing + lowering, then XLA/ptxas compile.

Usage (repo root, GPU machine):
  PYTHONPATH=. python3 benchmarks/compile_time.py [--impls mosaic,cudnn]
      [--head-dims 128] [--ptxas] [--cache-dir DIR]

For each head dim and causal setting, a fresh shape per implementation (so
no cache is hit), forward and forward+backward (`jax.grad` of a loss):
seconds spent in `trace().lower()` (Python: the kernels' Mosaic/Triton
modules are built there) and in `.compile()` (XLA; for Mosaic, 95% of it
is Mosaic GPU compiling each kernel in turn, ptxas included: RECORD,
2026-11-26, "where a Mosaic fwd+bwd compile goes").

--ptxas: also ptxas's own time per Mosaic kernel (`ptxas -v`, which
MOSAIC_GPU_DUMP_PTXAS turns on; Mosaic then runs its pass pipeline once
more for the dump, so the compile column grows by that much).
--cache-dir DIR: JAX's persistent compilation cache in DIR; run the script
twice with the same DIR (and the same arguments) to time a restarted
process, whose compile is a cache read and whose lowering still runs.
"""

import argparse
import os
import re
import time

import jax
import jax.numpy as jnp

from benchmarks import deviceless
from benchmarks import run as bench

IMPLS = ("mosaic", "triton", "cudnn")


def _ptxas_seconds(text: str) -> list[float]:
  """ptxas's `Compile time = X ms` reports in `text`, in seconds."""
  return [float(ms) / 1e3
          for ms in re.findall(r"Compile time = ([\d.]+) ms", text)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--impls", default=",".join(IMPLS),
                      help="comma-separated implementations")
  parser.add_argument("--head-dims", nargs="+", type=int,
                      default=[64, 128, 256])
  parser.add_argument("--ptxas", action="store_true",
                      help="ptxas's own time per Mosaic kernel")
  parser.add_argument("--cache-dir", default=None,
                      help="JAX's persistent compilation cache directory")
  args = parser.parse_args(argv)
  if args.ptxas:
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # Read at each compile.
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  print(jax.devices()[0].device_kind, "jax", jax.__version__,
        f"cache: {args.cache_dir}" if args.cache_dir else "")
  print(f"{'impl':8} {'D':>4} {'causal':6} {'pass':8} {'lower s':>8} "
        f"{'compile s':>9}" + ("  ptxas s per kernel" if args.ptxas
                               else ""))
  seq = 1024
  for head_dim in args.head_dims:
    for causal in (False, True):
      for impl in args.impls.split(","):
        seq += 8  # A shape no earlier case compiled.
        shape = bench.Shape(2, seq, 8, head_dim)
        q, k, v, ct = bench.random_inputs(jax.random.key(seq), shape,
                                          jnp.bfloat16)
        for pass_ in bench.PASSES:
          step = bench.make_step(bench.attention_fn(impl, causal), pass_)
          try:
            start = time.perf_counter()
            lowered = step.trace(q, k, v, ct).lower()
            lowered_s = time.perf_counter() - start
            start = time.perf_counter()
            _, printed = deviceless.capture_stdout(lowered.compile)
            compile_s = time.perf_counter() - start
            ptxas = ""
            if args.ptxas:
              ptxas = "  " + " ".join(f"{s:.2f}"
                                      for s in _ptxas_seconds(printed))
            print(f"{impl:8} {head_dim:4} {causal!s:6} {pass_:8} "
                  f"{lowered_s:8.2f} {compile_s:9.2f}{ptxas}", flush=True)
          except Exception as e:  # pylint: disable=broad-except
            print(f"{impl:8} {head_dim:4} {causal!s:6} {pass_:8} "
                  f"{bench.short_error(e)}", flush=True)


if __name__ == "__main__":
  main()
