"""Times paged prefill: a chunk of T new tokens per sequence against a paged
KV cache, next to the same call on the dense cache (issue 23).

Usage (repo root, GPU machine):
  PYTHONPATH=. python3 benchmarks/paged_prefill.py --out DIR

Each case: bf16, bottom-right causal, the chunk the last T of each
sequence's S cache entries (full lengths), pages shuffled in the pool. Per
case and implementation: median ms per call and the attention TFLOP/s
(causal bottom-right: 4 * T * (S - T / 2) * N * H flops per sequence),
then the paged/dense ratio of the default route. Timing is interleaved in
rounds (decode_route.py's timer). Writes DIR/paged_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import decode_route
import jflash
from jflash._src import platform

# (B, T, S, query heads, kv heads, head dim, page size).
CASES = (
    (1, 2048, 32768, 32, 8, 128, 64),
    (1, 2048, 32768, 32, 8, 128, 16),
    (1, 2048, 32768, 32, 8, 128, 128),
    (4, 512, 8192, 32, 8, 128, 64),
    (8, 256, 4096, 32, 32, 128, 64),
)


def case_inputs(case, rng):
  batch, tokens, kv_seq, heads, kv_heads, head_dim, page_size = case
  q = jnp.asarray(rng.standard_normal((batch, tokens, heads, head_dim)),
                  jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((batch, kv_seq, kv_heads,
                                           head_dim)), jnp.bfloat16)
          for _ in range(2))
  max_pages = kv_seq // page_size
  order = rng.permutation(batch * max_pages)
  table = jnp.asarray(order.reshape(batch, max_pages), jnp.int32)
  inverse = np.argsort(order)
  pages = lambda x: x.reshape(-1, page_size, kv_heads, head_dim)[inverse]
  lengths = (jnp.full((batch,), tokens, jnp.int32),
             jnp.full((batch,), kv_seq, jnp.int32))
  return q, k, v, pages(k), pages(v), table, lengths


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--iters", type=int, default=5)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rng = np.random.default_rng(0)
  names = [None, "triton"]
  if platform.cuda_compute_capability() == "9.0":
    names.append("mosaic")
  records = []
  print(f"{platform.device_kind()}, jax {jax.__version__}; ms per call "
        "(TFLOP/s)")
  for case in CASES:
    batch, tokens, kv_seq, heads, _, head_dim, page_size = case
    q, k, v, kp, vp, table, (q_lens, kv_lens) = case_inputs(case, rng)
    impls = {}
    for name in names:
      call = lambda q, k, v, t=None, name=name: jflash.flash_attention(
          q, k, v, block_table=t, query_seq_lengths=q_lens,
          key_value_seq_lengths=kv_lens, is_causal=True,
          causal_alignment="bottom_right", implementation=name)
      label = name or "default"
      impls[f"dense_{label}"] = (jax.jit(call), (q, k, v))
      impls[f"paged_{label}"] = (jax.jit(call), (q, kp, vp, table))
    # Each with its own arguments (bound here, passed at every call).
    times = decode_route.time_interleaved(
        {label: lambda fn=fn, fn_args=fn_args: fn(*fn_args)
         for label, (fn, fn_args) in impls.items()}, (), args.rounds,
        args.iters)
    flops = 4 * batch * tokens * (kv_seq - tokens / 2) * heads * head_dim
    record = dict(zip(("batch", "tokens", "kv_seq", "num_heads",
                       "num_kv_heads", "head_dim", "page_size"), case))
    record["ms"] = {n: (t * 1e3 if isinstance(t, float) else t)
                    for n, t in times.items()}
    records.append(record)
    cells = " ".join(
        f"{n} {t * 1e3:.3f} ({flops / t / 1e12:.0f})"
        if isinstance(t, float) else f"{n} err {t}"
        for n, t in times.items())
    ratio = ""
    if all(isinstance(times.get(n), float)
           for n in ("dense_default", "paged_default")):
      ratio = (f"; paged/dense TFLOP/s "
               f"{times['dense_default'] / times['paged_default']:.3f}")
    print(f"B={batch} T={tokens} S={kv_seq} {heads}/{case[4]} D={head_dim} "
          f"pages {page_size}: {cells}{ratio}", flush=True)
  path = os.path.join(args.out, "paged_prefill.json")
  with open(path, "w") as f:
    json.dump(dict(device=platform.device_kind(), jax=jax.__version__,
                   records=records), f, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
