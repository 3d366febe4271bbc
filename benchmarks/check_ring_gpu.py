"""Checks jflash.ring_attention on the local GPUs against flash_attention.

Usage (repo root, a machine with 2+ GPUs):
  PYTHONPATH=. python3 benchmarks/check_ring_gpu.py [--seq 8192]

For every strategy and layout, causal and not, on a 1-D mesh of all local
devices: the output and the gradients of q, k and v (of sum(out * ct)) of
`ring_attention` against single-device `flash_attention` on the same bf16
inputs (GQA, 8 query / 2 kv heads, D=128), as the largest error relative to
the reference's largest magnitude. Prints PASS/FAIL per case (bound 2e-2,
bf16's few ulps after the fp32 merge); exits non-zero on a failure.
"""

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jflash

BOUND = 2e-2


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq", type=int, default=8192)
  args = parser.parse_args()
  devices = jax.devices()
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("context",))
  print(f"{n} x {devices[0].device_kind}, seq {args.seq}")
  keys = jax.random.split(jax.random.key(0), 4)
  shape_q, shape_kv = (1, args.seq, 8, 128), (1, args.seq, 2, 128)
  q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
  k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
  v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)
  ct = jax.random.normal(keys[3], shape_q, jnp.bfloat16)
  failed = 0
  for causal, strategy, layout in itertools.product(
      (True, False), ("ring", "all_gather"), ("contiguous", "balanced")):
    if layout == "balanced" and not causal:
      continue

    def reference(q, k, v, causal=causal):
      return jflash.flash_attention(q, k, v, is_causal=causal)

    def ring(q, k, v, causal=causal, strategy=strategy, layout=layout):
      return jflash.ring_attention(q, k, v, mesh=mesh, axis_name="context",
                                   is_causal=causal, strategy=strategy,
                                   layout=layout)

    def value_and_grads(fn, order):
      def loss(q, k, v):
        out = fn(*(order(x) for x in (q, k, v)))
        return jnp.sum(out.astype(jnp.float32) * order(ct)), out
      (_, out), grads = jax.jit(jax.value_and_grad(
          loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
      return out, grads

    balance = ((lambda x: jflash.load_balance(x, n)) if layout == "balanced"
               else (lambda x: x))
    out, grads = value_and_grads(ring, balance)
    if layout == "balanced":
      out = jflash.load_unbalance(out, n)
    ref_out, ref_grads = value_and_grads(reference, lambda x: x)
    errors = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads),
                               (ref_out, *ref_grads)):
      got, want = (np.asarray(x, np.float32) for x in (got, want))
      errors[name] = float(np.max(np.abs(got - want))
                           / max(np.max(np.abs(want)), 1e-30))
    ok = all(e < BOUND for e in errors.values())
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} causal={causal} {strategy} {layout}: "
          + " ".join(f"{k}={e:.2e}" for k, e in errors.items()))
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
