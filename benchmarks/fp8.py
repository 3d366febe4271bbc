"""The Mosaic FP8 forward on a Hopper GPU: correctness and speed.

Usage (repo root, H100/H200):
  PYTHONPATH=. python3 benchmarks/fp8.py check [--json F]
  PYTHONPATH=. python3 benchmarks/fp8.py time [--json F] [--quick]
      [--time-rounds R]
  PYTHONPATH=. python3 benchmarks/fp8.py accuracy [--json F]
  PYTHONPATH=. python3 benchmarks/fp8.py sweep [--json F]
  PYTHONPATH=. python3 benchmarks/fp8.py prefetch_ab [--rounds R] [--json F]
  PYTHONPATH=. python3 benchmarks/fp8.py k_wait_ab [--rounds R] [--json F]
  PYTHONPATH=. python3 benchmarks/fp8.py barrier_ab [--rounds R] [--json F]

check: per case (head dims 64/128/256, masks, GQA, ragged lengths, sinks,
  soft cap, tiles), the kernel against the exact XLA model of its
  arithmetic (tests/mosaic_fp8_model.py: relative error should be ~1e-3 or
  less, the float32 sums' order aside) and against float32 attention on the
  dequantized inputs (the error FP8's rounding of P costs, ~0.02-0.03);
  every output finite; lse against the model. Exit status 1 on a FAIL.
time: B=1, 16 heads, 16k tokens (FlashAttention-3's FP8 setting), D = 64,
  128, 256 non-causal and D=128 causal: the FP8 kernel for several tiles,
  timed from e4m3 q/k/v and descales as a user passes them (V's transpose
  included), beside cuDNN bf16 and jflash bf16 in the same process, the
  five calls of a row in --time-rounds interleaved rounds in the balanced
  order (`run.round_orders`). TFLOP/s = 4 B N T S D / time (x 1/2 causal).
  Medians of fresh inputs.
sweep: as time, the default tiles with and without the softmax's
  optimization barrier (forward.FP8_SOFTMAX_BARRIER), persistent or not.
prefetch_ab: as time, the default FP8 tiles with the persistent kernel's Q
  prefetch on and off (forward.FP8_Q_PREFETCH_HEAD_DIMS patched to hold
  the head dim or not), and cuDNN bf16, in R
  interleaved rounds (medians of the rounds' times; each call right after
  each other one equally often, `run.round_orders`): the one switch's
  effect, clear of the run-to-run spread of separate runs.
k_wait_ab: as prefetch_ab, each step's wait for the next K tile after its
  P V product and under it (forward.K_WAIT_UNDER_PV False / True), and
  the head dim's default (`forward.waits_for_k_under_pv`) in each row.
barrier_ab: as prefetch_ab, the softmax's optimization barrier
  (forward.FP8_SOFTMAX_BARRIER) on and off.
accuracy: FlashAttention-3's recipe (standard normal q/k/v, 0.1% of the
  entries x10), B=2, 4096 tokens, 16 heads, D = 64/128/256, through
  jflash.flash_attention: relative RMS error against float32 attention on
  the unquantized inputs with one descale per tensor, per (batch, kv
  head) (`jflash.quantize_qkv`), and with its Hadamard rotation; and on
  plain standard normal inputs the kernel's own error (against float32
  attention on the dequantized inputs).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from benchmarks import run
from jflash._src.backends import xla
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic import forward
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.spec import Operands
from jflash._src.spec import describe_call
from tests import mosaic_fp8_model

E4M3_MAX = 448.0
FP8 = jnp.float8_e4m3fn


def quantize(x, num_kv_heads: int):
  """Per (batch, kv head) e4m3 quantization of x [B, L, heads, H]: (x8,
  descale [B, K]) (`jflash.quantize_fp8`; query heads in kv-head
  groups)."""
  return jflash.quantize_fp8(x, num_groups=num_kv_heads)


def fp8_call(q8, k8, v8, descales, *, block_sizes, sinks=None, q_lengths=None,
             kv_lengths=None, segment_ids=None, persistent=None, **options):
  """The kernel through forward_call (out, lse2)."""
  operands = Operands(
      q8, k8, v8, q_lengths=q_lengths, kv_lengths=kv_lengths, sinks=sinks,
      q_segment_ids=None if segment_ids is None else segment_ids[0],
      kv_segment_ids=None if segment_ids is None else segment_ids[1],
      q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
  spec = describe_call(operands, scale=q8.shape[-1] ** -0.5, **options)
  return forward.forward_call(operands, spec=spec, block_sizes=block_sizes,
                              persistent=persistent)


def relative(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


# B, T, S, N, K, D, tiles (block_kv, stages), options
CASES = [
    (1, 512, 512, 4, 4, 128, (128, 2), {}),
    (1, 512, 512, 4, 4, 128, (256, 2), {}),
    (2, 384, 640, 4, 2, 128, (128, 2), dict(is_causal=True)),
    (2, 384, 640, 4, 2, 128, (128, 3), dict(is_causal=True,
                                            bottom_right=True)),
    (1, 256, 512, 4, 4, 64, (128, 2), {}),
    (1, 300, 700, 4, 1, 64, (256, 2), dict(is_causal=True)),
    (1, 256, 512, 2, 2, 256, (64, 2), {}),
    (1, 256, 512, 2, 2, 256, (128, 2), dict(is_causal=True)),
    (1, 256, 512, 2, 2, 256, (128, 2), {}),
    (2, 384, 384, 4, 2, 256, (64, 2), dict(segments=True, is_causal=True)),
    (2, 384, 640, 4, 2, 128, (256, 2), dict(is_causal=True)),
    (2, 320, 448, 4, 2, 128, (128, 2), dict(lengths=True, is_causal=True)),
    (2, 256, 256, 4, 2, 128, (128, 2), dict(sinks=True, lengths=True)),
    (2, 512, 512, 4, 4, 128, (128, 2), dict(soft_cap=20.0)),
    (2, 512, 512, 4, 4, 128, (128, 2), dict(window=(100, 0),
                                            is_causal=True)),
    (2, 640, 640, 4, 2, 128, (128, 2), dict(segments=True,
                                            is_causal=True)),
    (1, 17, 33, 2, 2, 128, (128, 2), {}),
]


def check(args) -> int:
  rows, failures = [], 0
  rng = np.random.default_rng(0)
  for b, t, s, n, kh, d, (block_kv, stages), options in CASES:
    name = f"B{b} T{t} S{s} N{n}/{kh} D{d} kv{block_kv}x{stages} {options}"
    try:
      q, k, v = (jnp.asarray(rng.standard_normal((b, l, h, d), np.float32))
                 for l, h in ((t, n), (s, kh), (s, kh)))
      (q8, qd), (k8, kd), (v8, vd) = (quantize(x, kh) for x in (q, k, v))
      extra = {}
      if options.get("lengths"):
        extra["q_lengths"] = jnp.asarray([t, t // 3][:b], jnp.int32)
        extra["kv_lengths"] = jnp.asarray([s - 7, 0][:b], jnp.int32)
      if options.get("sinks"):
        extra["sinks"] = jnp.asarray(rng.standard_normal((b, n)),
                                     jnp.float32)
      if options.get("segments"):
        ids = jnp.asarray(np.arange(t)[None].repeat(b, 0) // 96, jnp.int32)
        extra["segment_ids"] = (ids, ids)
      mask = dict(is_causal=options.get("is_causal", False),
                  bottom_right=options.get("bottom_right", False),
                  window=options.get("window"))
      soft_cap = options.get("soft_cap")
      block_sizes = MosaicBlockSizes(block_kv=block_kv, num_stages=stages)
      kernel = jax.jit(functools.partial(
          fp8_call, block_sizes=block_sizes, logits_soft_cap=soft_cap,
          **mask))
      out, lse2 = kernel(q8, k8, v8, (qd, kd, vd), **extra)
      model_out, model_lse2 = mosaic_fp8_model.fp8_forward_model(
          q8, k8, v8, (qd, kd, vd), scale=d ** -0.5, block_kv=block_kv,
          soft_cap=soft_cap, sinks=extra.get("sinks"),
          q_lengths=extra.get("q_lengths"),
          kv_lengths=extra.get("kv_lengths"),
          segment_ids=extra.get("segment_ids"), **mask)
      deq = [jflash.dequantize_fp8(x8, ds)
             for x8, ds in ((q8, qd), (k8, kd), (v8, vd))]
      full = lambda m: jnp.full((b,), m, jnp.int32)
      reference = xla.attention_reference(
          *deq, extra.get("q_lengths", full(t)),
          extra.get("kv_lengths", full(s)), scale=d ** -0.5,
          logits_soft_cap=soft_cap, sinks=extra.get("sinks"),
          segment_ids=extra.get("segment_ids"), **mask)
      finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
      lse2 = lse2[..., :t]
      seen = np.isfinite(np.asarray(model_lse2))
      row = dict(case=name, finite=finite,
                 vs_model=relative(out, model_out),
                 vs_f32=relative(out, reference),
                 model_vs_f32=relative(model_out, reference),
                 lse_max_abs=float(np.max(np.abs(
                     np.asarray(lse2)[seen] - np.asarray(model_lse2)[seen]),
                     initial=0.0)),
                 lse_inf_agree=bool(np.array_equal(
                     np.isinf(np.asarray(lse2)), ~seen)))
      row["ok"] = (finite and row["vs_model"] < 1e-2 and row["vs_f32"] < 0.04
                   and row["lse_max_abs"] < 1e-2 and row["lse_inf_agree"])
    except Exception as e:  # noqa: BLE001 - report every case
      row = dict(case=name, ok=False, error=f"{type(e).__name__}: "
                 f"{str(e).splitlines()[0][:300] if str(e) else ''}")
    failures += not row["ok"]
    rows.append(row)
    print(("PASS " if row["ok"] else "FAIL ") + json.dumps(row), flush=True)
  print(f"{len(rows) - failures} PASS, {failures} FAIL")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 1 if failures else 0


def bench(fn, make_args, iters=10, rounds=5):
  """Median seconds per call over `rounds` fresh inputs."""
  times = []
  for r in range(rounds + 1):
    args = make_args(r)
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
      result = fn(*args)
    jax.block_until_ready(result)
    if r:  # the first round warms up
      times.append((time.perf_counter() - start) / iters)
  return float(np.median(times))


def timed_tflops(fn, make_args, flops):
  """TFLOP/s of the FP8 kernel call fn (its output, without the lse) on
  fresh inputs, or the error's first line."""
  try:
    return flops / bench(lambda *a: fn(*a)[0], make_args) / 1e12
  except Exception as e:  # noqa: BLE001 - a row per variant
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def write_json(path, rows):
  """The rows, with the device and jax version, to `path` (if given)."""
  if path:
    with open(path, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)


def time_all(args) -> int:
  batch, heads, seq = 1, 16, 16384
  settings = [(64, False), (128, False), (256, False), (128, True),
              (256, True)]
  if args.quick:
    settings = [(128, False)]
  tiles = {64: [(128, 2), (256, 2), (128, 3)],
           128: [(128, 2), (256, 2), (128, 3)],
           256: [(64, 2), (128, 2), (64, 3)]}
  rows = []
  for d, causal in settings:
    flops = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)

    def inputs(r, dtype):
      keys = jax.random.split(jax.random.key(100 + r), 3)
      xs = [jax.random.normal(key, (batch, seq, heads, d), jnp.float32)
            for key in keys]
      if dtype == "fp8":
        return [quantize(x, heads) for x in xs]
      return [x.astype(jnp.bfloat16) for x in xs]

    def tflops(seconds):
      return flops / seconds / 1e12

    row = dict(d=d, causal=causal, tokens=seq, heads=heads,
               rounds=args.time_rounds)
    cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention,
                                      implementation="cudnn",
                                      is_causal=causal))
    jf = jax.jit(functools.partial(jflash.flash_attention, is_causal=causal))

    def make_fp8(r):
      (q8, qd), (k8, kd), (v8, vd) = inputs(r, "fp8")
      return q8, k8, v8, (qd, kd, vd)

    calls = {"cudnn_bf16": (cudnn, lambda r: inputs(r, "bf16")),
             "jflash_bf16": (jf, lambda r: inputs(r, "bf16"))}
    for block_kv, stages in tiles[d]:
      fn = jax.jit(functools.partial(
          fp8_call, block_sizes=MosaicBlockSizes(block_kv=block_kv,
                                                 num_stages=stages),
          is_causal=causal))
      calls[f"fp8_kv{block_kv}x{stages}"] = (
          lambda *a, fn=fn: fn(*a)[0], make_fp8)
    times = {}
    for label, (fn, make) in calls.items():  # Compiled, or the error.
      try:
        jax.block_until_ready(fn(*make(0)))
        times[label] = []
      except Exception as e:  # noqa: BLE001 - a row per variant
        row[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # Interleaved rounds, each call right after each other one equally
    # often (on a power-capped GPU a call starts at the clock its
    # predecessor left): fresh inputs per call.
    for r, order in enumerate(run.round_orders(list(times),
                                               args.time_rounds)):
      for label in order:
        fn, make = calls[label]
        times[label].append(bench(
            fn, lambda i, r=r, make=make: make(10 * r + i + 1), rounds=1))
    for label, samples in times.items():
      row[label] = tflops(float(np.median(samples)))
    best = max((v for k, v in row.items() if k.startswith("fp8_")
                and isinstance(v, float)), default=None)
    row["fp8_best"] = best
    if best and isinstance(row.get("cudnn_bf16"), float):
      row["fp8_best_vs_cudnn_bf16"] = best / row["cudnn_bf16"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  write_json(args.json, rows)
  return 0


def fp8_inputs(shape, seed: int):
  """make(r): e4m3 q, k, v of `shape` [B, T, N, D] quantized per (batch,
  head) from fresh standard normal inputs (key seed + r), and the
  descales, as fp8_call takes them."""

  def make(r):
    keys = jax.random.split(jax.random.key(seed + r), 3)
    (q8, qd), (k8, kd), (v8, vd) = (quantize(jax.random.normal(
        key, shape, jnp.float32), shape[2]) for key in keys)
    return q8, k8, v8, (qd, kd, vd)

  return make


def default_tile_cases(settings, seed: int):
  """Per (head dim, causal) of `settings` at FlashAttention-3's FP8 setting
  (B=1, 16 heads, 16k tokens): d, causal, the flop count, the default FP8
  tiles and the inputs' `make` (fp8_inputs)."""
  shape = lambda d: (1, 16384, 16, d)
  for d, causal in settings:
    flops = 4 * 16 * 16384**2 * d * (0.5 if causal else 1.0)
    yield (d, causal, flops, mosaic_config.default_fp8_block_sizes(d),
           fp8_inputs(shape(d), seed))


def switch_ab(args, variants, restore, seed: int) -> list:
  """The default FP8 tiles under each variant (`variants`: name -> a
  function of the head dim and causality that sets forward.py's module
  switches, read when the call is traced; `restore` resets them), and
  cuDNN bf16, in args.rounds interleaved rounds at FlashAttention-3's
  setting, each call after each other one equally often
  (`run.round_orders`); medians of the rounds' times, as TFLOP/s. The
  rows, printed."""
  rows = []
  for d, causal, flops, tiles, make in default_tile_cases(
      ((64, False), (128, False), (256, False), (128, True)), seed=seed):

    def make_bf16(r, d=d):
      keys = jax.random.split(jax.random.key(seed + r), 3)
      return [jax.random.normal(key, (1, 16384, 16, d), jnp.bfloat16)
              for key in keys]

    fns = {}
    for name, set_switches in variants.items():
      set_switches(d, causal)
      fn = jax.jit(functools.partial(fp8_call, block_sizes=tiles,
                                     is_causal=causal))
      jax.block_until_ready(fn(*make(0)))  # traced with the switches set
      fns[name] = (lambda *a, fn=fn: fn(*a)[0], make)
    restore()
    fns["cudnn_bf16"] = (jax.jit(functools.partial(
        jax.nn.dot_product_attention, implementation="cudnn",
        is_causal=causal)), make_bf16)
    times = {name: [] for name in fns}
    for r, order in enumerate(run.round_orders(list(fns), args.rounds)):
      for name in order:
        fn, make_args = fns[name]
        times[name].append(bench(fn, lambda i, r=r, m=make_args: m(
            10 * r + i), rounds=1))
    row = dict(d=d, causal=causal, block_kv=tiles.block_kv,
               rounds=args.rounds)
    for name, ts in times.items():
      row[name] = flops / float(np.median(ts)) / 1e12
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def prefetch_ab(args) -> int:
  default_dims = forward.FP8_Q_PREFETCH_HEAD_DIMS

  def setter(prefetch):
    def set_switches(d, causal):
      del causal
      forward.FP8_Q_PREFETCH_HEAD_DIMS = (d,) if prefetch else ()
    return set_switches

  def restore():
    forward.FP8_Q_PREFETCH_HEAD_DIMS = default_dims

  rows = switch_ab(args, {"prefetch_on": setter(True),
                          "prefetch_off": setter(False)}, restore, seed=300)
  for row in rows:
    row["on_vs_off"] = row["prefetch_on"] / row["prefetch_off"]
  write_json(args.json, rows)
  return 0


def module_switch_ab(args, switch: str, variants: dict, seed: int,
                     ratio: str, annotate=None) -> int:
  """`switch_ab` over values of one of forward.py's module switches
  (variants {name: value of forward.<switch>}, two of them; the switch
  restored after): each row gets `ratio`, the second variant's TFLOP/s over
  the first's, and `annotate(row)`'s additions; rows to args.json."""
  default = getattr(forward, switch)

  def setter(value):
    def set_switches(d, causal):
      del d, causal
      setattr(forward, switch, value)
    return set_switches

  rows = switch_ab(
      args, {name: setter(value) for name, value in variants.items()},
      lambda: setattr(forward, switch, default), seed=seed)
  first, second = variants
  for row in rows:
    row[ratio] = row[second] / row[first]
    if annotate is not None:
      annotate(row)
  write_json(args.json, rows)
  return 0


def k_wait_ab(args) -> int:
  return module_switch_ab(
      args, "K_WAIT_UNDER_PV",
      {"k_wait_after_pv": False, "k_wait_under_pv": True}, seed=310,
      ratio="under_vs_after",
      annotate=lambda row: row.update(default_under_pv=(
          forward.waits_for_k_under_pv(True, row["d"], row["causal"]))))


def barrier_ab(args) -> int:
  return module_switch_ab(
      args, "FP8_SOFTMAX_BARRIER", {"barrier_on": True, "barrier_off": False},
      seed=320, ratio="off_vs_on")


def sweep(args) -> int:
  rows = []
  for d, causal, flops, tiles, make in default_tile_cases(
      ((64, False), (128, False), (128, True), (256, False)), seed=200):

    row = dict(d=d, causal=causal, block_kv=tiles.block_kv)
    for barrier in (True, False):
      for persistent in (None, False):
        label = (f"barrier_{'on' if barrier else 'off'}_"
                 f"{'persistent' if persistent is None else 'grid'}")
        forward.FP8_SOFTMAX_BARRIER = barrier
        fn = jax.jit(functools.partial(fp8_call, block_sizes=tiles,
                                       is_causal=causal,
                                       persistent=persistent))
        row[label] = timed_tflops(fn, make, flops)
    forward.FP8_SOFTMAX_BARRIER = True
    rows.append(row)
    print(json.dumps(row), flush=True)
  write_json(args.json, rows)
  return 0


def accuracy(args) -> int:
  batch, seq, heads = 2, 256 if args.quick else 4096, 16
  rows = []
  attend = jax.jit(lambda q, k, v, qd, kd, vd: jflash.flash_attention(
      q, k, v, q_descale=qd, k_descale=kd, v_descale=vd))
  reference = jax.jit(lambda q, k, v: xla.attention_reference(
      q, k, v, jnp.full((batch,), seq, jnp.int32),
      jnp.full((batch,), seq, jnp.int32), scale=q.shape[-1] ** -0.5,
      is_causal=False))

  def rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))

  for d in (64, 128, 256):
    keys = jax.random.split(jax.random.key(d), 6)
    normal = [jax.random.normal(keys[i], (batch, seq, heads, d), jnp.float32)
              for i in range(3)]
    outliers = [jnp.where(jax.random.bernoulli(keys[3 + i], 1e-3, x.shape),
                          10.0 * x, x) for i, x in enumerate(normal)]
    row = dict(d=d)
    exact = reference(*outliers)
    per_tensor = []
    for x in outliers:
      descale = jnp.max(jnp.abs(x)) / E4M3_MAX
      per_tensor += [(x / descale).astype(FP8),
                     jnp.full((batch, heads), descale, jnp.float32)]
    q8, qd, k8, kd, v8, vd = per_tensor
    row["outliers_per_tensor"] = rms(attend(q8, k8, v8, qd, kd, vd), exact)
    row["outliers_per_head"] = rms(attend(*jflash.quantize_qkv(*outliers)),
                                   exact)
    row["outliers_hadamard"] = rms(attend(*jflash.quantize_qkv(
        *outliers, hadamard=True)), exact)
    row["hadamard_vs_per_tensor"] = (row["outliers_hadamard"]
                                     / row["outliers_per_tensor"])
    q8, k8, v8, qd, kd, vd = jflash.quantize_qkv(*normal)
    dequantized = [jflash.dequantize_fp8(x8, ds) for x8, ds in
                   ((q8, qd), (k8, kd), (v8, vd))]
    row["normal_kernel_vs_dequantized"] = rms(attend(q8, k8, v8, qd, kd, vd),
                                              reference(*dequantized))
    rows.append(row)
    print(json.dumps(row), flush=True)
  write_json(args.json, rows)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=("check", "time", "accuracy", "sweep",
                                       "prefetch_ab", "k_wait_ab",
                                       "barrier_ab"))
  parser.add_argument("--json", help="write the results here")
  parser.add_argument("--quick", action="store_true",
                      help="time: D=128 non-causal only; accuracy: 256 "
                      "tokens")
  parser.add_argument("--time-rounds", type=int, default=10,
                      help="time: interleaved rounds of its five calls per "
                           "row (a multiple of 10 balances their order)")
  parser.add_argument("--rounds", type=int, default=12,
                      help="the *_ab modes: interleaved rounds (a "
                           "multiple of 6 balances the order of the three "
                           "calls)")
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  return {"check": check, "time": time_all, "accuracy": accuracy,
          "sweep": sweep, "prefetch_ab": prefetch_ab,
          "k_wait_ab": k_wait_ab, "barrier_ab": barrier_ab}[args.mode](args)


if __name__ == "__main__":
  sys.exit(main())
