"""Context parallelism on several GPUs: jflash.ring_attention, measured.

For each device count d (default: all local devices), total sequence
length T (default 32k ... 512k), strategy (ring, all_gather) and layout
(balanced, contiguous), times forward+backward (`jax.grad` of
sum(out * cotangent) w.r.t. q, k, v; --passes fwd adds the forward alone)
of `jflash.ring_attention` on a 1-D mesh "context" of the first d devices,
inputs sharded along the sequence, and reports:

- ms: median per call (fresh random inputs before each timed call, made
  on the devices, outside the timed region; --warmup untimed calls first;
  every call waited for with block_until_ready);
- tokens/s: B x T / time (the whole sequence, all devices);
- TFLOP/s per GPU: causal forward FLOPs 0.5 x 4 B H T^2 D (not causal:
  4 B H T^2 D), x3.5 for forward+backward (the backward is 2.5x the
  forward, as benchmarks/run.py counts), divided by time and by d;
- vs 1 GPU: that per-GPU TFLOP/s over single-GPU `flash_attention`'s
  TFLOP/s at the same per-GPU length T/d (measured here on device 0, same
  heads, dtype and mask): the issue's target is >= 0.9 at 8 GPUs;
- MiB/dev: the compiled program's arguments + outputs + temporaries per
  device (XLA memory analysis of the SPMD program), and the allocator's
  peak so far (`peak_mib`, in the JSON);
- with --exposed-comm, "ring (no comm)" rows: the same ring program with
  every ppermute replaced by the identity (each device computes the same
  blocks on its own shard); exposed communication = ring ms - no-comm ms.

Defaults: B=1, H=16 (kv heads 16), D=128, bfloat16, causal. Run with the
latency-hiding scheduler, e.g.

  XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \\
      PYTHONPATH=. python3 benchmarks/ring.py --json ring.json
  PYTHONPATH=. python3 benchmarks/ring.py --devices 2 4 8 \\
      --lengths 32768 131072 --strategies ring --exposed-comm

and, to time what `jflash.ring_compiler_options()` gives (the scheduler
may keep 4 collectives in flight, not 1: RECORD 2026-11-26, 4 H100s),

  ... benchmarks/ring.py --compiler-option \\
      xla_gpu_experimental_parallel_collective_overlap_limit=4

A case that fails (e.g. out of memory) prints its error in its row and the
run goes on. Off a GPU the script exits unless --tiny or --allow-cpu:

  PYTHONPATH=. python3 benchmarks/ring.py --tiny --cpu-devices 4

(--tiny: T = 256, 2 heads of 32, float32, the XLA path per block, one
repeat; --cpu-devices N fakes N CPU devices.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence
from unittest import mock

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from jflash._src import ring_loop

AXIS = "context"
MIB = 2**20
DEFAULT_LENGTHS = (32768, 65536, 131072, 262144, 524288)
# Forward+backward FLOPs per forward FLOP: the backward does 2.5x the
# forward's matmul work (benchmarks/run.py, FlashAttention-2's convention).
FWD_BWD_FACTOR = 3.5


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="\n".join(__doc__.splitlines()[2:]))
  parser.add_argument("--devices", type=int, nargs="+",
                      help="device counts d (meshes of the first d "
                      "devices); default: all local devices")
  parser.add_argument("--lengths", type=int, nargs="+",
                      help=f"total sequence lengths T; default "
                      f"{' '.join(map(str, DEFAULT_LENGTHS))}")
  parser.add_argument("--strategies", nargs="+",
                      choices=("ring", "all_gather"),
                      default=["ring", "all_gather"])
  parser.add_argument("--layouts", nargs="+",
                      choices=("balanced", "contiguous"),
                      default=["balanced", "contiguous"])
  parser.add_argument("--passes", nargs="+", choices=("fwd", "fwd+bwd"),
                      default=["fwd+bwd"])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int,
                      help="key/value heads (GQA); default: --heads")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16",
                      choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--causal", action=argparse.BooleanOptionalAction,
                      default=True)
  parser.add_argument("--implementation",
                      help="backend of every block (default: jflash's "
                      "choice per pass)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no-baseline", action="store_true",
                      help="skip single-GPU flash_attention at T/d")
  parser.add_argument("--exposed-comm", action="store_true",
                      help="also time the ring with its transfers removed")
  parser.add_argument("--compiler-option", type=parse_compiler_option,
                      action="append", default=[], metavar="NAME=VALUE",
                      help="an XLA option for the ring's jitted steps "
                           "(repeatable), e.g. xla_gpu_experimental_"
                           "parallel_collective_overlap_limit=4")
  parser.add_argument("--json", help="write the rows and metadata here")
  parser.add_argument("--tiny", action="store_true",
                      help="tiny CPU-sized run (a smoke test)")
  parser.add_argument("--cpu-devices", type=int, default=0,
                      help="fake N CPU devices (set before JAX starts)")
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run off a GPU (slow; the XLA path per block)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.lengths = args.lengths or [256]
    args.heads, args.head_dim, args.dtype = 2, 32, "float32"
    args.warmup, args.repeats = 1, 1
    args.implementation = args.implementation or "xla"
  args.lengths = args.lengths or list(DEFAULT_LENGTHS)
  args.kv_heads = args.kv_heads or args.heads
  return args


def attention_flops(batch, heads, seq, head_dim, is_causal, pass_) -> float:
  """Matmul FLOPs of attention over `seq` tokens (query heads count)."""
  flops = 4.0 * batch * heads * seq**2 * head_dim
  flops *= 0.5 if is_causal else 1.0
  return flops * (FWD_BWD_FACTOR if pass_ == "fwd+bwd" else 1.0)


def make_step(attention, pass_, compiler_options=None):
  """jit of the forward, or of the gradients w.r.t. q, k, v (compiled with
  XLA `compiler_options`, e.g. the scheduler's, if given)."""
  jit = functools.partial(jax.jit, compiler_options=compiler_options or None)
  if pass_ == "fwd":
    return jit(lambda q, k, v, ct: attention(q, k, v))

  def loss(q, k, v, ct):
    return jnp.sum(attention(q, k, v).astype(jnp.float32)
                   * ct.astype(jnp.float32))

  return jit(jax.grad(loss, argnums=(0, 1, 2)))


def parse_compiler_option(text: str) -> tuple[str, Any]:
  """`NAME=VALUE` of --compiler-option: VALUE an int, true/false or text."""
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  try:
    return name, int(value)
  except ValueError:
    return name, value


def make_inputs(args, seq, sharding):
  """A function of a seed: fresh random (q, k, v, cotangent), made on the
  devices with `sharding` (no host transfer of the large arrays)."""
  dtype = jnp.dtype(args.dtype)
  q_shape = (args.batch, seq, args.heads, args.head_dim)
  kv_shape = (args.batch, seq, args.kv_heads, args.head_dim)

  @functools.partial(jax.jit, out_shardings=(sharding,) * 4)
  def inputs(seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in
                 zip(keys, (q_shape, kv_shape, kv_shape, q_shape)))

  return inputs


def time_case(step, inputs, args) -> tuple[float, int | None]:
  """(median seconds per call, compiled bytes per device or None)."""
  seed = iter(range(1, 1 << 30))
  first = inputs(0)
  compiled = step.lower(*first).compile()
  stats = compiled.memory_analysis()
  program_bytes = None if stats is None else (
      stats.argument_size_in_bytes + stats.output_size_in_bytes
      - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  jax.block_until_ready(compiled(*first))
  del first
  for _ in range(args.warmup):
    jax.block_until_ready(compiled(*inputs(next(seed))))
  times = []
  for _ in range(args.repeats):
    fresh = jax.block_until_ready(inputs(next(seed)))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*fresh))
    times.append(time.perf_counter() - start)
    del fresh
  return statistics.median(times), program_bytes


@contextlib.contextmanager
def no_communication():
  """Every ring transfer becomes the identity (see --exposed-comm)."""
  with mock.patch.object(ring_loop.Ring, "rotate",
                         lambda self, tree: tree):
    yield


def peak_mib(devices) -> float | None:
  peaks = []
  for device in devices:
    try:
      stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-exception-caught
      stats = {}
    if "peak_bytes_in_use" in stats:
      peaks.append(stats["peak_bytes_in_use"])
  return max(peaks) / MIB if peaks else None


def short_error(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  return text[:160]


def run_case(args, *, devices, seq, strategy, layout, pass_, comm=True):
  """One row; never raises (errors go into the row)."""
  num = len(devices)
  name = strategy if comm else "ring (no comm)"
  row = dict(devices=num, seq_len=seq, per_device=seq // num,
             strategy=name, layout=layout, pass_=pass_, seconds=None,
             error=None)
  try:
    mesh = jax.make_mesh((num,), (AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
    attention = functools.partial(
        jflash.ring_attention, mesh=mesh, axis_name=AXIS,
        is_causal=args.causal, layout=layout, strategy=strategy,
        implementation=args.implementation)
    inputs = make_inputs(args, seq, NamedSharding(mesh, P(None, AXIS)))
    with contextlib.nullcontext() if comm else no_communication():
      seconds, program_bytes = time_case(
          make_step(attention, pass_, dict(args.compiler_option)),
                                         inputs, args)
    flops = attention_flops(args.batch, args.heads, seq, args.head_dim,
                            args.causal, pass_)
    row.update(seconds=seconds, tokens_per_s=args.batch * seq / seconds,
               tflops_per_device=flops / seconds / num / 1e12,
               mib_per_device=None if program_bytes is None
               else program_bytes / MIB, peak_mib=peak_mib(devices))
  except Exception as e:  # pylint: disable=broad-exception-caught
    row["error"] = short_error(e)
  return row


def run_baseline(args, *, seq, pass_, device):
  """Single-device flash_attention over `seq` tokens."""
  row = dict(devices=1, seq_len=seq, per_device=seq,
             strategy="flash_attention (1 GPU)", layout="-", pass_=pass_,
             seconds=None, error=None)
  try:
    attention = functools.partial(jflash.flash_attention,
                                  is_causal=args.causal,
                                  implementation=args.implementation)
    inputs = make_inputs(args, seq, jax.sharding.SingleDeviceSharding(
        device))
    seconds, program_bytes = time_case(make_step(attention, pass_), inputs,
                                       args)
    flops = attention_flops(args.batch, args.heads, seq, args.head_dim,
                            args.causal, pass_)
    row.update(seconds=seconds, tokens_per_s=args.batch * seq / seconds,
               tflops_per_device=flops / seconds / 1e12,
               mib_per_device=None if program_bytes is None
               else program_bytes / MIB, peak_mib=peak_mib([device]))
  except Exception as e:  # pylint: disable=broad-exception-caught
    row["error"] = short_error(e)
  return row


HEADER = (f"{'d':>2} {'T':>7} {'T/d':>7} {'strategy':<24} {'layout':<10} "
          f"{'pass':<7} {'ms':>9} {'tokens/s':>11} {'TFLOP/s/GPU':>11} "
          f"{'vs 1 GPU':>8} {'MiB/dev':>8}")


def format_row(row) -> str:
  head = (f"{row['devices']:>2} {row['seq_len']:>7} {row['per_device']:>7} "
          f"{row['strategy']:<24} {row['layout']:<10} {row['pass_']:<7}")
  if row["error"]:
    return f"{head} error: {row['error']}"
  ratio = row.get("vs_1_gpu")
  memory = row.get("mib_per_device")
  return (f"{head} {row['seconds'] * 1e3:>9.2f} {row['tokens_per_s']:>11,.0f} "
          f"{row['tflops_per_device']:>11.1f} "
          f"{'-' if ratio is None else f'{ratio:.2f}':>8} "
          f"{'-' if memory is None else f'{memory:.0f}':>8}")


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = parse_args(argv)
  if args.cpu_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if jax.default_backend() != "gpu" and not (args.tiny or args.allow_cpu):
    sys.exit("No GPU: pass --tiny (or --allow-cpu) to run on the CPU.")
  all_devices = jax.devices()
  counts = args.devices or [len(all_devices)]
  for count in counts:
    if count > len(all_devices):
      sys.exit(f"--devices {count}: only {len(all_devices)} devices here.")
  print(f"{len(all_devices)} x {all_devices[0].device_kind}; B={args.batch} "
        f"H={args.heads} K={args.kv_heads} D={args.head_dim} {args.dtype} "
        f"causal={args.causal}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"
        + (f"; compiler options {dict(args.compiler_option)}"
           if args.compiler_option else ""))
  print(HEADER)
  rows, baselines = [], {}
  for count in counts:
    devices = all_devices[:count]
    for seq in args.lengths:
      if seq % (2 * count):
        print(f"T={seq} is not divisible by 2 x {count}: skipped")
        continue
      for pass_ in args.passes:
        key = (seq // count, pass_)
        if not args.no_baseline and key not in baselines:
          baselines[key] = run_baseline(args, seq=seq // count,
                                        pass_=pass_, device=all_devices[0])
          rows.append(baselines[key])
          print(format_row(baselines[key]), flush=True)
        cases = [(s, layout, True) for s in args.strategies
                 for layout in args.layouts]
        if args.exposed_comm and "ring" in args.strategies:
          cases += [("ring", layout, False) for layout in args.layouts]
        for strategy, layout, comm in cases:
          row = run_case(args, devices=devices, seq=seq, strategy=strategy,
                         layout=layout, pass_=pass_, comm=comm)
          baseline = baselines.get(key)
          if (baseline and not baseline["error"] and not row["error"]):
            row["vs_1_gpu"] = (row["tflops_per_device"]
                               / baseline["tflops_per_device"])
          rows.append(row)
          print(format_row(row), flush=True)
  if args.json:
    meta = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device_kind=all_devices[0].device_kind, device_count=len(all_devices),
        jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
        compiler_options=dict(args.compiler_option),
        argv=sys.argv[1:] if argv is None else list(argv),
        fwd_bwd_factor=FWD_BWD_FACTOR)
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.json}")
  return rows


if __name__ == "__main__":
  main()
