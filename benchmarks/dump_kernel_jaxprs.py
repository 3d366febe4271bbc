"""Writes the jaxprs (kernels included) of forward + backward to a file.

A development check, not a benchmark: when a change must leave the
GPU-verified kernels untouched (new options behind static flags), dump the
jaxprs before and after the change and compare the two files byte for byte.
Runs on CPU (the kernels are traced with interpret=True, nothing is lowered).

  PYTHONPATH=. python3 benchmarks/dump_kernel_jaxprs.py /tmp/before.txt
  ... change ...
  PYTHONPATH=. python3 benchmarks/dump_kernel_jaxprs.py /tmp/after.txt
  cmp /tmp/before.txt /tmp/after.txt
"""

import itertools
import sys

import jax
import jax.numpy as jnp

import jflash

# (q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype)
SHAPES = ((100, 257, 4, 1, 80, "bfloat16"), (64, 64, 2, 2, 128, "float32"))


def main(path: str) -> None:
  texts = []
  for is_causal, lengths, shape in itertools.product(
      (False, True), (False, True), SHAPES):
    q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype = shape
    q = jnp.ones((2, q_len, num_heads, head_dim), dtype)
    k = jnp.ones((2, kv_len, num_kv_heads, head_dim), dtype)
    kwargs = dict(is_causal=is_causal, interpret=True)
    if lengths:
      kwargs.update(query_seq_lengths=jnp.array([q_len, 5]),
                    key_value_seq_lengths=jnp.array([3, kv_len]))

    def value_and_grads(q, k, v, kwargs=kwargs):
      out, vjp = jax.vjp(
          lambda q, k, v: jflash.flash_attention(q, k, v, **kwargs), q, k, v)
      return out, vjp(out)

    texts.append(f"{(is_causal, lengths, shape)}\n"
                 f"{jax.make_jaxpr(value_and_grads)(q, k, k)}")
  with open(path, "w") as f:
    f.write("\n\n".join(texts))


if __name__ == "__main__":
  main(sys.argv[1])
