"""Times decode attention: jflash's split-K kernel against cuDNN, XLA and
JAX's Pallas decode op, side by side, plus the copy bandwidth.

Usage (repo root, GPU machine): PYTHONPATH=. python3 benchmarks/decode.py
One new token per sequence (T=1, or --tokens), bf16, D=128, caches filled
to random lengths between S/2 and S. Parts (--parts, default all three):

  table: per case and implementation, the median time per call
    (microseconds) and the K/V bytes of the valid cache entries read per
    second (TB/s), next to a device-to-device copy's bandwidth measured in
    the same run; jflash dense and paged (page size 64 and 16).
  sweep: jflash dense under other launch configurations (key tile, warps,
    stages: `decode_backend.DEFAULT_LAUNCH` patched while a fresh jit traces) and
    half / twice the default split count, each as a ratio to the default.
  route: `flash_attention` on decode-shaped calls (T new tokens, bottom-
    right causal, kv lengths) with implementation None (the registry's
    choice), "triton", "mosaic" (Hopper) and "decode", including short
    caches: where the decode backend should be the default.
"""

import argparse
from unittest import mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import run as bench
import jflash
from jflash._src.backends.triton import decode_backend as decode_lib

# B, S, query heads, kv heads (the table).
CASES = ((1, 32768, 32, 8), (8, 8192, 32, 8), (32, 4096, 32, 8),
         (64, 2048, 32, 32), (16, 16384, 64, 8))
HEAD_DIM = 128
# (block_k, num_warps, num_stages) tried by the sweep.
LAUNCHES = ((64, 4, 2), (64, 4, 4), (64, 8, 3), (32, 4, 3), (128, 4, 2),
            (128, 4, 3), (128, 8, 3))
# The route part's extra cases: short and mid caches, MHA and GQA.
ROUTE_CASES = ((8, 256, 32, 8), (8, 1024, 32, 8), (32, 512, 32, 32),
               (4, 2048, 16, 16))


def median_seconds(fn, args, repeats=20, iters=10):
  """Median per-call seconds after warm-up (benchmarks/run.py's timer)."""
  return bench.time_step(fn, args, warmup=2, repeats=repeats,
                         iters=iters)[1]


def copy_bandwidth() -> float:
  """Bytes read + written per second by a 4 GiB device-to-device copy."""
  x = jax.random.normal(jax.random.key(0), (1024, 1024, 1024), jnp.float32)
  copy = jax.jit(lambda x: x + 1.0)
  return 2 * x.nbytes / median_seconds(copy, (x,), repeats=5, iters=3)


def implementations(num_tokens):
  # Not causal: jax.nn's causal mask is top-left, which would let a single
  # new token see key 0 only. With T > 1 this reads the same bytes as a
  # bottom-right causal mask, which jax.nn cannot express without a dense
  # mask.
  def cudnn(q, k, v, lengths):
    return jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")

  def xla(q, k, v, lengths):
    return jflash.decode_attention(q, k, v, lengths, implementation="xla")

  def pallas_gqa(q, k, v, lengths):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental.pallas.ops.gpu import decode_attention
    return decode_attention.gqa(q[:, 0], k, v, kv_seq_len=lengths)[:, None]

  def jflash_dense(q, k, v, lengths):
    return jflash.decode_attention(q, k, v, lengths, implementation="decode")

  impls = {"jflash": jflash_dense, "cudnn": cudnn, "xla": xla}
  if num_tokens == 1:
    impls["pallas_gqa"] = pallas_gqa
  return impls


def paged(cache, page_size, order):
  """The cache as pages in a shuffled order: sequence b's page i is page
  order[b * max_pages + i] (the block table is `order` reshaped)."""
  batch, kv_seq = cache.shape[:2]
  pages = cache.reshape(batch * (kv_seq // page_size), page_size,
                        *cache.shape[2:])
  return pages[np.argsort(order)]


def inputs(case, num_tokens, rng):
  """(q, k, v, lengths, K/V bytes of the valid entries) of one case."""
  batch, kv_seq, heads, kv_heads = case
  keys = jax.random.split(jax.random.key(batch * kv_seq + heads), 3)
  q = jax.random.normal(keys[0], (batch, num_tokens, heads, HEAD_DIM),
                        jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, kv_seq, kv_heads, HEAD_DIM),
                        jnp.bfloat16)
  v = jax.random.normal(keys[2], k.shape, jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(kv_seq // 2, kv_seq + 1, batch),
                        jnp.int32)
  kv_bytes = 2 * int(jnp.sum(lengths)) * kv_heads * HEAD_DIM * 2
  return q, k, v, lengths, kv_bytes


def timed(fn, args) -> str:
  """' 12.3 us' or ' error Name: message' (one implementation's cell)."""
  try:
    return f" {median_seconds(jax.jit(fn), args) * 1e6:.1f} us"
  except Exception as e:  # pylint: disable=broad-except
    return f" error {type(e).__name__}: {str(e)[:80]}"


def sweep(num_tokens, rng):
  """Launch configurations and split counts against the default, dense."""
  print(f"sweep (default {decode_lib.DEFAULT_LAUNCH}); time ratio to the "
        "default, < 1 is faster")
  for case in CASES:
    q, k, v, lengths, _ = inputs(case, num_tokens, rng)
    splits = decode_lib.default_num_splits(case[0], case[3], case[1])
    run = lambda q, k, v, lengths, n=None: jflash.decode_attention(
        q, k, v, lengths, num_splits=n, implementation="decode")
    base = median_seconds(jax.jit(run), (q, k, v, lengths))
    row = f"B={case[0]} S={case[1]} {case[2]}/{case[3]} ({base * 1e6:.1f} us"
    row += f", {splits} splits):"
    for n in sorted({max(1, splits // 2), splits * 2} - {splits}):
      seconds = median_seconds(
          jax.jit(lambda *a, n=n: run(*a, n=n)), (q, k, v, lengths))
      row += f" splits={n} {seconds / base:.2f};"
    for block_k, warps, stages in LAUNCHES:
      launch = decode_lib.DecodeLaunch(block_k, warps, stages)
      with mock.patch.object(decode_lib, "DEFAULT_LAUNCH", launch):
        try:  # A fresh jit: traced (and the split count chosen) here.
          seconds = median_seconds(jax.jit(run), (q, k, v, lengths))
          row += f" k{block_k}w{warps}s{stages} {seconds / base:.2f};"
        except Exception as e:  # pylint: disable=broad-except
          row += f" k{block_k}w{warps}s{stages} error {type(e).__name__};"
    print(row)


def route(num_tokens, rng):
  """flash_attention on decode calls, per implementation (microseconds)."""
  print(f"route: flash_attention, T={num_tokens}, bottom-right causal, kv "
        "lengths")
  names = [None, "triton", "decode", "cudnn"]
  if "9.0" in str(getattr(jax.devices()[0], "compute_capability", "")):
    names.insert(2, "mosaic")
  for case in CASES + ROUTE_CASES:
    q, k, v, lengths, _ = inputs(case, num_tokens, rng)
    row = f"B={case[0]} S={case[1]} {case[2]}/{case[3]}:"
    for name in names:
      fn = lambda q, k, v, lengths, name=name: jflash.flash_attention(
          q, k, v, is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=lengths, implementation=name)
      row += f" {name or 'default'}" + timed(fn, (q, k, v, lengths)) + ";"
    print(row)


def table(num_tokens, rng):
  """Every implementation on the issue's cases, with bandwidths."""
  bandwidth = copy_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
  for case in CASES:
    batch, kv_seq, heads, kv_heads = case
    q, k, v, lengths, kv_bytes = inputs(case, num_tokens, rng)
    row = f"B={batch} S={kv_seq} {heads}/{kv_heads}:"
    impls = implementations(num_tokens)
    for page_size in (64, 16):
      max_pages = kv_seq // page_size
      order = rng.permutation(batch * max_pages)
      block_table = jnp.asarray(order.reshape(batch, max_pages),
                                jnp.int32)
      k_pages, v_pages = paged(k, page_size, order), paged(v, page_size,
                                                           order)
      # The pages are arguments (a closure would make them constants).
      impls[f"jflash_paged{page_size}"] = (
          lambda q, k, v, lengths, kp, vp, t: jflash.decode_attention(
              q, kp, vp, lengths, block_table=t, implementation="decode"),
          (k_pages, v_pages, block_table))
    for name, fn in impls.items():
      fn, extra = fn if isinstance(fn, tuple) else (fn, ())
      if extra:
        fn = lambda q, k, v, lengths, *extra, fn=fn: fn(q, None, None,
                                                         lengths, *extra)
      try:
        seconds = median_seconds(jax.jit(fn), (q, k, v, lengths, *extra))
        row += (f" {name} {seconds * 1e6:.1f} us "
                f"({kv_bytes / seconds / 1e12:.2f} TB/s);")
      except Exception as e:  # pylint: disable=broad-except
        row += f" {name} error {type(e).__name__}: {str(e)[:80]};"
    print(row)


def main():
  global CASES, HEAD_DIM  # pylint: disable=global-statement
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=1)
  parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
  parser.add_argument("--cases", nargs="+", metavar="B,S,N,K",
                      help="cases in place of the issue's (table, sweep)")
  parser.add_argument("--parts", nargs="+", default=["table", "sweep",
                                                      "route"],
                      choices=["table", "sweep", "route"])
  args = parser.parse_args()
  HEAD_DIM = args.head_dim
  if args.cases:
    CASES = tuple(tuple(int(x) for x in c.split(",")) for c in args.cases)
  print(jax.devices()[0].device_kind, jax.__version__, f"D={HEAD_DIM}")
  rng = np.random.default_rng(0)
  if "table" in args.parts:
    table(args.tokens, rng)
  if "sweep" in args.parts:
    sweep(args.tokens, rng)
  if "route" in args.parts:
    route(args.tokens, rng)


if __name__ == "__main__":
  main()
