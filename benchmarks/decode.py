"""Times decode attention: jflash's split-K kernel against cuDNN, XLA and
JAX's Pallas decode op, side by side, plus the copy bandwidth.

Usage (repo root, GPU machine): PYTHONPATH=. python3 benchmarks/decode.py
One new token per sequence (T=1, or --tokens), bf16, D=128, caches filled
to random lengths between S/2 and S. Per case and implementation: the
median time per call (microseconds) and the K/V bytes of the valid cache
entries read per second (TB/s), next to a device-to-device copy's
bandwidth measured in the same run; jflash dense and paged (page size 64
and 16).
"""

import argparse
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import run as bench
import jflash

# B, S, query heads, kv heads (the table).
CASES = ((1, 32768, 32, 8), (8, 8192, 32, 8), (32, 4096, 32, 8),
         (64, 2048, 32, 32), (16, 16384, 64, 8))
HEAD_DIM = 128


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
  def cudnn(q, k, v, lengths):
    return jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation="cudnn",
        is_causal=num_tokens == 1)

  def xla(q, k, v, lengths):
    return jflash.decode_attention(q, k, v, lengths, implementation="xla")

  def pallas_gqa(q, k, v, lengths):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental.pallas.ops.gpu import decode_attention
    return decode_attention.gqa(q[:, 0], k, v, kv_seq_len=lengths)[:, None]

  def jflash_dense(q, k, v, lengths):
    return jflash.decode_attention(q, k, v, lengths, implementation="triton")

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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=1)
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__)
  bandwidth = copy_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
  rng = np.random.default_rng(0)
  for batch, kv_seq, heads, kv_heads in CASES:
    keys = jax.random.split(jax.random.key(batch * kv_seq), 3)
    q = jax.random.normal(keys[0], (batch, args.tokens, heads, HEAD_DIM),
                          jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, kv_seq, kv_heads, HEAD_DIM),
                          jnp.bfloat16)
    v = jax.random.normal(keys[2], k.shape, jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(kv_seq // 2, kv_seq + 1, batch),
                          jnp.int32)
    kv_bytes = 2 * int(jnp.sum(lengths)) * kv_heads * HEAD_DIM * 2
    row = f"B={batch} S={kv_seq} {heads}/{kv_heads}:"
    impls = implementations(args.tokens)
    for page_size in (64, 16):
      max_pages = kv_seq // page_size
      order = rng.permutation(batch * max_pages)
      table = jnp.asarray(order.reshape(batch, max_pages), jnp.int32)
      k_pages, v_pages = paged(k, page_size, order), paged(v, page_size,
                                                           order)
      impls[f"jflash_paged{page_size}"] = (
          lambda q, k, v, lengths, kp=k_pages, vp=v_pages, t=table:
          jflash.decode_attention(q, kp, vp, lengths, block_table=t,
                                  implementation="triton"))
    for name, fn in impls.items():
      try:
        seconds = median_seconds(jax.jit(fn), (q, k, v, lengths))
        row += (f" {name} {seconds * 1e6:.1f} us "
                f"({kv_bytes / seconds / 1e12:.2f} TB/s);")
      except Exception as e:  # pylint: disable=broad-except
        row += f" {name} error {type(e).__name__}: {str(e)[:80]};"
    print(row)


if __name__ == "__main__":
  main()
