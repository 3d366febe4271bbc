"""Compile time per new shape: tracing + lowering, then XLA/ptxas compile.

Usage (repo root, GPU machine): PYTHONPATH=. python3 benchmarks/compile_time.py
For each head dim and causal setting, a fresh shape per implementation (so
no cache is hit), forward and forward+backward (`jax.grad` of a loss):
seconds spent in `trace().lower()` (Python: the kernels' Mosaic/Triton
modules are built there) and in `.compile()` (XLA and the GPU assembler).
"""

import time

import jax
import jax.numpy as jnp

from benchmarks import run as bench

IMPLS = ("mosaic", "triton", "cudnn")


def main():
  print(jax.devices()[0].device_kind)
  print(f"{'impl':8} {'D':>4} {'causal':6} {'pass':8} {'lower s':>8} "
        f"{'compile s':>9}")
  seq = 1024
  for head_dim in (64, 128, 256):
    for causal in (False, True):
      for impl in IMPLS:
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
            lowered.compile()
            compile_s = time.perf_counter() - start
            print(f"{impl:8} {head_dim:4} {causal!s:6} {pass_:8} "
                  f"{lowered_s:8.2f} {compile_s:9.2f}")
          except Exception as e:  # pylint: disable=broad-except
            print(f"{impl:8} {head_dim:4} {causal!s:6} {pass_:8} "
                  f"{bench.short_error(e)}")


if __name__ == "__main__":
  main()
