"""Does attention under a sparse mask cost in proportion to the tiles visited?

For local windows (and packed sequences, when jflash has segment ids), times
jflash's forward and forward+backward at one shape, counts the key tiles the
forward visits (from the same tile arithmetic as the kernels' loop bounds,
recomputed here in NumPy), and prints time per visited tile relative to
plain causal attention. Proportional cost means that ratio stays near 1.
cuDNN is timed in the same run where it has the option (windows).

Usage, from the repository root on the GPU machine:

  PYTHONPATH=. python3 benchmarks/masked_cost.py [--shape 1,8192,16,128] \
      [--implementation mosaic]
"""

import argparse
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import run as bench
import jflash


def visited_tiles(n: int, block_q: int, block_k: int, visible) -> int:
  """Key tiles (summed over query tiles) that contain a visible entry.

  `visible(rows, cols)` is the element mask as NumPy booleans. The kernels'
  loop bounds visit a contiguous tile range per query tile; for the masks
  here (bands and block-diagonal) that range is exactly the set of tiles
  with a visible entry.
  """
  rows = np.arange(n)[:, None]
  cols = np.arange(n)[None, :]
  mask = visible(rows, cols)
  nq, nk = -(-n // block_q), -(-n // block_k)
  padded = np.zeros((nq * block_q, nk * block_k), bool)
  padded[:n, :n] = mask
  tiles = padded.reshape(nq, block_q, nk, block_k).any(axis=(1, 3))
  return int(tiles.sum())


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--shape", type=bench.parse_shape,
                      default=bench.parse_shape("1,8192,16,128"))
  parser.add_argument("--implementation", default=None,
                      help="flash_attention's implementation (default: "
                           "the registry's choice)")
  args = parser.parse_args(argv[1:])
  shape = args.shape
  n = shape.seq_len
  dims = (shape.batch, n, shape.num_heads, shape.head_dim)
  keys = jax.random.split(jax.random.key(1), 4)
  inputs = tuple(jax.random.normal(k, dims, jnp.bfloat16) for k in keys)
  sizes = jflash.default_block_sizes(
      q_len=n, kv_len=n, head_dim=shape.head_dim, dtype=jnp.bfloat16,
      is_causal=True, device_kind=jax.devices()[0].device_kind)
  has_segments = "q_segment_ids" in inspect.signature(
      jflash.flash_attention).parameters
  print(jax.devices()[0].device_kind, "shape", shape, "implementation",
        args.implementation, "tiles (Triton's, for the counts)",
        f"{sizes.block_q}x{sizes.block_k}", flush=True)

  cases = [("causal", {}, lambda r, c: c <= r)]
  for window in (256, 1024, 4096):
    cases.append((f"causal, window {window}",
                  {"local_window_size": (window, 0)},
                  lambda r, c, w=window: (c <= r) & (c >= r - w)))
  if has_segments:
    for length in (512, 2048):
      ids = np.arange(n) // length
      seg = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (shape.batch, n))
      cases.append((f"causal, packed {length}",
                    {"q_segment_ids": seg, "kv_segment_ids": seg},
                    lambda r, c, ids=ids: (c <= r) & (ids[r] == ids[c])))

  base = None
  print(f"{'case':24} {'pass':8} {'tiles':>7} {'jflash ms':>10} "
        f"{'ms/tile vs causal':>18} {'cuDNN ms':>9}")
  for name, options, visible in cases:
    tiles = visited_tiles(n, sizes.block_q, sizes.block_k, visible)
    for pass_ in bench.PASSES:
      step = bench.make_step(
          lambda q, k, v, o=options: jflash.flash_attention(
              q, k, v, is_causal=True, implementation=args.implementation,
              **o), pass_)
      _, ms = bench.time_step(step, inputs, 2, 5, 10)
      ms *= 1e3
      cudnn = "-"
      if "q_segment_ids" not in options:
        window = options.get("local_window_size")
        ref = bench.make_step(
            lambda q, k, v, w=window: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, local_window_size=w,
                implementation="cudnn"), pass_)
        try:
          cudnn = f"{bench.time_step(ref, inputs, 2, 5, 10)[1] * 1e3:.3f}"
        except Exception as e:  # pylint: disable=broad-exception-caught
          cudnn = bench.short_error(e, 40)
      if name == "causal":
        base = base or {}
        base[pass_] = ms / tiles
      print(f"{name:24} {pass_:8} {tiles:7d} {ms:10.3f} "
            f"{ms / tiles / base[pass_]:18.2f} {cudnn:>9}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
