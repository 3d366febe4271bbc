"""Times Mosaic GPU tiles side by side with cuDNN, in one process.

Usage (repo root, H100/H200):
  PYTHONPATH=. python3 benchmarks/sweep_mosaic.py [--shapes 1,8192,16,128]
  PYTHONPATH=. python3 benchmarks/sweep_mosaic.py --backward

One line per (shape, causal, tiles): forward ms, TFLOP/s and the ratio to
cuDNN's forward measured in the same run, plus the compile time. With
--backward: forward+backward through `jflash.flash_attention(...,
block_sizes=MosaicBlockSizes(...))` with the default forward tiles and each
candidate's backward tiles (BACKWARD_TILES), against cuDNN's forward+
backward. With --ab ping_pong|q_prefetch|k_wait|softmax_barrier: each
forward tiling under the variants of AB_VARIANTS (forward.py's module
switches: the consumers' ping-pong on an mbarrier rendezvous or named
barriers; the persistent kernel's Q prefetch off or on; each step's wait
for the next K tile after or under its P V; the 16-bit softmax's
optimization barrier off or on), timed in interleaved rounds (each call
right after each other one equally often: `run.round_orders`), cuDNN in
each round too; medians over the rounds.
"""

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp

from benchmarks import run as bench
from jflash._src import api
from jflash._src.backends.mosaic import forward
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.spec import Operands

# (block_q, block_kv, num_stages)
TILES = [(64, 128, 2), (64, 64, 2), (64, 64, 3), (64, 128, 3), (128, 64, 2),
         (64, 256, 2)]
# (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv, backward_stages);
# the first is the reference the others are compared with (D=128's
# default: config.default_block_sizes).
BACKWARD_TILES = [(64, 64, 64, 64, 2), (64, 64, 64, 64, 3),
                  (64, 64, 64, 64, 4), (64, 128, 64, 64, 3),
                  (64, 128, 64, 64, 2), (64, 64, 128, 64, 2),
                  (64, 128, 128, 64, 2), (64, 64, 64, 128, 2)]


def sweep_backward(shapes, tilings=None):
  """fwd+bwd per backward tiling (default: BACKWARD_TILES, the first one
  the reference), as a ratio to cuDNN and to the first tiling."""
  # pylint: disable-next=g-import-not-at-top
  import jflash
  for shape in shapes:
    for causal in (False, True):
      q, k, v, ct = bench.random_inputs(jax.random.key(0), shape,
                                        jnp.bfloat16)
      flop = bench.flops(shape, causal, "fwd+bwd")
      cudnn = bench.make_step(bench.attention_fn("cudnn", causal),
                              "fwd+bwd")
      _, cudnn_s = bench.time_step(cudnn, (q, k, v, ct), 2, 5, 5)
      print(f"{shape} causal={causal} fwd+bwd cudnn {cudnn_s * 1e3:.3f} ms "
            f"{flop / cudnn_s / 1e12:.0f} TFLOP/s")
      reference = None
      for tiles in tilings or BACKWARD_TILES:
        name = "dq {}x{} dkv {}x{} s{}".format(*tiles)
        try:
          sizes = MosaicBlockSizes(
              block_q_dq=tiles[0], block_kv_dq=tiles[1],
              block_q_dkv=tiles[2], block_kv_dkv=tiles[3],
              backward_stages=tiles[4])
          sizes.check_fits(shape.head_dim, 2)
          attn = functools.partial(jflash.flash_attention, is_causal=causal,
                                   implementation="mosaic",
                                   block_sizes=sizes)
          step = bench.make_step(attn, "fwd+bwd")
          first, per_call = bench.time_step(step, (q, k, v, ct), 2, 5, 5)
          reference = reference or per_call
          print(f"  {name}: {per_call * 1e3:.3f} ms "
                f"{flop / per_call / 1e12:.0f} TFLOP/s "
                f"{cudnn_s / per_call:.2f}x cuDNN, "
                f"{reference / per_call:.2f}x the first "
                f"(first call {first:.1f} s)")
        except Exception as e:  # pylint: disable=broad-except
          print(f"  {name}: {bench.short_error(e)}")


# --ab: the module switches of forward.py each variant sets (the first
# variant is the reference of the ratios).
AB_VARIANTS = {
    "ping_pong": {"mbarrier": {"PING_PONG": "mbarrier"},
                  "named": {"PING_PONG": "named"}},
    "q_prefetch": {"no_prefetch": {"Q_PREFETCH": False},
                   "prefetch": {"Q_PREFETCH": True}},
    "k_wait": {"after_pv": {"K_WAIT_UNDER_PV": False},
               "under_pv": {"K_WAIT_UNDER_PV": True}},
    "softmax_barrier": {"no_barrier": {"SOFTMAX_BARRIER_16BIT": False},
                        "barrier": {"SOFTMAX_BARRIER_16BIT": True}},
}


def variants_ab(shape, causal, sizes, persistent, rounds, variants):
  """The forward under each variant (forward.py module switches, see
  AB_VARIANTS) and cuDNN in interleaved rounds (`bench.round_orders`):
  median TFLOP/s per variant, each / the first variant, and each / cuDNN."""
  q, k, v, _ = bench.random_inputs(jax.random.key(0), shape, jnp.bfloat16)
  flop = bench.flops(shape, causal, "fwd")
  call = api.describe(q, k, v, is_causal=causal)
  steps = {"cudnn": bench.make_step(bench.attention_fn("cudnn", causal),
                                    "fwd")}
  for name, switches in variants.items():
    saved = {key: getattr(forward, key) for key in switches}
    for key, value in switches.items():
      setattr(forward, key, value)
    fn = jax.jit(functools.partial(forward.forward_call, spec=call.spec,
                                   block_sizes=sizes, persistent=persistent))
    steps[name] = lambda q, k, v, _, fn=fn: fn(Operands(q, k, v))
    # Traced and compiled now, with the switches set.
    bench.time_step(steps[name], (q, k, v, None), 1, 1, 1)
    for key, value in saved.items():
      setattr(forward, key, value)
  times = {name: [] for name in steps}
  for order in bench.round_orders(list(steps), rounds):
    for name in order:
      times[name].append(
          bench.time_step(steps[name], (q, k, v, None), 2, 5, 10)[1])
  tflops = {name: flop / statistics.median(t) / 1e12
            for name, t in times.items()}
  first = next(iter(variants))
  ratios = [f"{name}/{first} {tflops[name] / tflops[first]:.3f}"
            for name in variants if name != first]
  ratios += [f"{name}/cuDNN {tflops[name] / tflops['cudnn']:.3f}"
             for name in variants]
  print(f"{shape} causal={causal} {sizes.block_q}x{sizes.block_kv} "
        f"s{sizes.num_stages}: " + " ".join(
            f"{name} {value:.0f}" for name, value in tflops.items())
        + " TFLOP/s; " + ", ".join(ratios), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", nargs="+", type=bench.parse_shape,
                      default=[bench.parse_shape(s) for s in (
                          "1,8192,16,128", "4,2048,16,128", "2,4096,16,64",
                          "1,8192,16,256")])
  parser.add_argument("--tiles", nargs="+", default=None,
                      help="block_q,block_kv,stages triples")
  parser.add_argument("--backward", action="store_true",
                      help="sweep the backward tiles (BACKWARD_TILES)")
  parser.add_argument("--backward-tiles", nargs="+", default=None,
                      help="with --backward: block_q_dq,block_kv_dq,"
                           "block_q_dkv,block_kv_dkv,stages tuples (the "
                           "first is the reference)")
  parser.add_argument("--persistent", choices=("auto", "on", "off"),
                      default="auto",
                      help="forward: the persistent kernel where allowed "
                           "(auto), or forced on/off")
  parser.add_argument("--ab", choices=sorted(AB_VARIANTS), default=None,
                      help="forward: the variants of AB_VARIANTS[AB] in "
                           "interleaved rounds, cuDNN beside")
  parser.add_argument("--rounds", type=int, default=6,
                      help="with --ab: interleaved rounds (a multiple of "
                           "len(run.balanced_orders(calls)) balances them)")
  args = parser.parse_args()
  persistent = {"auto": None, "on": True, "off": False}[args.persistent]
  if args.backward:
    print(jax.devices()[0].device_kind)
    sweep_backward(args.shapes, args.backward_tiles and [
        tuple(int(x) for x in t.split(",")) for t in args.backward_tiles])
    return
  tiles = TILES if args.tiles is None else [
      tuple(int(x) for x in t.split(",")) for t in args.tiles]
  if args.ab:
    print(jax.devices()[0].device_kind, f"A/B {args.ab}, persistent:",
          args.persistent)
    for shape in args.shapes:
      for causal in (False, True):
        for tile in tiles:
          variants_ab(shape, causal, MosaicBlockSizes(*tile), persistent,
                      args.rounds, AB_VARIANTS[args.ab])
    return
  print(jax.devices()[0].device_kind, "persistent:", args.persistent)
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
              forward.forward_call, spec=call.spec, block_sizes=sizes,
              persistent=persistent))
          first, per_call = bench.time_step(
              lambda q, k, v, _: step(Operands(q, k, v)), (q, k, v, None),
              3, 5, 10)
          print(f"  {block_q}x{block_kv} s{stages}: {per_call * 1e3:.3f} ms"
                f" {flop / per_call / 1e12:.0f} TFLOP/s "
                f"{cudnn_s / per_call:.2f}x cuDNN (first call {first:.1f} s)")
        except Exception as e:  # pylint: disable=broad-except
          print(f"  {block_q}x{block_kv} s{stages}: {bench.short_error(e)}")


if __name__ == "__main__":
  main()
