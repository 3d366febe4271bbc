"""jflash in one page: the function, its gradient, under jit.

Compares `jflash.flash_attention` and its gradients with
`jax.nn.dot_product_attention` on float32 copies of the same inputs (full
float32 matmuls) and prints PASS when every relative error
(max |jflash - jax.nn| / max |jax.nn|) is within the tolerance of the
inputs' dtype (TOLERANCES below), FAIL otherwise; the exit status is 1 on
FAIL.

Run: python examples/quickstart.py   (CPU or GPU; on CPU it runs the same
Pallas kernels through the interpreter, so keep the sizes small there).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import jax
import jax.numpy as jnp

import jflash

# Largest relative error accepted, per dtype of the inputs. jflash rounds
# its outputs and gradients to that dtype: in bf16, 8 bits of mantissa
# (2^-9 = 2e-3 relative per rounding; measured through the interpreter:
# up to 5e-3 at 2 x 1024 tokens, D = 128).
TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="Sizes: batch 4 x 4096 tokens, bf16 on a GPU; 2 x 128, float32 "
      "elsewhere (the kernels through the Pallas interpreter). Tolerances: "
      + ", ".join(f"{dtype} {tol:g}" for dtype, tol in TOLERANCES.items())
      + ".")
  return parser


def relative_error(got: jax.Array, expected: jax.Array) -> float:
  """max |got - expected| / max |expected|, in float32."""
  got, expected = got.astype(jnp.float32), expected.astype(jnp.float32)
  return float(jnp.max(jnp.abs(got - expected)) / jnp.max(jnp.abs(expected)))


def report(name: str, shape, error: float, tolerance: float) -> bool:
  """Prints one comparison with its verdict; returns whether it passed."""
  passed = error <= tolerance
  print(f"{name} {tuple(shape)}: max |jflash - jax.nn| / max |jax.nn| = "
        f"{error:.2e} {'<=' if passed else '>'} {tolerance:g}: "
        f"{'ok' if passed else 'TOO LARGE'}")
  return passed


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the comparison; returns the exit status (0 PASS, 1 FAIL)."""
  build_parser().parse_args(argv)  # --help; no options otherwise.
  on_gpu = jax.default_backend() == "gpu"
  # [batch, seq_len, num_heads, head_dim]; GQA: 8 query heads, 2 kv heads.
  batch, seq_len, heads, kv_heads, head_dim = (4, 4096, 8, 2, 128) if on_gpu \
      else (2, 128, 8, 2, 64)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  tolerance = TOLERANCES[jnp.dtype(dtype).name]
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (batch, seq_len, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim), dtype)
  # Off a GPU, interpret=True runs the real kernels through Pallas's
  # interpreter; on a GPU the kernels are compiled.
  options = dict(is_causal=True, interpret=not on_gpu)
  print(f"device: {jax.devices()[0].device_kind}, q {q.shape} {q.dtype}, "
        f"k/v {k.shape}")
  # The reference: jax.nn on float32 copies, with full float32 matmuls.
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  exact = jax.default_matmul_precision("highest")

  attention = jax.jit(lambda q, k, v: jflash.flash_attention(q, k, v,
                                                             **options))
  out = attention(q, k, v)
  with exact:
    expected = jax.jit(jax.nn.dot_product_attention, static_argnames=(
        "is_causal",))(q32, k32, v32, is_causal=True)
  passed = [report("output", out.shape, relative_error(out, expected),
                   tolerance)]

  def loss(q, k, v):
    return jnp.mean(jflash.flash_attention(q, k, v, **options)
                    .astype(jnp.float32) ** 2)

  def expected_loss(q, k, v):
    return jnp.mean(jax.nn.dot_product_attention(q, k, v, is_causal=True)
                    ** 2)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  with exact:
    expected_grads = jax.jit(jax.grad(expected_loss, argnums=(0, 1, 2)))(
        q32, k32, v32)
  for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads):
    passed.append(report(name, g.shape, relative_error(g, e), tolerance))

  verdict = "PASS" if all(passed) else "FAIL"
  print(f"{verdict}: {sum(passed)} of {len(passed)} relative errors within "
        f"{tolerance:g} ({jnp.dtype(dtype).name})")
  return 0 if all(passed) else 1


if __name__ == "__main__":
  sys.exit(main())
