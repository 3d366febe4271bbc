"""Split counts of the decode kernel over FP8 and bfloat16 caches, over
several draws of the kv lengths (issue 24: a split rule for FP8 caches).

Usage (repo root, GPU machine):
  PYTHONPATH=. python3 benchmarks/fp8_decode_splits.py [--out DIR]
      [--cases B,S,N,K,D ...] [--splits 0 1 2 4 8] [--bf16-splits 0 1]
      [--draws 2]
  PYTHONPATH=. python3 benchmarks/fp8_decode_splits.py --interpret \
      --cases 2,256,8,2,64 --rounds 1 --iters 1   # a smoke run on a CPU

Per case and draw of kv lengths (draw 0: every sequence full, lengths = S;
draws 1..: lengths uniform in [S/2, S], one NumPy seed per draw), one T=1
decode call (`decode_attention(..., implementation="decode", num_splits=)`)
on the bfloat16 cache and on its e4m3 quantization (`quantize_qkv`) at each
split count (0: the default rule, `num_splits=None`), and cuDNN on the
bfloat16 cache (GPU runs), all timed in the same interleaved rounds
(`decode_route.time_calls`). Prints per row the
microseconds per call, and bf16-at-its-default / fp8-at-each-count (issue
24's target: >= 1.7 where B x S >= 128k); writes DIR/fp8_decode_splits.json.
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
from jflash._src.backends.triton import decode_backend

# B, S, query heads, kv heads, head dim: issue 24's B x S >= 128k rows.
CASES = ((128, 1024, 32, 8, 128), (64, 2048, 32, 8, 128),
         (32, 4096, 32, 8, 128), (16, 8192, 32, 8, 128),
         (16, 8192, 32, 8, 256))


def _case(text):
  return tuple(int(x) for x in text.split(","))


def draw_lengths(batch, kv_seq, draw):
  """Draw 0: all full; draw d > 0: uniform in [S/2, S] with seed d."""
  if draw == 0:
    return np.full((batch,), kv_seq, np.int32)
  rng = np.random.default_rng(draw)
  return rng.integers(kv_seq // 2, kv_seq + 1, batch).astype(np.int32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", type=_case, nargs="+", default=CASES)
  parser.add_argument("--splits", type=int, nargs="+",
                      default=[0, 1, 2, 4, 8])
  parser.add_argument("--bf16-splits", type=int, nargs="+", default=[0, 1],
                      help="split counts of the bfloat16 cache (0: default)")
  parser.add_argument("--draws", type=int, default=2,
                      help="draws of kv lengths besides the full one")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--interpret", action="store_true",
                      help="the kernel in the Pallas interpreter (CPU)")
  parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
  records = []
  for batch, kv_seq, heads, kv_heads, head_dim in args.cases:
    keys = jax.random.split(jax.random.key(batch * kv_seq + head_dim), 3)
    q = jax.random.normal(keys[0], (batch, 1, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, kv_seq, kv_heads, head_dim),
                          jnp.bfloat16)
    v = jax.random.normal(keys[2], k.shape, jnp.bfloat16)
    q8, k8, v8, qd, kd, vd = jflash.quantize_qkv(q, k, v)
    default = decode_backend.default_num_splits(batch, kv_heads, kv_seq)
    default_fp8 = decode_backend.default_num_splits(batch, kv_heads,
                                                    kv_seq, fp8=True)
    # One jitted function per split count, shared by the draws (the
    # lengths are an argument): each compiles once per dtype.
    jitted = {splits: jax.jit(
        lambda q, k, v, lengths, d, n=splits or None: jflash.decode_attention(
            q, k, v, lengths, implementation="decode", num_splits=n,
            interpret=args.interpret, **d))
              for splits in sorted({*args.splits, *args.bf16_splits})}
    fp8_descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    # Not causal: jax.nn's causal mask is top-left; with one token and the
    # lengths it reads the same entries.
    cudnn = jax.jit(lambda q, k, v, lengths: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"))
    for draw in range(args.draws + 1):
      lengths = jnp.asarray(draw_lengths(batch, kv_seq, draw))
      calls = {}
      for splits, call in jitted.items():
        if splits in args.splits:
          calls[f"fp8_{splits}"] = (call,
                                    (q8, k8, v8, lengths, fp8_descales))
        if splits in args.bf16_splits or splits == 0:
          calls[f"bf16_{splits}"] = (call, (q, k, v, lengths, {}))
      if not args.interpret:  # cuDNN on the bfloat16 cache, beside.
        calls["cudnn_bf16"] = (cudnn, (q, k, v, lengths))
      times = decode_route.time_calls(calls, args.rounds, args.iters)
      us = {name: (t * 1e6 if isinstance(t, float) else t)
            for name, t in times.items()}
      bf16 = us["bf16_0"]
      line = (f"B={batch} S={kv_seq} {heads}/{kv_heads} D={head_dim} "
              f"draw {draw} (default splits: bf16 {default}, fp8 {default_fp8}): "
              f"bf16 {bf16:.1f} us;")
      if "cudnn_bf16" in us:
        line += f" cuDNN bf16 {us['cudnn_bf16']:.1f} us;"
      for splits in args.bf16_splits:
        if splits:
          t = us[f"bf16_{splits}"]
          line += (f" bf16@{splits} {t:.1f};" if isinstance(t, float)
                   else f" bf16@{splits} {t};")
      for splits in args.splits:
        t = us[f"fp8_{splits}"]
        line += (f" fp8@{splits or 'def'} {t:.1f} ({bf16 / t:.2f}x);"
                 if isinstance(t, float) else f" fp8@{splits} {t};")
      print(line, flush=True)
      records.append(dict(batch=batch, kv_seq=kv_seq, num_heads=heads,
                          num_kv_heads=kv_heads, head_dim=head_dim,
                          draw=draw, default_splits=default,
                          default_fp8_splits=default_fp8,
                          total_keys=int(lengths.sum()), us=us))
  with open(os.path.join(args.out, "fp8_decode_splits.json"), "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
