"""Checks on a GPU that the kernels' launch choices fit its limits.

The CPU test tests/launch_limits_test.py walks every launch the default
choices can make through the shared-memory models; this script checks the
models and the choices against the GPU itself:

  calibrate: launches chosen to exceed shared memory (and some that fit),
    printing the model's bytes next to the bytes Triton requests (parsed
    from RESOURCE_EXHAUSTED) or "ran"; a model below a request is a bug.
  decode: decode_attention on the default route for every dtype (an FP8
    e4m3 query and cache too), head dims 64/128/256 and 16..1024 packed
    rows per kv head, against the XLA path.
  training: the Triton kernels' default tiles, forward and backward, per
    dtype and head dim, with and without a dense bias and mask.
  speed: launches that fit the issue-22 crash shape (13 tokens, GQA 8,
    head dim 256), timed against each other and cuDNN.
  repro: the exact call of issue 22 on the default route.

  PYTHONPATH=. python3 benchmarks/launch_limits.py [--parts ...]
"""

import argparse
import contextlib
import re
import traceback
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import run as bench
import jflash
from jflash._src import binding
from jflash._src.backends.triton import block_sizes
from jflash._src.backends.triton import decode as triton_decode
from jflash._src.spec import MaskSpec

DTYPES = ("bfloat16", "float16", "float32")
FP8 = "float8_e4m3fn"  # The decode kernel reads FP8 caches natively.


def _requested(error: Exception) -> str:
  found = re.search(r"requested (\d+)", str(error))
  if found:
    return f"requested {found.group(1)}"
  return f"error {type(error).__name__}: {str(error)[:160]}"


def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _decode_once(rows, head_dim, dtype, launch, kv_seq=1024):
  """One decode_call launch of `rows` packed rows (one kv head)."""
  keys = jax.random.split(jax.random.key(rows + head_dim), 3)
  q = _normal(keys[0], (1, 1, rows, head_dim), dtype)
  k = _normal(keys[1], (1, kv_seq, 1, head_dim), dtype)
  v = _normal(keys[2], (1, kv_seq, 1, head_dim), dtype)
  lengths = jnp.array([kv_seq], jnp.int32)
  mask = MaskSpec(is_causal=True, has_lengths=True, bottom_right=True)
  ones = jnp.ones((1, 1), jnp.float32)
  descales = dict(qk_descale=ones, v_descale=ones) if dtype == FP8 else {}
  run = jax.jit(lambda q, k, v: triton_decode.decode_call(
      q, k, v, lengths, None, **descales, mask=mask, scale=head_dim ** -0.5,
      soft_cap=None, num_tokens=1, group=rows, num_splits=1,
      block_k=launch.block_k, num_warps=launch.num_warps,
      num_stages=launch.num_stages, interpret=False))
  return jax.block_until_ready(run(q, k, v))


def _calibrate_one(rows, head_dim, dtype, launch):
  """(the model's bytes, "ran" or what Triton requested) of one launch."""
  model = triton_decode.shared_memory(
      launch, rows=rows, head_dim=head_dim,
      itemsize=jnp.dtype(dtype).itemsize)
  try:
    _decode_once(rows, head_dim, dtype, launch)
    return model, "ran"
  except Exception as e:  # pylint: disable=broad-except
    return model, _requested(e)


def calibrate_grid():
  """Decode launches over rows x head dims x dtypes x launches: the bytes
  Triton requests (or "ran"), beside the model's."""
  print("== calibrate_grid: decode, model bytes vs Triton's request")
  L = triton_decode.DecodeLaunch
  for dtype, rows, head_dim, launch in (
      (d, r, h, l) for d in ("bfloat16", "float32", FP8)
      for r in (16, 32, 64, 128)
      for h in (128, 256) for l in (L(64, 4, 4), L(64, 4, 3), L(32, 4, 4))):
    model, outcome = _calibrate_one(rows, head_dim, dtype, launch)
    print(f"{dtype} rows={rows} D={head_dim} k{launch.block_k}"
          f"s{launch.num_stages}: model {model} -> {outcome}", flush=True)


def calibrate():
  print("== calibrate: model bytes vs Triton's request "
        f"(limit {block_sizes.shared_memory_limit(jax.devices()[0].device_kind)})")
  L = triton_decode.DecodeLaunch
  cases = [(128, 256, "bfloat16", L(64, 4, 4)),
           (128, 256, "bfloat16", L(64, 4, 3)),
           (128, 256, "bfloat16", L(64, 4, 2)),
           (128, 256, "bfloat16", L(32, 4, 4)),
           (64, 256, "bfloat16", L(64, 4, 4)),
           (128, 128, "bfloat16", L(128, 4, 4)),
           (16, 128, "float32", L(64, 4, 4)),
           (16, 128, "float32", L(64, 4, 3)),
           (128, 256, "float32", L(32, 4, 2)),
           (128, 256, "float32", L(16, 4, 1)),
           (64, 256, "float32", L(64, 4, 2))]
  for rows, head_dim, dtype, launch in cases:
    model, outcome = _calibrate_one(rows, head_dim, dtype, launch)
    print(f"decode rows={rows} D={head_dim} {dtype} {launch}: model {model}"
          f" -> {outcome}")
  # Training kernels: oversized user tiles.
  B = jflash.BlockSizes
  for head_dim, dtype, tiles in (
      (256, "bfloat16", B(block_q=128, block_k=128, num_stages=4)),
      (128, "float32", B(block_q=128, block_k=128, num_stages=3)),
      (256, "bfloat16", B(block_q_dkv=128, block_k_dkv=128, block_q_dq=128,
                          block_k_dq=128, num_stages_bwd=3)),
      (128, "bfloat16", B(block_q_dkv=128, block_k_dkv=128, block_q_dq=128,
                          block_k_dq=128, num_stages_bwd=4))):
    itemsize = jnp.dtype(dtype).itemsize
    fwd = block_sizes.forward_shared_memory(
        tiles.block_q, tiles.block_k, tiles.num_stages, head_dim=head_dim,
        itemsize=itemsize)
    bwd = block_sizes.backward_shared_memory(
        tiles.block_q_dkv, tiles.block_k_dkv, tiles.block_q_dq,
        tiles.block_k_dq, tiles.num_stages_bwd, head_dim=head_dim,
        itemsize=itemsize)
    q = _normal(jax.random.key(0), (1, 1024, 2, head_dim), dtype)
    for name, fn in (
        ("forward", lambda q: jflash.flash_attention(
            q, q, q, implementation="triton", block_sizes=tiles)),
        ("backward", lambda q: jax.grad(lambda q: jflash.flash_attention(
            q, q, q, implementation="triton",
            block_sizes=tiles).astype(jnp.float32).sum())(q))):
      try:
        jax.block_until_ready(jax.jit(fn)(q))
        outcome = "ran"
      except Exception as e:  # pylint: disable=broad-except
        outcome = _requested(e)
      print(f"triton {name} D={head_dim} {dtype} {tiles}: model fwd {fwd} "
            f"bwd {bwd} -> {outcome}")


def _relative_error(x, ref):
  x, ref = (np.asarray(a, np.float64) for a in (x, ref))
  return float(np.max(np.abs(x - ref)) / max(1e-6, np.max(np.abs(ref))))


def decode_coverage():
  print("== decode: default route per dtype, head dim, packed rows")
  kv_seq, batch = 1024, 2
  for dtype, head_dim, (tokens, heads, kv_heads) in (
      (d, h, c) for d in (*DTYPES, FP8) for h in (64, 128, 256)
      for c in ((1, 8, 8), (4, 16, 1), (13, 16, 2), (16, 8, 1),
                (16, 64, 1))):
    keys = jax.random.split(jax.random.key(head_dim + tokens), 3)
    q = _normal(keys[0], (batch, tokens, heads, head_dim), dtype)
    k = _normal(keys[1], (batch, kv_seq, kv_heads, head_dim), dtype)
    v = _normal(keys[2], (batch, kv_seq, kv_heads, head_dim), dtype)
    descales = {}
    if dtype == FP8:  # The XLA path runs it dequantized.
      q, k, v, *scales = jflash.quantize_qkv(q, k, v)
      descales = dict(zip(("q_descale", "k_descale", "v_descale"), scales))
    lengths = jnp.array([kv_seq, 700], jnp.int32)
    rows = tokens * heads // kv_heads
    try:
      out = jax.jit(lambda q, k, v: jflash.decode_attention(
          q, k, v, lengths, implementation="decode", **descales))(q, k, v)
      ref = jflash.decode_attention(q, k, v, lengths, implementation="xla",
                                    **descales)
      outcome = f"ok, relative error {_relative_error(out, ref):.1e}"
    except Exception as e:  # pylint: disable=broad-except
      outcome = "FAILED " + _requested(e)
    print(f"{dtype} D={head_dim} T={tokens} {heads}/{kv_heads} "
          f"({rows} rows): {outcome}")


def training():
  print("== training: Triton default tiles, forward + backward")
  length = 1024
  for dtype, head_dim, dense in (
      (d, h, x) for d in DTYPES for h in (64, 128, 256)
      for x in (False, True)):
    keys = jax.random.split(jax.random.key(head_dim), 4)
    q = _normal(keys[0], (1, length, 4, head_dim), dtype)
    kwargs = {}
    if dense:
      kwargs = dict(bias=_normal(keys[1], (1, 4, length, length),
                                 jnp.float32),
                    mask=jax.random.bernoulli(keys[2], 0.9,
                                              (1, 1, length, length)))
    fn = jax.jit(jax.value_and_grad(lambda q: jflash.flash_attention(
        q, q, q, implementation="triton", **kwargs).astype(
            jnp.float32).sum()))
    try:
      value, grad = fn(q)
      finite = bool(jnp.isfinite(value)) and bool(
          jnp.all(jnp.isfinite(grad)))
      outcome = "ok" if finite else "NOT FINITE"
    except Exception as e:  # pylint: disable=broad-except
      outcome = "FAILED " + _requested(e)
    print(f"{dtype} D={head_dim} dense={dense}: {outcome}")


def speed():
  print("== speed: fitting launches at the issue-22 shape (us, median)")
  L, P = triton_decode.DecodeLaunch, triton_decode.DecodePlan
  plans = [None, P(128, L(32, 4, 4)), P(128, L(32, 4, 2)),
           P(128, L(64, 8, 2)), P(128, L(32, 8, 4)), P(64, L(64, 4, 3)),
           P(64, L(32, 4, 4))]
  for batch, tokens, heads, kv_heads, kv_seq, dtype in (
      (1, 13, 16, 2, 8292, "bfloat16"), (16, 13, 16, 2, 8292, "bfloat16")):
    keys = jax.random.split(jax.random.key(batch), 3)
    q = _normal(keys[0], (batch, tokens, heads, 256), dtype)
    k = _normal(keys[1], (batch, kv_seq, kv_heads, 256), dtype)
    v = _normal(keys[2], (batch, kv_seq, kv_heads, 256), dtype)
    lengths = jnp.full((batch,), kv_seq - 3, jnp.int32)
    row = f"B={batch} T={tokens} {heads}/{kv_heads} S={kv_seq} {dtype}:"
    call = lambda q, k, v, lengths, impl: jflash.flash_attention(
        q, k, v, is_causal=True, causal_alignment="bottom_right",
        key_value_seq_lengths=lengths, implementation=impl)
    for name in ("cudnn", "mosaic", None):
      try:
        seconds = bench.time_step(
            jax.jit(lambda *a, name=name: call(*a, name)),
            (q, k, v, lengths), warmup=2, repeats=15, iters=10)[1]
        row += f" {name or 'default'} {seconds * 1e6:.1f};"
        print(row, flush=True)
      except Exception as e:  # pylint: disable=broad-except
        row += f" {name} {_requested(e)[:60]};"
    for plan in plans:
      label = "chosen" if plan is None else (
          f"r{plan.rows}k{plan.launch.block_k}w{plan.launch.num_warps}"
          f"s{plan.launch.num_stages}")
      patch = (mock.patch.object(triton_decode, "plan_launch",
                                 lambda *a, plan=plan, **k: plan)
               if plan else contextlib.nullcontext())
      with patch:
        binding.clear_traced_passes()  # Or the last plan's trace is reused.
        try:
          seconds = bench.time_step(
              jax.jit(lambda *a: call(*a, "decode")), (q, k, v, lengths),
              warmup=2, repeats=15, iters=10)[1]
          row += f" {label} {seconds * 1e6:.1f};"
          print(row, flush=True)
        except Exception as e:  # pylint: disable=broad-except
          row += f" {label} {_requested(e)[:40]};"
    print(row)


def repro():
  print("== repro: issue 22's call on the default route")
  keys = jax.random.split(jax.random.key(22), 3)
  q = _normal(keys[0], (1, 13, 16, 256), jnp.bfloat16)
  k = _normal(keys[1], (1, 8292, 2, 256), jnp.bfloat16)
  v = _normal(keys[2], (1, 8292, 2, 256), jnp.bfloat16)
  lengths = jnp.array([8292], jnp.int32)
  kwargs = dict(is_causal=True, causal_alignment="bottom_right",
                key_value_seq_lengths=lengths)
  try:
    out = jax.block_until_ready(jflash.flash_attention(q, k, v, **kwargs))
    ref = jflash.flash_attention(q, k, v, implementation="xla", **kwargs)
    print(f"ok, relative error to XLA {_relative_error(out, ref):.1e}")
  except Exception:  # pylint: disable=broad-except
    print("FAILED\n" + traceback.format_exc()[-600:])


def main():
  parts = {"calibrate": calibrate, "calibrate_grid": calibrate_grid, "decode": decode_coverage,
           "training": training, "speed": speed, "repro": repro}
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", nargs="+", default=list(parts),
                      choices=list(parts))
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__)
  for name in args.parts:
    parts[name]()


if __name__ == "__main__":
  main()
