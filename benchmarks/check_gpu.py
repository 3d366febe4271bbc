"""Quick compiled-kernel check on a GPU: errors against jax.nn, one timing.

Usage (repo root, GPU machine): PYTHONPATH=. python3 benchmarks/check_gpu.py
Prints, per case, the max abs error of the output and of dq, dk, dv against
jax.nn.dot_product_attention on float32-upcast inputs at HIGHEST precision,
next to the error of jax.nn itself run in the input dtype.
"""

import sys
import time
import traceback

import jax
import jax.numpy as jnp

import jflash

CASES = [
    # B, T, S, N, K, D, dtype, causal
    (2, 256, 256, 4, 4, 64, "bfloat16", False),
    (2, 256, 256, 4, 4, 64, "bfloat16", True),
    (1, 257, 100, 8, 2, 80, "float16", True),
    (2, 100, 257, 4, 1, 128, "float32", False),
    (1, 300, 300, 2, 2, 256, "bfloat16", True),
    (1, 17, 33, 2, 2, 32, "bfloat16", False),
    # float32 with the default tiles (the test suite uses small tiles).
    (1, 200, 300, 4, 2, 128, "float32", True),
    (1, 130, 70, 2, 1, 256, "float32", False),
    (1, 64, 64, 2, 2, 192, "float32", True),
    (2, 2048, 2048, 4, 4, 64, "float32", True),
    # The short-sequence forward tiles (64x64 up to 512 tokens; 64x32 for
    # causal 64 < D <= 128 up to 2048), odd lengths and T != S included.
    (2, 512, 512, 4, 4, 128, "bfloat16", False),
    (2, 1024, 1024, 4, 4, 128, "bfloat16", True),
    (1, 2000, 1999, 4, 2, 128, "bfloat16", True),
    (1, 1500, 1800, 4, 4, 96, "float16", True),
    # Causal calls with >= 16384 keys launch tile-major
    # (forward.CAUSAL_TILE_MAJOR_KV_LEN); D=256 with its 64-row dQ tiles.
    (1, 16400, 16400, 2, 1, 128, "bfloat16", True),
    (2, 1000, 1000, 4, 2, 256, "bfloat16", False),
]


def _errors(b, t, s, n, k, d, dtype, causal):
  keys = jax.random.split(jax.random.key(t * s + d), 4)
  q = jax.random.normal(keys[0], (b, t, n, d), dtype)
  kk = jax.random.normal(keys[1], (b, s, k, d), dtype)
  v = jax.random.normal(keys[2], (b, s, k, d), dtype)
  do = jax.random.normal(keys[3], (b, t, n, d), dtype)

  def run(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(do.astype(out.dtype)))

  ours = jax.jit(lambda *a: run(lambda q, k, v: jflash.flash_attention(
      q, k, v, is_causal=causal, implementation="triton"), *a))(q, kk, v)
  low = jax.jit(lambda *a: run(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal), *a))(q, kk, v)
  with jax.default_matmul_precision("highest"):
    up = [x.astype(jnp.float32) for x in (q, kk, v)]
    ref = jax.jit(lambda *a: run(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal), *a))(*up)
  err = lambda xs: [float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))
                    for x, r in zip(xs, ref)]
  return err(ours), err(low)


def main():
  print(jax.__version__, jax.devices())
  only = sys.argv[1] if len(sys.argv) > 1 else None  # e.g. "float32", "True"
  for case in CASES:
    if only and only not in map(str, case):
      continue
    try:
      ours, low = _errors(*case)
      within = all(o <= 3 * l + 1e-3 for o, l in zip(ours, low))
      flag = "OK " if within else "BAD"
      print(flag, case, "jflash", ["%.2e" % e for e in ours],
            "jax.nn-lowp", ["%.2e" % e for e in low], flush=True)
    except Exception:  # pylint: disable=broad-except
      print("FAIL", case)
      traceback.print_exc()
  if only:
    return
  b, n, h, d = 1, 8192, 16, 128
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(x, (b, n, h, d), jnp.bfloat16) for x in keys)
  for causal in (False, True):
    for name, fn in (
        ("jflash", lambda q, k, v: jflash.flash_attention(
            q, k, v, is_causal=causal)),
        ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))):
      f = jax.jit(fn)
      f(q, k, v).block_until_ready()
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
          out = f(q, k, v)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / 10)
      times.sort()
      flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
      print(f"fwd causal={causal} {name}: {flops / times[2] / 1e12:.0f} "
            "TFLOP/s", flush=True)


if __name__ == "__main__":
  main()
