"""Times decode attention: jflash's split-K kernel against cuDNN, XLA and
JAX's Pallas decode op, side by side, plus the copy bandwidth.

Usage (repo root, GPU machine): PYTHONPATH=. python3 benchmarks/decode.py
One new token per sequence (T=1, or --tokens), bf16, D=128, caches filled
to random lengths between S/2 and S. Parts (--parts, default all three):

  table: per case and implementation, the median time per call
    (microseconds; all of a case's implementations timed in interleaved
    rounds) and the K/V bytes of the valid cache entries read per second
    (TB/s), next to a device-to-device copy's bandwidth measured in the
    same run; jflash dense and paged (page size 64 and 16).
  sweep: jflash dense under other launch configurations (key tile, warps,
    stages: `decode_backend.DEFAULT_LAUNCH` patched while a fresh jit traces) and
    half / twice the default split count, each as a ratio to the default.
  route: `flash_attention` on decode-shaped calls (T new tokens, bottom-
    right causal, kv lengths) with implementation None (the registry's
    choice), "triton", "mosaic" (Hopper) and "decode", including short
    caches: where the decode backend should be the default.
  fp8 (not in the default parts): the decode kernel over an FP8 (e4m3)
    query and cache against the same call on the bfloat16 cache, in the
    same run (FP8_CASES, each with its head dim; --head-dim and --cases
    do not apply): dense and paged (pages of 64), the old route (the
    whole cache dequantized to bfloat16, then the bfloat16 kernel) and
    cuDNN on bfloat16 beside; microseconds, TB/s of the valid K/V bytes,
    and the ratios bf16 / fp8 (issue 24's target: >= FP8_TARGET where
    B x S >= 128k). `--json PATH` also writes its rows. `--tiny` runs it
    anywhere: one tiny case, the kernels interpreted, one timing each.

  fp8_launches (not in the default parts): the FP8 cache's time under
    each launch of FP8_LAUNCHES (`decode_backend.FP8_LAUNCH` patched while
    a fresh jit traces), beside the bfloat16 cache at its default.

  PYTHONPATH=. python3 benchmarks/decode.py --parts fp8 [--tokens 4]
"""

import argparse
import json
from unittest import mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import decode_route
from benchmarks import run as bench
import jflash
from jflash._src import binding
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
# The fp8 part's cases: B, S, query heads, kv heads, head dim (issue 24:
# B x S >= 128k rows, plus B=1 and one head dim 256 row).
FP8_CASES = ((128, 1024, 32, 8, 128), (64, 2048, 32, 8, 128),
             (16, 8192, 32, 8, 128), (1, 32768, 32, 8, 128),
             (16, 8192, 32, 8, 256))
FP8_TINY_CASES = ((2, 256, 8, 2, 64),)
# Issue 24's target: the FP8 cache >= 1.7x faster than the bfloat16 one
# wherever B x S >= FP8_TARGET_ROWS.
FP8_TARGET = 1.7
FP8_TARGET_ROWS = 128 * 1024
# Timing repeats (--tiny: one) and the interpreter flag of jflash's calls.
REPEATS, ITERS, INTERPRET = 20, 10, False


def median_seconds(fn, args, repeats=None, iters=None):
  """Median per-call seconds after warm-up (benchmarks/run.py's timer)."""
  return bench.time_step(fn, args, warmup=2 if REPEATS > 1 else 0,
                         repeats=repeats or REPEATS,
                         iters=iters or ITERS)[1]


def interleaved_seconds(calls):
  """{name: median per-call seconds} of calls {name: (fn, args)}, jitted,
  in REPEATS interleaved rounds of ITERS calls (`decode_route.time_calls`:
  calls of ~100 us moved 10-40% between runs timed one after the other);
  names that fail map to "error " and the error's text."""
  results = decode_route.time_calls(
      {name: (jax.jit(fn), args) for name, (fn, args) in calls.items()},
      REPEATS, ITERS)
  return {name: f"error {x}" if isinstance(x, str) else x
          for name, x in results.items()}


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


def inputs(case, num_tokens, rng, head_dim=None):
  """(q, k, v, lengths, K/V bytes of the valid entries) of one case
  (bfloat16; head_dim: default HEAD_DIM)."""
  batch, kv_seq, heads, kv_heads = case
  head_dim = head_dim or HEAD_DIM
  keys = jax.random.split(jax.random.key(batch * kv_seq + heads), 3)
  q = jax.random.normal(keys[0], (batch, num_tokens, heads, head_dim),
                        jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, kv_seq, kv_heads, head_dim),
                        jnp.bfloat16)
  v = jax.random.normal(keys[2], k.shape, jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(kv_seq // 2, kv_seq + 1, batch),
                        jnp.int32)
  kv_bytes = 2 * int(jnp.sum(lengths)) * kv_heads * head_dim * 2
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
      with mock.patch.object(decode_lib, "DEFAULT_LAUNCH", launch), \
          mock.patch.object(decode_lib, "WIDE_TILE_LAUNCH", None):
        # jflash keeps each call's traced pass: drop them, or this launch
        # would reuse the last one's trace.
        binding.clear_traced_passes()
        try:  # A fresh jit: traced (and the split count chosen) here. A
          # new function object: jit's trace cache is keyed by the function,
          # and `jax.jit(run)` again would reuse the first launch's trace.
          seconds = median_seconds(jax.jit(lambda *a: run(*a)),
                                   (q, k, v, lengths))
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
    calls = {}
    for name, fn in impls.items():
      fn, extra = fn if isinstance(fn, tuple) else (fn, ())
      if extra:
        fn = lambda q, k, v, lengths, *extra, fn=fn: fn(q, None, None,
                                                         lengths, *extra)
      calls[name] = (fn, (q, k, v, lengths, *extra))
    for name, seconds in interleaved_seconds(calls).items():
      if isinstance(seconds, str):
        row += f" {name} {seconds};"
      else:
        row += (f" {name} {seconds * 1e6:.1f} us "
                f"({kv_bytes / seconds / 1e12:.2f} TB/s);")
    print(row)


def fp8_table(num_tokens, rng, json_path=None):
  """The decode kernel over an FP8 (e4m3) cache against the bfloat16 one.

  Per case (its calls timed in interleaved rounds): jflash's decode kernel
  on the bfloat16 query and cache, on
  their FP8 quantization (read natively), on the FP8 cache dequantized to
  bfloat16 first in the same jit (the route before the kernel read FP8),
  dense and with pages of 64 (the same permutation for both dtypes), and
  cuDNN on bfloat16 (not causal: jax.nn's causal mask is top-left; with one
  token it reads the same entries).
  """
  print(f"fp8: decode over an e4m3 cache vs bfloat16, T={num_tokens}, "
        "bottom-right causal, lengths S/2..S; us (TB/s of valid K/V "
        "bytes); ratio = bf16 / fp8 time")
  rows = []
  for case in (FP8_TINY_CASES if INTERPRET else FP8_CASES):
    batch, kv_seq, heads, kv_heads, head_dim = case
    q, k, v, lengths, kv_bytes = inputs(case[:4], num_tokens, rng, head_dim)
    q8, k8, v8, qd, kd, vd = jflash.quantize_qkv(q, k, v)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    page_size = 64
    order = rng.permutation(batch * (kv_seq // page_size))
    table = jnp.asarray(order.reshape(batch, -1), jnp.int32)
    decode = lambda q, k, v, lengths, descales, table=None: (
        jflash.decode_attention(q, k, v, lengths, block_table=table,
                                implementation="decode",
                                interpret=INTERPRET, **descales))

    def dequantized(q8, k8, v8, lengths, descales):
      real = [jflash.dequantize_fp8(x, descales[name], dtype=jnp.bfloat16)
              for x, name in ((q8, "q_descale"), (k8, "k_descale"),
                              (v8, "v_descale"))]
      return decode(*real, lengths, {})

    def cudnn(q, k, v, lengths):
      return jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")

    cells = {
        "bf16": (decode, (q, k, v, lengths, {}), kv_bytes),
        "fp8": (decode, (q8, k8, v8, lengths, descales), kv_bytes // 2),
        "fp8_dequantized": (dequantized, (q8, k8, v8, lengths, descales),
                            kv_bytes // 2),
        "bf16_paged64": (decode, (q, paged(k, page_size, order),
                                  paged(v, page_size, order), lengths, {},
                                  table), kv_bytes),
        "fp8_paged64": (decode, (q8, paged(k8, page_size, order),
                                 paged(v8, page_size, order), lengths,
                                 descales, table), kv_bytes // 2),
        "cudnn_bf16": (cudnn, (q, k, v, lengths), kv_bytes),
    }
    result = dict(batch=batch, kv_seq=kv_seq, num_heads=heads,
                  num_kv_heads=kv_heads, head_dim=head_dim,
                  num_tokens=num_tokens)
    line = f"B={batch} S={kv_seq} {heads}/{kv_heads} D={head_dim}:"
    times = interleaved_seconds({name: (fn, args) for name, (fn, args, _)
                                 in cells.items()})
    for name, (_, _, nbytes) in cells.items():
      seconds = times[name]
      if isinstance(seconds, str):
        result[f"{name}_us"] = None
        line += f" {name} {seconds};"
      else:
        result[f"{name}_us"] = seconds * 1e6
        line += (f" {name} {seconds * 1e6:.1f} us "
                 f"({nbytes / seconds / 1e12:.2f} TB/s);")
    for label, slow, fast in (("ratio", "bf16", "fp8"),
                              ("ratio_paged64", "bf16_paged64",
                               "fp8_paged64"),
                              ("ratio_vs_dequantized", "fp8_dequantized",
                               "fp8")):
      if result[f"{slow}_us"] and result[f"{fast}_us"]:
        result[label] = result[f"{slow}_us"] / result[f"{fast}_us"]
        line += f" {label} {result[label]:.2f}x;"
    if batch * kv_seq >= FP8_TARGET_ROWS and "ratio" in result:
      result["meets_target"] = result["ratio"] >= FP8_TARGET
      line += (f" target {FP8_TARGET}x "
               f"{'met' if result['meets_target'] else 'MISSED'}")
    rows.append(result)
    print(line, flush=True)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(dict(device_kind=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)


# fp8_launches: the decode kernel's preferred launches tried on FP8 caches
# (decode_backend.FP8_LAUNCH, (64, 4, 3), first: one stage fewer than
# DEFAULT_LAUNCH was 0.5-5.5% faster, wider tiles and 8 warps were not).
FP8_LAUNCHES = ((64, 4, 3), (64, 4, 4), (128, 4, 4), (128, 4, 3),
                (128, 8, 3), (256, 8, 2), (64, 4, 6))


def fp8_launch_sweep(num_tokens, rng):
  """The FP8 cache's decode time per preferred launch (decode_backend's
  FP8_LAUNCH, patched), beside the bfloat16 cache at the default."""
  print(f"fp8_launches: T={num_tokens}; us per (block_k, warps, stages)")
  for case in FP8_CASES[:3]:
    batch, kv_seq, heads, kv_heads, head_dim = case
    q, k, v, lengths, _ = inputs(case[:4], num_tokens, rng, head_dim)
    q8, k8, v8, qd, kd, vd = jflash.quantize_qkv(q, k, v)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    decode = lambda q, k, v, lengths, descales: jflash.decode_attention(
        q, k, v, lengths, implementation="decode", **descales)
    line = (f"B={batch} S={kv_seq} D={head_dim}: bf16 default "
            f"{median_seconds(jax.jit(decode), (q, k, v, lengths, {})) * 1e6:.1f};")
    for launch in FP8_LAUNCHES:
      with mock.patch.object(decode_lib, "FP8_LAUNCH",
                             decode_lib.DecodeLaunch(*launch)):
        binding.clear_traced_passes()  # As in `sweep`.
        try:  # A new function: traced with this launch (see `sweep`).
          seconds = median_seconds(jax.jit(lambda *a: decode(*a)),
                                   (q8, k8, v8, lengths, descales))
          line += f" fp8 {launch} {seconds * 1e6:.1f};"
        except Exception as e:  # pylint: disable=broad-except
          line += f" fp8 {launch} error {type(e).__name__};"
    print(line, flush=True)


def main():
  # pylint: disable-next=global-statement
  global CASES, HEAD_DIM, REPEATS, ITERS, INTERPRET
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=1)
  parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
  parser.add_argument("--cases", nargs="+", metavar="B,S,N,K",
                      help="cases in place of the issue's (table, sweep)")
  parser.add_argument("--parts", nargs="+", default=["table", "sweep",
                                                      "route"],
                      choices=["table", "sweep", "route", "fp8",
                               "fp8_launches"])
  parser.add_argument("--json", help="the fp8 part's rows as JSON")
  parser.add_argument("--tiny", action="store_true",
                      help="fp8 part only: a tiny case, kernels "
                      "interpreted, one timing (runs on a CPU)")
  args = parser.parse_args()
  if args.tiny:
    if args.parts != ["fp8"]:
      parser.error("--tiny runs the fp8 part only: pass --parts fp8")
    REPEATS, ITERS, INTERPRET = 1, 1, True
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
  if "fp8" in args.parts:
    fp8_table(args.tokens, rng, args.json)
  if "fp8_launches" in args.parts:
    fp8_launch_sweep(args.tokens, rng)


if __name__ == "__main__":
  main()
