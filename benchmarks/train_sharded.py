"""Times the GPT training step of benchmarks/train_step.py sharded over GPUs.

The model, optimizer and step are train_step.py's (8 layers, d_model 2048,
16 heads of 128, kv heads 4 by default, bf16, float32 adamw, scanned and
rematerialized layers); only the placement differs. Each mesh `DxM` puts
the first D * M devices on a 2-D mesh ("data", "model"):

- data parallelism over "data": each step's token batch is split along the
  batch axis (--batch sequences per data shard, so the global batch is
  D * --batch: weak scaling), parameters and optimizer state replicated
  over "data"; the gradients' all-reduce is XLA's;
- tensor (head) parallelism over "model", Megatron-style: wq, wk, wv split
  by output columns (whole heads), wo by input rows, the MLP's w_in by
  columns and w_out by rows, so attention runs on the local heads and each
  layer all-reduces twice (after wo and w_out); embedding, head and norms
  replicated. q, k and v are constrained to P("data", None, "model", None)
  before the attention call, so the attention sees batch- and
  head-sharded operands (jflash partitions them with custom_partitioning;
  cuDNN with its own rules). M must divide the kv heads.

For every mesh, jflash (`flash_attention`, the default per pass) and cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`) are compiled, then
timed in balanced interleaved rounds (`run.round_orders`; --rounds rounds of
--steps-per-round steps, after --warmup steps each), every step on a new
batch, each timed to block_until_ready; the median is reported:

- step ms, tokens/s (global) and tokens/s per GPU;
- vs 1 GPU: tokens/s per GPU over the 1x1 mesh's tokens/s (same
  implementation, same per-shard batch; the issue's target is >= 0.9x at 8
  GPUs, and jflash >= cuDNN in each configuration);
- vs cuDNN: cuDNN's step time over jflash's in the same rounds;
- collectives: the compiled SPMD program's all-gather / all-reduce /
  reduce-scatter / all-to-all / collective-permute counts, and the
  all-gathers whose result has q's, k's or v's global shape [B, N, H or K,
  head dim] (there should be none: attention runs on local shards);
- loss of the first step (the same parameters and tokens for both
  implementations and every mesh with the same data size).

GPU command (repository root; needs D * M GPUs for each mesh):

  XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true PYTHONPATH=. \\
      python3 benchmarks/train_sharded.py --meshes 1x1 2x1 4x1 1x4 2x2 \\
      --json train_sharded.json

Smoke test on any machine (tests/benchmark_test.py runs it): 4 fake CPU
devices, a 2-layer model of width 64, XLA attention and the Triton kernels
in the Pallas interpreter:

  PYTHONPATH=. python3 benchmarks/train_sharded.py --tiny --cpu-devices 4
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import shlex
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks import run as bench
from benchmarks import train_step as ts


def parse_mesh(text: str) -> tuple[int, int]:
  """Parses `DxM` (data shards, model shards)."""
  match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
  if not match or min(int(g) for g in match.groups()) < 1:
    raise argparse.ArgumentTypeError(
        f"a mesh is DxM with positive D (data) and M (model), got {text!r}")
  return int(match.group(1)), int(match.group(2))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--meshes", type=parse_mesh, nargs="+",
                      help="DxM meshes (default: 1x1, then Dx1 and 1xM "
                           "and 2x(n/2) for the device count n)")
  parser.add_argument("--batch", type=int, default=8,
                      help="sequences per data shard (default 8)")
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--impls",
                      help="comma-separated: jflash, cudnn, triton, xla "
                           "(default jflash,cudnn; --tiny: xla,triton)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--steps-per-round", type=int, default=3)
  parser.add_argument("--json", help="write the rows and metadata here")
  parser.add_argument("--tiny", action="store_true",
                      help="smoke test: 2 layers, d_model 64, 4 heads of "
                           "16, sequence 64, vocab 256, XLA and Triton")
  parser.add_argument("--cpu-devices", type=int, default=0,
                      help="fake this many CPU devices")
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run off the GPU without --tiny")
  args = parser.parse_args(argv)
  if args.tiny:
    args.layers, args.d_model, args.heads, args.kv_heads = 2, 64, 4, 2
    args.vocab, args.seq_len, args.batch = 256, 64, 2
    args.impls = args.impls or "xla,triton"
    args.warmup, args.rounds, args.steps_per_round = 1, 2, 1
  args.impls = args.impls or "jflash,cudnn"
  args.impls = list(dict.fromkeys(
      s.strip() for s in args.impls.split(",") if s.strip()))
  unknown = sorted(set(args.impls) - {"jflash", "cudnn", "triton", "xla"})
  if unknown or not args.impls:
    parser.error(f"--impls: unknown {unknown}" if unknown else
                 "--impls: none given")
  for name in ("batch", "seq_len", "layers", "d_model", "heads", "vocab",
               "kv_heads", "rounds", "steps_per_round"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be positive")
  if args.d_model % args.heads or args.heads % args.kv_heads:
    parser.error(f"--heads={args.heads} must divide --d-model="
                 f"{args.d_model}, and --kv-heads={args.kv_heads} divide it")
  for data, model in args.meshes or ():
    if args.kv_heads % model:
      parser.error(f"mesh {data}x{model}: the model axis must divide "
                   f"--kv-heads={args.kv_heads}")
  return args


def default_meshes(devices: int, kv_heads: int) -> list[tuple[int, int]]:
  """1x1, then data-only and model-only over all devices, and 2 x n/2."""
  meshes = [(1, 1)]
  for d in sorted({2, devices} - {1}):
    if d <= devices:
      meshes.append((d, 1))
  if devices > 1 and kv_heads % devices == 0:
    meshes.append((1, devices))
  if devices >= 4 and devices % 2 == 0 and kv_heads % (devices // 2) == 0:
    meshes.append((2, devices // 2))
  return list(dict.fromkeys(meshes))


# Parameter placement (Megatron-style tensor parallelism over "model").
COLUMN_SPLIT = ("wq", "wk", "wv", "w_in")  # [layers, d_in, d_out]: split out
ROW_SPLIT = ("wo", "w_out")  # [layers, d_in, d_out]: split in


def param_specs(params: dict[str, Any]):
  """PartitionSpecs of train_step.init_params's tree."""
  layers = {}
  for name in params["layers"]:
    if name in COLUMN_SPLIT:
      layers[name] = P(None, None, "model")
    elif name in ROW_SPLIT:
      layers[name] = P(None, "model", None)
    else:
      layers[name] = P()
  return {"embed": P(), "layers": layers, "final_norm": P(), "head": P()}


def state_shardings(optimizer, param_shapes, param_shardings):
  """The shardings of `optimizer.init` of the float32 parameters: adamw's
  moments as their parameters (matched by the parameter's path of dict
  keys), scalars such as the step count replicated. Left to propagation,
  the moments came out replicated and every step all-gathered the float32
  gradients of the split weights for the update."""
  by_path = {
      tuple(k.key for k in path): sharding
      for path, sharding in jax.tree_util.tree_flatten_with_path(
          param_shardings)[0]}
  replicated = NamedSharding(next(iter(by_path.values())).mesh, P())
  shapes = jax.eval_shape(
      lambda p: optimizer.init(jax.tree.map(
          lambda a: a.astype(jnp.float32), p)), param_shapes)

  def pick(path, leaf):
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    return by_path.get(keys, replicated) if leaf.ndim else replicated
  return jax.tree_util.tree_map_with_path(pick, shapes)


def collective_counts(hlo: str, qkv_shapes: list[tuple[int, ...]]
                      ) -> dict[str, Any]:
  """Collective ops of a compiled HLO module, and all-gathers that rebuild
  an array of q's, k's or v's global shape."""
  counts = {}
  for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
             "collective-permute"):
    counts[op] = len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
  # Result shapes of the all-gathers, e.g. "bf16[8,2048,16,128]".
  counts["all_gather_shapes"] = sorted(set(re.findall(
      r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)))
  dims = lambda text: tuple(int(d) for d in
                            text[text.index("[") + 1:-1].split(",") if d)
  counts["qkv_all_gathers"] = [
      shape for shape in counts["all_gather_shapes"]
      if dims(shape) in qkv_shapes]
  return counts


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = parse_args(argv)
  if args.cpu_devices:  # Before any backend starts (as ring.py).
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)

  backend = jax.default_backend()
  if backend != "gpu" and not (args.tiny or args.allow_cpu):
    sys.exit(f"benchmarks/train_sharded.py needs GPUs (backend {backend!r});"
             " pass --tiny (and --cpu-devices N) for a smoke test")
  devices = jax.devices()
  meshes = args.meshes or default_meshes(len(devices), args.kv_heads)
  for data, model in meshes:
    if data * model > len(devices):
      sys.exit(f"mesh {data}x{model} needs {data * model} devices; "
               f"{len(devices)} present")
  cfg = ts.Config(layers=args.layers, d_model=args.d_model, heads=args.heads,
                  kv_heads=args.kv_heads, vocab=args.vocab, remat=True,
                  scan_layers=True)
  optimizer = ts.make_optimizer(1e-4)
  meta = {
      "device_kind": devices[0].device_kind, "devices": len(devices),
      "backend": backend, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": shlex.join([sys.executable] + sys.argv),
      "git_commit": bench.git_commit(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "model": (f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} "
                f"heads of {cfg.head_dim}, kv heads {cfg.kv_heads}, vocab "
                f"{cfg.vocab}, scanned + remat (train_step.py's model)"),
      "per_data_shard": f"{args.batch} x {args.seq_len} tokens",
      "timing": (f"{args.rounds} balanced rounds of {args.steps_per_round} "
                 f"steps after {args.warmup} warm-up steps; median"),
  }
  for k, v in meta.items():
    print(f"{k:>15}: {v}")
  print(flush=True)

  rows = []
  single = {}  # impl -> tokens/s per GPU on the 1x1 mesh
  for data, model in meshes:
    mesh = jax.sharding.Mesh(
        np.array(devices[:data * model]).reshape(data, model),
        ("data", "model"))
    batch = args.batch * data
    qkv_shapes = [(batch, args.seq_len, h, cfg.head_dim)
                  for h in (cfg.heads, cfg.kv_heads)]
    qkv_sharding = NamedSharding(mesh, P("data", None, "model", None))
    token_sharding = NamedSharding(mesh, P("data", None))
    key = jax.random.key(0)
    tokens = [jax.device_put(
        jax.random.randint(k, (batch, args.seq_len + 1), 0, cfg.vocab,
                           jnp.int32), token_sharding)
              for k in jax.random.split(
                  jax.random.key(1),
                  args.warmup + args.rounds * args.steps_per_round)]
    shapes = jax.eval_shape(functools.partial(ts.init_params, cfg=cfg), key)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                             param_specs(shapes),
                             is_leaf=lambda x: isinstance(x, P))
    states, compiled, row_of = {}, {}, {}

    for impl in args.impls:
      inner = bench.attention_fn(impl, is_causal=True)

      def attention(q, k, v, inner=inner):
        q, k, v = (jax.lax.with_sharding_constraint(x, qkv_sharding)
                   for x in (q, k, v))
        return inner(q, k, v)

      row = {"mesh": f"{data}x{model}", "gpus": data * model, "impl": impl,
             "batch": batch, "seq_len": args.seq_len, "error": None}
      rows.append(row)
      row_of[impl] = row
      try:
        params = jax.jit(ts.init_params, static_argnums=1,
                         out_shardings=shardings)(key, cfg)
        opt_state = jax.jit(
            lambda p: optimizer.init(ts.to_float32(p)),
            out_shardings=state_shardings(optimizer, shapes, shardings))(
                params)
        step = jax.jit(
            functools.partial(ts.train_step, cfg=cfg, attention=attention,
                              optimizer=optimizer),
            out_shardings=(shardings,
                           state_shardings(optimizer, shapes, shardings),
                           NamedSharding(mesh, P())),
            donate_argnums=(0, 1))
        start = time.perf_counter()
        compiled[impl] = step.lower(params, opt_state, tokens[0]).compile()
        row["compile_s"] = time.perf_counter() - start
        row.update(collective_counts(compiled[impl].as_text(), qkv_shapes))
        states[impl] = (params, opt_state)
        losses = []
        for t in tokens[:args.warmup]:
          *states[impl], loss = jax.block_until_ready(
              compiled[impl](*states[impl], t))
          losses.append(float(loss))
        row["loss_first"] = losses[0] if losses else None
        row["times"] = []
      except Exception as e:  # pylint: disable=broad-exception-caught
        row["error"] = bench.short_error(e)
        compiled.pop(impl, None)
        states.pop(impl, None)
    names = [impl for impl in args.impls if impl in compiled]
    next_batch = args.warmup
    for order in bench.round_orders(names, args.rounds):
      batches = tokens[next_batch:next_batch + args.steps_per_round]
      next_batch += args.steps_per_round
      for impl in order:
        for t in batches:
          start = time.perf_counter()
          *states[impl], loss = jax.block_until_ready(
              compiled[impl](*states[impl], t))
          row_of[impl]["times"].append(time.perf_counter() - start)
    for impl in names:
      row = row_of[impl]
      step_s = statistics.median(row["times"])
      row["step_ms"] = step_s * 1e3
      row["tokens_per_s"] = batch * args.seq_len / step_s
      row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / (data * model)
      row["times"] = [t * 1e3 for t in row["times"]]
      if (data, model) == (1, 1):
        single[impl] = row["tokens_per_s_per_gpu"]
      row["vs_1gpu"] = (row["tokens_per_s_per_gpu"] / single[impl]
                        if impl in single else None)
    cudnn = row_of.get("cudnn", {}).get("step_ms")
    for impl in names:
      row_of[impl]["vs_cudnn"] = (cudnn / row_of[impl]["step_ms"]
                                  if cudnn else None)
    del states, compiled
    for impl in args.impls:
      print(format_row(row_of[impl]), flush=True)

  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return rows


def format_row(row: dict[str, Any]) -> str:
  if row.get("error"):
    return f"{row['mesh']:>5} {row['impl']:<7} error: {row['error']}"
  vs1 = row.get("vs_1gpu")
  vsc = row.get("vs_cudnn")
  return (f"{row['mesh']:>5} {row['impl']:<7} B={row['batch']:<3} "
          f"step {row['step_ms']:8.2f} ms  {row['tokens_per_s']:9.0f} tok/s"
          f"  {row['tokens_per_s_per_gpu']:8.0f} /GPU  "
          f"vs 1 GPU {'-' if vs1 is None else f'{vs1:.3f}'}  "
          f"vs cuDNN {'-' if vsc is None else f'{vsc:.3f}'}  "
          f"loss {row['loss_first']:.4f}  compile {row['compile_s']:.1f} s  "
          f"AG {row['all-gather']} AR {row['all-reduce']} "
          f"RS {row['reduce-scatter']} qkv-AG {len(row['qkv_all_gathers'])}")


if __name__ == "__main__":
  main()
