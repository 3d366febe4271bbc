"""Compiled Mosaic GPU kernels against the XLA path, on a Hopper GPU.

Usage (repo root, H100/H200):
  PYTHONPATH=. python3 benchmarks/check_mosaic.py [WORD ...]
(with words: only the cases whose description contains one of them, e.g.
`segments`).
Per case: ||x - ref|| / ||ref|| of the output, lse, dq, dk and dv of the
default choice (implementation=None), the reference being jflash's XLA path on
float32-upcast inputs at HIGHEST precision (itself tested against
jax.nn.dot_product_attention), and the compile time. Fresh random inputs;
a NaN anywhere fails. Ends with PASS/FAIL counts; exit status 1 on a FAIL.
"""

import dataclasses
import sys
import time
import traceback

import jax
import jax.numpy as jnp

import jflash
from jflash._src import api
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src import registry

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}
# The default choice: on Hopper the Mosaic forward, and the Mosaic backward
# where it exists (else Triton's), which also checks the forward's lse.
IMPLEMENTATION = None

# B, T, S, N, K, D, dtype, options
CASES = [
    (2, 256, 256, 4, 4, 128, "bfloat16", {}),
    (2, 256, 256, 4, 4, 64, "float16", {}),
    (1, 512, 512, 2, 2, 256, "bfloat16", {}),
    (2, 384, 384, 4, 2, 128, "bfloat16", dict(is_causal=True)),
    (1, 1000, 1000, 4, 1, 128, "bfloat16", dict(is_causal=True)),
    (1, 300, 700, 2, 2, 128, "float16", dict(is_causal=True)),
    (1, 300, 700, 2, 2, 128, "bfloat16",
     dict(is_causal=True, causal_alignment="bottom_right")),
    (1, 700, 300, 2, 2, 64, "bfloat16",
     dict(is_causal=True, causal_alignment="bottom_right")),
    (1, 257, 129, 2, 2, 128, "bfloat16", {}),
    (1, 17, 33, 2, 2, 64, "bfloat16", {}),
    (2, 512, 512, 4, 2, 128, "bfloat16", dict(local_window_size=(100, 0),
                                              is_causal=True)),
    (2, 512, 512, 4, 4, 128, "bfloat16", dict(local_window_size=(64, 30))),
    (2, 512, 512, 4, 4, 128, "bfloat16", dict(logits_soft_cap=20.0)),
    (3, 320, 448, 4, 2, 128, "bfloat16", dict(
        query_seq_lengths=(320, 100, 0), key_value_seq_lengths=(448, 17, 5),
        is_causal=True)),
    (2, 4096, 4096, 8, 8, 128, "bfloat16", dict(is_causal=True)),
    (2, 200, 200, 4, 2, 64, "bfloat16", dict(
        is_causal=True, sinks=(0.5, -1.0, 3.0, 0.0),
        query_seq_lengths=(200, 50), key_value_seq_lengths=(0, 120))),
    # segments=(q run length, kv run length): ids position // run length
    # (packed sequences when equal), or "random": ids in [0, 3).
    (2, 1000, 1000, 4, 2, 128, "bfloat16", dict(segments=(96, 96),
                                                is_causal=True)),
    (1, 4096, 4096, 4, 4, 128, "bfloat16", dict(segments=(512, 512))),
    (2, 300, 460, 4, 1, 64, "bfloat16", dict(
        segments="random", query_seq_lengths=(300, 120),
        key_value_seq_lengths=(460, 77))),
    (1, 512, 512, 2, 2, 256, "bfloat16", dict(segments=(100, 100),
                                              is_causal=True)),
    (1, 640, 520, 4, 2, 128, "float16", dict(
        segments=(200, 130), is_causal=True,
        causal_alignment="bottom_right", local_window_size=(150, 0))),
    # The opt-in atomic dQ backward (MosaicBlockSizes.atomic_dq).
    (2, 384, 384, 4, 2, 128, "bfloat16", dict(atomic_dq=True,
                                              is_causal=True)),
    (1, 257, 129, 2, 2, 128, "bfloat16", dict(atomic_dq=True)),
    (2, 256, 256, 4, 4, 64, "float16", dict(atomic_dq=True)),
    (2, 300, 460, 4, 1, 64, "bfloat16", dict(
        atomic_dq=True, segments="random", query_seq_lengths=(300, 120),
        key_value_seq_lengths=(460, 77))),
    (3, 320, 448, 4, 2, 128, "bfloat16", dict(
        atomic_dq=True, query_seq_lengths=(320, 100, 0),
        key_value_seq_lengths=(448, 17, 5), is_causal=True,
        local_window_size=(64, 0), logits_soft_cap=20.0)),
]


def segment_ids(kind, batch, q_len, kv_len, key):
  """(q_segment_ids, kv_segment_ids) int32 [B, T], [B, S] (see CASES)."""
  if kind == "random":
    q_key, kv_key = jax.random.split(key)
    return (jax.random.randint(q_key, (batch, q_len), 0, 3),
            jax.random.randint(kv_key, (batch, kv_len), 0, 3))
  q_run, kv_run = kind
  ids = lambda n, run: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) // run,
                                        (batch, n))
  return ids(q_len, q_run), ids(kv_len, kv_run)


def check(case, implementation):
  b, t, s, n, k, d, dtype, options = case
  keys = jax.random.split(jax.random.key(hash(str(case)) % 2**31), 4)
  q = jax.random.normal(keys[0], (b, t, n, d), dtype)
  kk = jax.random.normal(keys[1], (b, s, k, d), dtype)
  v = jax.random.normal(keys[2], (b, s, k, d), dtype)
  options = dict(options)
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in options:
      options[name] = jnp.array(options[name], jnp.int32)
  if "sinks" in options:
    options["sinks"] = jnp.array(options["sinks"], jnp.float32)
  kernel_only = {}  # Options of the kernels, not of the XLA reference.
  if options.pop("atomic_dq", False):
    # The opt-in one-kernel backward, default tiles otherwise.
    kernel_only["block_sizes"] = dataclasses.replace(
        mosaic_config.default_block_sizes(d), atomic_dq=True)
    kernel_only["deterministic_grads"] = False
  if "segments" in options:
    options["q_segment_ids"], options["kv_segment_ids"] = segment_ids(
        options.pop("segments"), b, t, s, keys[3])

  def run(impl, *args):
    kernel_options = {} if impl == "xla" else kernel_only
    return jflash.flash_attention(*args, implementation=impl,
                                  return_residual=True,
                                  residual_dtype=jnp.float32, **options,
                                  **kernel_options)

  dout = jax.random.normal(keys[3], q.shape, dtype)

  def with_grads(impl, *args):
    (out, lse), vjp = jax.vjp(lambda *a: run(impl, *a), *args)
    return (out, lse, *vjp((dout.astype(out.dtype), jnp.zeros_like(lse))))

  f = jax.jit(lambda *a: with_grads(implementation, *a))
  start = time.perf_counter()
  compiled = f.lower(q, kk, v).compile()
  compile_s = time.perf_counter() - start
  results = compiled(q, kk, v)
  with jax.default_matmul_precision("highest"):
    expected = jax.jit(lambda *a: with_grads("xla", *a))(
        *(x.astype(jnp.float32) for x in (q, kk, v)))
  errors = {}
  for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), results,
                          expected):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    finite = jnp.isfinite(ref)
    if not bool(jnp.all(jnp.isfinite(x) == finite)):
      errors[name] = float("nan")
      continue
    x, ref = jnp.where(finite, x, 0), jnp.where(finite, ref, 0)
    errors[name] = float(jnp.linalg.norm(x - ref) /
                         jnp.maximum(jnp.linalg.norm(ref), 1e-30))
  call = api.describe(q, kk, v, **options)
  plan = registry.plan(call.spec, implementation, call.options)
  errors["plan"] = f"{plan.forward}+{plan.backward}"
  return errors, compile_s


def main():
  print(jax.devices()[0].device_kind, jax.__version__)
  failed = passed = 0
  words = sys.argv[1:]
  for case in CASES:
    label = " ".join(map(str, case[:7])) + " " + str(case[7])
    if words and not any(word in label for word in words):
      continue
    try:
      errors, compile_s = check(case, IMPLEMENTATION)
    except Exception as e:  # pylint: disable=broad-except
      failed += 1
      print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}")
      traceback.print_exc(limit=3)
      continue
    plan = errors.pop("plan")
    ok = all(e <= TOLERANCE[case[6]] for e in errors.values())
    passed += ok
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} {label} [{plan}]: "
          + " ".join(f"{k}={v:.2e}" for k, v in errors.items())
          + f" compile={compile_s:.2f}s")
  print(f"{passed} passed, {failed} failed")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
