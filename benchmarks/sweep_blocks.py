"""Times jflash tile configurations side by side with cuDNN, in one process.

Usage (repo root, GPU machine):
  PYTHONPATH=. python3 benchmarks/sweep_blocks.py [--shape 1,8192,16,128]

Forward configurations are timed forward-only; backward configurations are
timed as forward+backward with the default forward tiles. Output: one line
per configuration with TFLOP/s and the ratio to cuDNN measured in this run.
"""

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from benchmarks import run as bench
import jflash

# (block_q, block_k, num_warps, num_stages)
FORWARD = [
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
    (128, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3),
    (64, 32, 4, 3), (64, 64, 4, 4),
]
# (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, warps, stages)
BACKWARD = [
    (64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (64, 64, 64, 64, 8, 2),
    (32, 128, 128, 32, 8, 2), (64, 128, 128, 64, 8, 2),
    (64, 128, 128, 64, 8, 3), (128, 128, 128, 128, 8, 2),
    (32, 64, 64, 32, 4, 2), (32, 128, 128, 32, 4, 2),
]


def _configs(size):
  """argparse type: 'a,b,c,d;e,f,g,h' -> [(a, b, c, d), (e, f, g, h)]."""
  def parse(text):
    try:
      configs = [tuple(int(x) for x in part.split(","))
                 for part in text.split(";") if part.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected integers, got {text!r}")
    if not configs or any(len(c) != size for c in configs):
      raise argparse.ArgumentTypeError(
          f"expected ';'-separated groups of {size} integers, got {text!r}")
    return configs
  return parse


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", type=bench.parse_shape,
                      default=bench.parse_shape("1,8192,16,128"))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--passes", choices=("fwd", "bwd", "both"),
                      default="both", help="which tile sweep to run")
  parser.add_argument(
      "--forward", type=_configs(4), default=FORWARD, metavar="Q,K,W,S;...",
      help="forward configurations (block_q,block_k,warps,stages), ';'-"
      "separated; default: the D=128 list above")
  parser.add_argument(
      "--backward", type=_configs(6), default=BACKWARD,
      metavar="QKV,KKV,QDQ,KDQ,W,S;...",
      help="backward configurations (block_q_dkv,block_k_dkv,block_q_dq,"
      "block_k_dq,warps,stages), ';'-separated")
  parser.add_argument("--causal", choices=("no", "yes", "both"),
                      default="both")
  args = parser.parse_args(argv[1:])
  shape = args.shape
  dims = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
  keys = jax.random.split(jax.random.key(0), 4)
  inputs = tuple(jax.random.normal(k, dims, jnp.bfloat16) for k in keys)
  print(jax.devices()[0].device_kind, "shape", shape, flush=True)

  def tflops(attn, is_causal, pass_):
    step = bench.make_step(attn, pass_)
    _, per_call = bench.time_step(step, inputs, 2, args.repeats, args.iters)
    return bench.flops(shape, is_causal, pass_) / per_call / 1e12

  causal_values = {"no": (False,), "yes": (True,), "both": (False, True)}
  for is_causal in causal_values[args.causal]:
    base = jflash.default_block_sizes(
        q_len=shape.seq_len, kv_len=shape.seq_len, head_dim=shape.head_dim,
        dtype=jnp.bfloat16, is_causal=is_causal,
        device_kind=jax.devices()[0].device_kind)
    cudnn = bench.attention_fn("cudnn", is_causal)
    ref = {p: tflops(cudnn, is_causal, p) for p in bench.PASSES}
    print(f"causal={is_causal} cuDNN fwd {ref['fwd']:.0f} fwd+bwd "
          f"{ref['fwd+bwd']:.0f}; default {base}", flush=True)
    configs = []
    if args.passes in ("fwd", "both"):
      configs += [("fwd", dataclasses.replace(
          base, block_q=bq, block_k=bk, num_warps=w, num_stages=s))
                  for bq, bk, w, s in args.forward]
    if args.passes in ("bwd", "both"):
      configs += [("fwd+bwd", dataclasses.replace(
          base, block_q_dkv=a, block_k_dkv=b, block_q_dq=c, block_k_dq=d,
          num_warps_bwd=w, num_stages_bwd=s))
                  for a, b, c, d, w, s in args.backward]
    for pass_, sizes in configs:
      attn = lambda q, k, v, sizes=sizes: jflash.flash_attention(
          q, k, v, is_causal=is_causal, block_sizes=sizes)
      try:
        value = tflops(attn, is_causal, pass_)
        result = f"{value:6.0f} TFLOP/s ({value / ref[pass_]:.2f}x cuDNN)"
      except Exception as e:  # pylint: disable=broad-exception-caught
        result = bench.short_error(e, 120)
      if pass_ == "fwd":
        tiles = (f"fwd {sizes.block_q}x{sizes.block_k} w{sizes.num_warps} "
                 f"s{sizes.num_stages}")
      else:
        tiles = (f"bwd dkv {sizes.block_q_dkv}x{sizes.block_k_dkv} dq "
                 f"{sizes.block_q_dq}x{sizes.block_k_dq} "
                 f"w{sizes.num_warps_bwd} s{sizes.num_stages_bwd}")
      print(f"causal={is_causal} {pass_:8} {tiles:40} {result}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
