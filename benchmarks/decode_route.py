"""Measures decode-shaped calls on every backend that can run them, for the
route that `flash_attention` takes by default (issue 23).

Usage (repo root, GPU machine):
  PYTHONPATH=. python3 benchmarks/decode_route.py --grid route --out DIR
  PYTHONPATH=. python3 benchmarks/decode_route.py --grid issue --out DIR

Each case is T new tokens per sequence (bf16), bottom-right causal with kv
lengths drawn in [S/2, S], timed with `implementation=` "decode" (the
split-K kernel), "mosaic" (Hopper) and "triton" (the training kernels),
"xla" (jflash's plain-JAX path), None (the registry's choice) and cuDNN
(`jax.nn.dot_product_attention`, not causal, with the kv lengths: the
same bytes read at T=1). Timing is
interleaved: every implementation is compiled first, then timed in rounds
(each round all of them, each call right after each other one equally
often over the rounds: `run.round_orders`), and each gets the median of
its round medians, so drifts of the GPU's clock hit all alike.

Writes DIR/decode_route_<grid>.json (one record per case: µs per
implementation) and prints a table with the ratio of the default to the
fastest jflash backend and to cuDNN.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from benchmarks import run
from jflash._src import platform

# (B, S, query heads, kv heads, head dim, T).
ISSUE_CASES = (
    (128, 1024, 32, 8, 128, 1), (256, 512, 32, 8, 128, 1),
    (64, 1024, 32, 8, 128, 1), (128, 2048, 32, 8, 128, 1),
    (32, 1024, 32, 32, 128, 1), (16, 4096, 16, 8, 256, 1),
    (8, 8192, 8, 1, 256, 1), (1, 32768, 32, 8, 128, 1),
    (64, 2048, 32, 32, 128, 1), (1, 32768, 32, 8, 128, 4),
)
# Where the decode kernel and the training kernels are close: few packed
# rows per kv head (MHA, small groups), short to mid caches.
ROUTE_CASES = tuple(
    (batch, kv_seq, heads, kv_heads, 128, tokens)
    for (heads, kv_heads), batch, kv_seq, tokens in itertools.product(
        ((32, 32), (32, 8)), (4, 32, 128), (512, 2048, 8192), (1, 4))
    if batch * kv_seq <= 128 * 8192
) + ((8, 4096, 16, 16, 64, 1), (32, 2048, 16, 16, 64, 1),
     (8, 4096, 16, 16, 256, 1), (32, 2048, 16, 16, 256, 1),
     (32, 2048, 8, 1, 128, 1), (8, 8192, 8, 1, 128, 4))
# The rest of the route's space after the MHA rows of ROUTE_CASES: GQA
# groups of 4 and 2 at small and mid batches, head dims 64 and 256, MQA,
# and 16 new tokens on an MHA cache.
ROUTE_MORE_CASES = tuple(
    (batch, kv_seq, 32, 8, 128, tokens)
    for batch, kv_seq, tokens in itertools.product(
        (4, 32), (512, 2048, 8192), (1, 4))
) + tuple(
    (batch, kv_seq, 16, 8, 128, 1)
    for batch, kv_seq in itertools.product((4, 32), (512, 2048))
) + ((4, 2048, 16, 16, 64, 1), (32, 2048, 16, 16, 64, 1),
     (4, 2048, 16, 16, 256, 1), (32, 2048, 16, 16, 256, 1),
     (32, 2048, 8, 1, 128, 1), (32, 2048, 32, 32, 128, 16))
GRIDS = {"issue": ISSUE_CASES, "route": ROUTE_CASES,
         "route_more": ROUTE_MORE_CASES}


def inputs(case, rng):
  """Random bf16 inputs drawn on the device (host draws of the large
  caches took longer than timing them), kv lengths in [S/2, S]."""
  batch, kv_seq, heads, kv_heads, head_dim, tokens = case
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  q = jax.random.normal(keys[0], (batch, tokens, heads, head_dim),
                        jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, kv_seq, kv_heads, head_dim),
                            jnp.bfloat16) for key in keys[1:])
  lengths = jnp.asarray(rng.integers(kv_seq // 2, kv_seq + 1, batch),
                        jnp.int32)
  return q, k, v, lengths


def implementations():
  names = [None, "decode", "triton"]
  if platform.cuda_compute_capability() == "9.0":
    names.append("mosaic")
  names.append("xla")
  impls = {}
  for name in names:
    impls[name or "default"] = jax.jit(
        lambda q, k, v, lengths, name=name: jflash.flash_attention(
            q, k, v, is_causal=True, causal_alignment="bottom_right",
            key_value_seq_lengths=lengths, implementation=name))
  impls["cudnn"] = jax.jit(
      lambda q, k, v, lengths: jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"))
  return impls


def time_interleaved(impls, args, rounds: int, iters: int):
  """{name: median over rounds of the per-call seconds} of every impl on
  the same args (`time_calls`)."""
  return time_calls({name: (fn, args) for name, fn in impls.items()},
                    rounds, iters)


def time_calls(calls, rounds: int, iters: int):
  """{name: median over rounds of the per-call seconds} of calls {name:
  (fn, args)}, each round timing `iters` back-to-back calls of every one in
  an order that puts each right after each other one equally often
  (`run.round_orders`: a slow spell of the GPU, or the clock a call
  leaves, falls on all of them alike);
  names whose first calls fail map to the error's text."""
  results, ready = {}, {}
  for name, (fn, args) in calls.items():
    try:
      jax.block_until_ready(fn(*args))
      jax.block_until_ready(fn(*args))
      ready[name] = fn, args
    except Exception as e:  # pylint: disable=broad-except
      results[name] = f"{type(e).__name__}: {str(e)[:100]}"
  samples = {name: [] for name in ready}
  for order in run.round_orders(list(ready), rounds):
    for name in order:
      fn, args = ready[name]
      start = time.perf_counter()
      for _ in range(iters):
        out = fn(*args)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - start) / iters)
  results.update({name: statistics.median(s) for name, s in samples.items()})
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--grid", choices=sorted(GRIDS), default="route")
  parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--limit", type=int, default=None,
                      help="only the first N cases (a smoke run)")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rng = np.random.default_rng(0)
  impls = implementations()
  records = []
  print(f"{platform.device_kind()}, jax {jax.__version__}; µs per call; "
        "default / best jflash backend, cuDNN / default (> 1: faster)")
  cases = GRIDS[args.grid][:args.limit]
  for case in cases:
    times = time_interleaved(impls, inputs(case, rng), args.rounds,
                             args.iters)
    record = dict(zip(("batch", "kv_seq", "num_heads", "num_kv_heads",
                       "head_dim", "tokens"), case))
    record["us"] = {name: (t * 1e6 if isinstance(t, float) else t)
                    for name, t in times.items()}
    records.append(record)
    us = record["us"]
    jflash_times = {n: t for n, t in us.items()
                    if n in ("decode", "triton", "mosaic")
                    and isinstance(t, float)}
    default = us.get("default")
    cells = " ".join(f"{n} {t:.1f}" if isinstance(t, float) else f"{n} err"
                     for n, t in us.items())
    ratio = ""
    if jflash_times and isinstance(default, float):
      best = min(jflash_times, key=jflash_times.get)
      ratio = f"default/best {default / jflash_times[best]:.3f} ({best})"
      if isinstance(us.get("cudnn"), float):
        ratio += f", cudnn/default {us['cudnn'] / default:.3f}"
    print(f"B={case[0]} S={case[1]} {case[2]}/{case[3]} D={case[4]} "
          f"T={case[5]}: {cells}; {ratio}", flush=True)
    # Written after every case: a run cut short keeps what it measured.
    path = os.path.join(args.out, f"decode_route_{args.grid}.json")
    with open(path, "w") as f:
      json.dump(dict(device=platform.device_kind(), jax=jax.__version__,
                     records=records), f, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
