"""Times Mosaic GPU forward tiles side by side with cuDNN, in one process.

Usage (repo root, H100/H200):
  PYTHONPATH=. python3 benchmarks/sweep_mosaic.py [--shapes 1,8192,16,128]

One line per (shape, causal, tiles): forward ms, TFLOP/s and the ratio to
cuDNN's forward measured in the same run, plus the compile time.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import run as bench
from jflash._src import api
from jflash._src.backends.mosaic import forward
from jflash._src.backends.mosaic.config import MosaicBlockSizes

# (block_q, block_kv, num_stages)
TILES = [(64, 128, 2), (64, 64, 2), (64, 64, 3), (64, 128, 3), (128, 64, 2),
         (64, 256, 2)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", nargs="+", type=bench.parse_shape,
                      default=[bench.parse_shape(s) for s in (
                          "1,8192,16,128", "4,2048,16,128", "2,4096,16,64",
                          "1,8192,16,256")])
  parser.add_argument("--tiles", nargs="+", default=None,
                      help="block_q,block_kv,stages triples")
  args = parser.parse_args()
  tiles = TILES if args.tiles is None else [
      tuple(int(x) for x in t.split(",")) for t in args.tiles]
  print(jax.devices()[0].device_kind)
  for shape in args.shapes:
    for causal in (False, True):
      q, k, v, _ = bench.random_inputs(jax.random.key(0), shape,
                                       jnp.bfloat16)
      flop = bench.flops(shape, causal, "fwd")
      cudnn = bench.make_step(bench.attention_fn("cudnn", causal), "fwd")
      _, cudnn_s = bench.time_step(cudnn, (q, k, v, None), 3, 5, 10)
      print(f"{shape} causal={causal} cudnn {cudnn_s * 1e3:.3f} ms "
            f"{flop / cudnn_s / 1e12:.0f} TFLOP/s")
      call = api.describe(q, k, v, is_causal=causal)
      for block_q, block_kv, stages in tiles:
        try:
          sizes = MosaicBlockSizes(block_q, block_kv, stages)
          if sizes.smem_bytes(shape.head_dim, 2) > 227 * 1024:
            continue
          step = jax.jit(functools.partial(
              forward.forward_call, q_lengths=None, kv_lengths=None,
              spec=call.spec, block_sizes=sizes))
          first, per_call = bench.time_step(
              lambda q, k, v, _: step(q, k, v), (q, k, v, None), 3, 5, 10)
          print(f"  {block_q}x{block_kv} s{stages}: {per_call * 1e3:.3f} ms"
                f" {flop / per_call / 1e12:.0f} TFLOP/s "
                f"{cudnn_s / per_call:.2f}x cuDNN (first call {first:.1f} s)")
        except Exception as e:  # pylint: disable=broad-except
          print(f"  {block_q}x{block_kv} s{stages}: {bench.short_error(e)}")


if __name__ == "__main__":
  main()
