"""Example 5: training on a sequence sharded over devices (ring attention).

A small decoder-only transformer (plain JAX, optax) learns a copy task:
the second half of every sequence repeats the first, so predicting it means
attending half a sequence back, across device boundaries. Every
activation's sequence axis is sharded over all local devices (mesh axis
"context"): attention is `jflash.ring_attention` (causal; the balanced
layout by default, so every device does the same work), the per-token
layers are XLA's own SPMD partitioning of sequence-sharded arrays. The
balanced layout permutes a batch once: tokens, targets, loss mask and
positions (RoPE uses the global positions) go through `jflash.load_balance`.

Prints the loss, tokens/s (median over timed steps after a warm-up) and
memory per device: the compiled train step's arguments + outputs +
temporaries (XLA's memory analysis, per device: one SPMD program), and on
a GPU the allocator's peak.

Run:
  python examples/long_context_sharded.py                 # all local GPUs
  python examples/long_context_sharded.py --seq-len 131072 --strategy ring
  python examples/long_context_sharded.py --tiny --cpu-devices 4   # CPU
  JFLASH_CPU_DEVICES=8 python examples/long_context_sharded.py --tiny

On CPU (no GPU, or --cpu-devices N, which fakes N CPU devices and must be
set before JAX starts) the sizes shrink by themselves and attention runs
jflash's pure-JAX path per block (--interpret: the Triton kernels through
the Pallas interpreter, slow).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import jflash

GPU_SETTINGS = dict(steps=100, batch=1, seq_len=32768, layers=2, dim=1024,
                    heads=16, kv_heads=4, vocab=64, learning_rate=1e-3,
                    dtype="bfloat16")
CPU_SETTINGS = dict(steps=100, batch=8, seq_len=128, layers=2, dim=64,
                    heads=4, kv_heads=2, vocab=8, learning_rate=3e-3,
                    dtype="float32")
TINY_SETTINGS = dict(steps=6, batch=2, seq_len=128, layers=1, dim=32,
                     heads=2, kv_heads=1, vocab=8, learning_rate=1e-2,
                     dtype="float32")
AXIS = "context"
MIB = 2**20


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog="Sizes left out take the GPU defaults on a GPU, CPU ones "
      "elsewhere, or --tiny's.")
  parser.add_argument("--cpu-devices", type=int,
                      default=int(os.environ.get("JFLASH_CPU_DEVICES", 0)),
                      help="run on N fake CPU devices (env "
                      "JFLASH_CPU_DEVICES); default: the local devices")
  parser.add_argument("--tiny", action="store_true",
                      help="tiny sizes: seconds on CPU")
  for name, description in (
      ("steps", "training steps (logged)"),
      ("batch", "sequences per batch"),
      ("seq-len", "tokens per sequence, sharded over the devices"),
      ("layers", "transformer layers"),
      ("dim", "model width"),
      ("heads", "query heads"),
      ("kv-heads", "key/value heads (GQA)"),
      ("vocab", "vocabulary size of the copy task")):
    parser.add_argument(f"--{name}", type=int, help=description)
  parser.add_argument("--learning-rate", type=float, help="Adam's step size")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="dtype of activations and attention")
  parser.add_argument("--strategy", choices=("ring", "all_gather"),
                      default="ring",
                      help="ring: K/V shards travel around the devices; "
                      "all_gather: gathered once (default: %(default)s)")
  parser.add_argument("--layout", choices=("balanced", "contiguous"),
                      default="balanced",
                      help="balanced: every device does the same causal "
                      "work; contiguous: device i holds the i-th slice "
                      "(default: %(default)s)")
  parser.add_argument("--timed-steps", type=int, default=5,
                      help="steps timed for tokens/s (after a warm-up)")
  parser.add_argument("--interpret", action="store_true",
                      help="Triton kernels through the Pallas interpreter")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the weights and the data")
  return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains, prints loss, tokens/s and memory; returns them."""
  args = parse_args(argv)
  # Before anything starts JAX's backends (importing jax does not).
  if args.cpu_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  on_gpu = jax.default_backend() == "gpu"
  settings = (TINY_SETTINGS if args.tiny else GPU_SETTINGS if on_gpu
              else CPU_SETTINGS)
  if not on_gpu and not args.tiny:
    print("No GPU: CPU sizes (attention on jflash's pure-JAX path).")
  for name, value in settings.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  return train(args)


def init_params(key, args) -> dict[str, Any]:
  """Embedding (tied with the output), per layer attention and MLP."""
  head_dim = args.dim // args.heads
  keys = iter(jax.random.split(key, 1 + 6 * args.layers))
  dense = lambda fan_in, fan_out: jax.random.normal(
      next(keys), (fan_in, fan_out), jnp.float32) / fan_in**0.5
  layers = [dict(
      norm_1=jnp.ones(args.dim), norm_2=jnp.ones(args.dim),
      query=dense(args.dim, args.heads * head_dim),
      key=dense(args.dim, args.kv_heads * head_dim),
      value=dense(args.dim, args.kv_heads * head_dim),
      out=dense(args.heads * head_dim, args.dim),
      up=dense(args.dim, 4 * args.dim), down=dense(4 * args.dim, args.dim))
                for _ in range(args.layers)]
  # Tied embedding, rows of norm ~1: initial logits ~1, loss ~log(vocab).
  embed = jax.random.normal(next(keys), (args.vocab, args.dim)) / args.dim**0.5
  return dict(embed=embed, norm=jnp.ones(args.dim), layers=layers)


def model(params, tokens, positions, *, args, attention):
  """Logits [B, T, vocab] of tokens [B, T] at global `positions` [T]."""
  dtype = jnp.dtype(args.dtype)
  head_dim = args.dim // args.heads
  batch, seq = tokens.shape

  def rms_norm(x, weight):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6)
            * weight).astype(dtype)

  def rope(x):  # [B, T, heads, head_dim], rotary embedding at `positions`.
    half = head_dim // 2
    freqs = 10000.0 ** (-jnp.arange(half) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(
        jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos],
                           -1).astype(dtype)

  h = params["embed"][tokens].astype(dtype)
  for layer in params["layers"]:
    x = rms_norm(h, layer["norm_1"])
    project = lambda w, heads: (x @ w.astype(dtype)).reshape(
        batch, seq, heads, head_dim)
    q = rope(project(layer["query"], args.heads))
    k = rope(project(layer["key"], args.kv_heads))
    v = project(layer["value"], args.kv_heads)
    o = attention(q, k, v).reshape(batch, seq, args.heads * head_dim)
    h = h + o @ layer["out"].astype(dtype)
    x = rms_norm(h, layer["norm_2"])
    h = h + jax.nn.gelu(x @ layer["up"].astype(dtype)) @ layer[
        "down"].astype(dtype)
  h = rms_norm(h, params["norm"])
  return (h @ params["embed"].T.astype(dtype)).astype(jnp.float32)


def copy_task_batch(rng, args):
  """Tokens whose second half repeats the first; next-token targets and a
  mask of the positions whose target is a copy (in positional order)."""
  half = args.seq_len // 2
  first = rng.integers(1, args.vocab, size=(args.batch, half))
  tokens = np.concatenate([first, first], axis=1).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  mask = np.zeros(tokens.shape, np.float32)
  mask[:, half - 1:-1] = 1.0  # Row t predicts token t + 1 = token t+1-half.
  return tokens, targets, mask


def train(args) -> dict[str, Any]:


  devices = jax.devices()
  num_devices = len(devices)
  mesh = jax.make_mesh((num_devices,), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,))
  rows = NamedSharding(mesh, P(None, AXIS))
  replicated = NamedSharding(mesh, P())
  chunks = num_devices * (2 if args.layout == "balanced" else 1)
  if args.seq_len % chunks:
    raise SystemExit(f"--seq-len {args.seq_len} must be divisible by "
                     f"{chunks} ({num_devices} devices, {args.layout}).")
  balance = ((lambda x: jflash.load_balance(x, num_devices))
             if args.layout == "balanced" else (lambda x: x))
  print(f"devices: {num_devices} x {devices[0].device_kind} "
        f"({devices[0].platform}); sequence {args.seq_len} = "
        f"{args.seq_len // num_devices} tokens per device; strategy "
        f"{args.strategy}, layout {args.layout}; batch {args.batch}, "
        f"{args.layers} layers, dim {args.dim}, heads {args.heads}/"
        f"{args.kv_heads} (q/kv), {args.dtype}")

  attention = functools.partial(
      jflash.ring_attention, mesh=mesh, axis_name=AXIS, is_causal=True,
      layout=args.layout, strategy=args.strategy, interpret=args.interpret)
  # Global positions in the layout's order (RoPE needs the true ones).
  positions = jax.device_put(balance(np.arange(args.seq_len)[None])[0],
                             NamedSharding(mesh, P(AXIS)))
  optimizer = optax.adam(args.learning_rate)

  def loss_fn(params, tokens, targets, mask):
    logits = model(params, tokens, positions, args=args, attention=attention)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * mask) / jnp.sum(mask)

  # The ring's transfers overlap its blocks only if XLA's scheduler may
  # keep several collectives in flight (jflash.ring_compiler_options).
  @functools.partial(jax.jit, donate_argnums=(0, 1),
                     compiler_options=jflash.ring_compiler_options())
  def step(params, opt_state, tokens, targets, mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.device_put(init_params(jax.random.key(args.seed), args),
                          replicated)
  opt_state = jax.device_put(optimizer.init(params), replicated)
  rng = np.random.default_rng(args.seed)

  def next_batch():
    return tuple(jax.device_put(balance(x), rows)
                 for x in copy_task_batch(rng, args))

  batch = next_batch()
  start = time.perf_counter()
  compiled = step.lower(params, opt_state, *batch).compile()
  print(f"compiled in {time.perf_counter() - start:.1f} s")
  stats = compiled.memory_analysis()
  program_bytes = None if stats is None else (
      stats.argument_size_in_bytes + stats.output_size_in_bytes
      - stats.alias_size_in_bytes + stats.temp_size_in_bytes)

  losses, times = [], []
  for i in range(args.steps + args.timed_steps):
    start = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, *batch)
    loss = float(loss)  # Waits for the step.
    elapsed = time.perf_counter() - start
    batch = next_batch()
    if i < args.steps:
      losses.append(loss)
      print(f"step {i:4d}  loss {loss:.4f}  ({elapsed * 1e3:.1f} ms)")
    else:
      times.append(elapsed)
  tokens_per_s = args.batch * args.seq_len / statistics.median(times)
  peak = []
  if devices[0].platform == "gpu":
    peak = [d.memory_stats().get("peak_bytes_in_use", 0) for d in devices]
  print(f"first loss {losses[0]:.4f} -> last loss {losses[-1]:.4f} "
        f"(guessing: log({args.vocab - 1}) = {math.log(args.vocab - 1):.4f}; "
        "below it the model copies across devices)")
  print(f"tokens/s: {tokens_per_s:,.0f} ({tokens_per_s / num_devices:,.0f} "
        f"per device; median of {len(times)} steps)")
  if program_bytes is not None:
    print(f"memory per device (compiled step, XLA memory analysis): "
          f"{program_bytes / MIB:.1f} MiB")
  if peak:
    print(f"peak memory per device (allocator): {max(peak) / MIB:.1f} MiB")
  return dict(losses=losses, tokens_per_s=tokens_per_s,
              memory_bytes_per_device=program_bytes,
              peak_bytes_per_device=max(peak) if peak else None,
              devices=num_devices)


if __name__ == "__main__":
  main()
