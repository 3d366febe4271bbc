"""Times a whole GPT training step on jflash, cuDNN and XLA attention.

One process, one model, the same initial parameters and the same batches for
every attention implementation; only the attention call differs:

  jflash: `jflash.flash_attention(..., is_causal=True)`, the default choice
          per pass (on Hopper: the Mosaic GPU kernels, forward and backward)
  triton: `jflash.flash_attention(..., implementation="triton")` (in the
          Pallas interpreter off the GPU)
  mosaic: `jflash.flash_attention(..., implementation="mosaic")` (Hopper;
          not in the defaults, the same as jflash there)
  cudnn:  `jax.nn.dot_product_attention(..., implementation="cudnn")`
  xla:    `jax.nn.dot_product_attention(..., implementation="xla")`; it
          materializes the [B, H, N, N] scores, so it is skipped above
          --skip-xla-above (the output says so and how large they would be).

The model (GPT-style, decoder only): token embedding, --layers pre-norm
blocks (RMSNorm; attention with rotary positions on q and k, --heads query
heads of dimension d_model / heads, --kv-heads key/value heads (GQA), causal;
RMSNorm; MLP d_model -> 4 d_model -> d_model with GELU), a final RMSNorm and
an untied output head over --vocab tokens; no biases, no dropout. Parameters
and activations are bfloat16; the loss (mean next-token cross entropy) is
taken in float32. The optimizer is `optax.adamw` (lr 1e-4, b2 0.95, weight
decay 0.1 on every parameter) run in float32: its moments are float32, the
bfloat16 parameters and gradients are cast up for the update and the new
parameters rounded back to bfloat16. The layers' parameters are stacked and
run by `lax.scan` (--no-scan-layers unrolls them), each layer rematerialized
in the backward pass (`jax.checkpoint`; --no-remat keeps activations), as in
the peers' measurements in ../shared/ANCHORS.md. One jitted step computes the
loss, its gradients and the update, donating parameters and optimizer state.

Defaults are issue 11's targets: 8 layers, d_model 2048, 16 heads (head dim
128), kv heads 4 and 16, vocab 32000, at B x N = 8 x 2048, 2 x 8192 and
1 x 32768. (The peers' 1 x 32768 number in ANCHORS.md used 4 layers: pass
--layers 4 to compare with it.)

Timing: each implementation's step is compiled ahead of time (`compile s`),
run --warmup times, then --steps times, each step on a new random batch of
token ids (all drawn before timing, the same for every implementation),
timed one by one up to `block_until_ready`; the table reports the median.
`tok/s` is B * N / median step time; `vs cuDNN` is cuDNN's median step time
divided by the implementation's (> 1: faster than cuDNN). `attn ms` and
`attn %` estimate the attention kernels' share of the step: the median time
of the attention alone at the layer's shape (forward + backward, plus one
more forward per layer when rematerialized), times --layers, over the step
time (--no-attention-share skips them). That estimate is wall time of
attention-only programs: inside the step the same kernels ran 5-18%
longer (H100 at its 700 W power cap, later layers of the backward the
most), and at 8 x 2048 with 4 kv heads cuDNN's attention-only programs
took 14.5-15.0 ms of wall time against 13.0 ms of GPU time for its
kernels inside the step, so the column can misstate the attention's part
of a step ratio; GPU time per kernel from a `jax.profiler` trace of warm
steps is the measure (RECORD 2026-11-26, "the training step at steady state";
its script is in results/scripts_2026-11-26/SCRIPTS.md, step_profile2.py). `loss` is the first step's loss,
the same batch and parameters for every implementation, so the column should
agree to bf16 rounding. `mem MiB` is the compiled step's footprint from
XLA's memory analysis (arguments + outputs + temporaries - aliases).
An implementation's error is printed in its row and the run goes on.

GPU command (repository root), all six default cases and the four default
implementations, numbers also into a JSON file:

  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/train_step.py \
      --json train_step.json

Each (case, implementation) compiles a step and, for the attention share,
two attention-only programs; where one command may run 10 minutes at most,
split the shapes over two commands (or pass --no-attention-share):

  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/train_step.py \
      --shapes 8,2048 2,8192 --json train_step_short.json
  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/train_step.py \
      --shapes 1,32768 --json train_step_long.json

Smoke test on any machine (tests/benchmark_test.py runs it): a 2-layer
model, d_model 64, sequence 64, through the Triton kernels in the Pallas
interpreter and XLA attention:

  PYTHONPATH=. python3 benchmarks/train_step.py --tiny --allow-cpu
"""

import argparse
import dataclasses
import datetime
import functools
import json
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
import optax

from benchmarks import run as bench

IMPLS = ("jflash", "triton", "mosaic", "cudnn", "xla")
DEFAULT_IMPLS = ("jflash", "triton", "cudnn", "xla")
DEFAULT_SHAPES = ("8,2048", "2,8192", "1,32768")
DEFAULT_KV_HEADS = (4, 16)
MLP_RATIO = 4
ROPE_BASE = 10000.0
NORM_EPS = 1e-6

# --tiny: what it changes, for a smoke test in the Pallas interpreter.
TINY = dict(layers=2, d_model=64, heads=4, vocab=256, shapes=["2,64"],
            kv_heads=[2], impls=["triton", "xla"])


@dataclasses.dataclass(frozen=True)
class Config:
  """The model's sizes (hashable: a static argument of the jitted step)."""

  layers: int
  d_model: int
  heads: int
  kv_heads: int
  vocab: int
  remat: bool
  scan_layers: bool

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


def parse_batch_shape(text: str) -> tuple[int, int]:
  """Parses `B,N` (batch, sequence length); argparse reports errors."""
  try:
    batch, seq_len = (int(s) for s in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected B,N, got {text!r}")
  if batch <= 0 or seq_len <= 0:
    raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
  return batch, seq_len


def parse_impls(text: str) -> list[str]:
  impls = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
  unknown = sorted(set(impls) - set(IMPLS))
  if unknown or not impls:
    raise argparse.ArgumentTypeError(
        f"--impls takes a comma-separated subset of {IMPLS}, got {text!r}")
  return impls


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n", 1)[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument(
      "--shapes", nargs="+", type=str,
      help="batch shapes B,N (batch, sequence length); default: "
      + " ".join(DEFAULT_SHAPES))
  parser.add_argument("--kv-heads", nargs="+", type=int,
                      help="key/value head counts, one case each; default: "
                      + " ".join(map(str, DEFAULT_KV_HEADS)))
  parser.add_argument("--impls", type=parse_impls,
                      help="comma-separated subset of " + ",".join(IMPLS)
                      + "; default: " + ",".join(DEFAULT_IMPLS))
  parser.add_argument("--layers", type=int, help="default 8")
  parser.add_argument("--d-model", type=int, help="default 2048")
  parser.add_argument("--heads", type=int, help="query heads; default 16")
  parser.add_argument("--vocab", type=int, help="default 32000")
  parser.add_argument("--remat", action=argparse.BooleanOptionalAction,
                      default=True, help="rematerialize each layer")
  parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction,
                      default=True, help="run the layers with lax.scan")
  parser.add_argument("--learning-rate", type=float, default=1e-4)
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps after compilation")
  parser.add_argument("--steps", type=int, default=10,
                      help="timed steps (>= 5 unless --tiny); the median "
                      "is reported")
  parser.add_argument("--attention-share",
                      action=argparse.BooleanOptionalAction, default=True,
                      help="also time the attention alone (attn ms, attn %%)")
  parser.add_argument("--skip-xla-above", type=int, default=8192,
                      metavar="N", help="skip the xla implementation for "
                      "seq len > N (it materializes [B, H, N, N] scores)")
  parser.add_argument("--json", metavar="PATH",
                      help="also write all numbers to this JSON file")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tiny", action="store_true",
                      help="a tiny model for a smoke test: " + ", ".join(
                          f"{k}={v}" for k, v in TINY.items())
                      + " (explicit flags win)")
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run without a GPU (smoke test; use --tiny)")
  args = parser.parse_args(argv)

  defaults = dict(layers=8, d_model=2048, heads=16, vocab=32000,
                  shapes=list(DEFAULT_SHAPES),
                  kv_heads=list(DEFAULT_KV_HEADS), impls=list(DEFAULT_IMPLS))
  if args.tiny:
    defaults.update(TINY)
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  try:
    args.shapes = list(dict.fromkeys(
        parse_batch_shape(s) for s in args.shapes))
  except argparse.ArgumentTypeError as e:
    parser.error(f"--shapes: {e}")
  args.kv_heads = list(dict.fromkeys(args.kv_heads))

  min_steps = 1 if args.tiny else 5
  if args.steps < min_steps:
    parser.error(f"--steps must be >= {min_steps}, got {args.steps}")
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0, got {args.warmup}")
  for name in ("layers", "d_model", "heads", "vocab"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be positive")
  if args.d_model % args.heads:
    parser.error(f"--d-model={args.d_model} must be a multiple of "
                 f"--heads={args.heads}")
  if (args.d_model // args.heads) % 2:
    parser.error("the head dim d_model / heads must be even (rotary)")
  for kv_heads in args.kv_heads:
    if kv_heads < 1 or args.heads % kv_heads:
      parser.error(f"--kv-heads={kv_heads} must divide --heads={args.heads}")
  return args


# The model: plain functions over a dict of parameters.


def init_params(key: jax.Array, cfg: Config) -> dict[str, Any]:
  """GPT-2-style init (normal 0.02, residual outputs / sqrt(2 layers)), bf16.

  Layer parameters are stacked along a leading [layers] axis.
  """
  d, hd, layers = cfg.d_model, cfg.head_dim, cfg.layers
  shapes = {
      "wq": (d, cfg.heads * hd), "wk": (d, cfg.kv_heads * hd),
      "wv": (d, cfg.kv_heads * hd), "wo": (cfg.heads * hd, d),
      "w_in": (d, MLP_RATIO * d), "w_out": (MLP_RATIO * d, d)}
  keys = jax.random.split(key, len(shapes) + 2)
  residual_std = 0.02 / (2 * layers) ** 0.5
  layer_params = {
      name: jax.random.normal(k, (layers, *shape), jnp.bfloat16)
      * jnp.bfloat16(residual_std if name in ("wo", "w_out") else 0.02)
      for k, (name, shape) in zip(keys, shapes.items())}
  layer_params["attention_norm"] = jnp.ones((layers, d), jnp.bfloat16)
  layer_params["mlp_norm"] = jnp.ones((layers, d), jnp.bfloat16)
  return {
      "embed": jax.random.normal(keys[-2], (cfg.vocab, d), jnp.bfloat16)
               * jnp.bfloat16(0.02),
      "layers": layer_params,
      "final_norm": jnp.ones((d,), jnp.bfloat16),
      "head": jax.random.normal(keys[-1], (d, cfg.vocab), jnp.bfloat16)
              * jnp.bfloat16(0.02),
  }


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
  """RMSNorm over the last axis, in float32; x [..., d], weight [d]."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                        + NORM_EPS)
  weight = weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
  return (x32 * weight).astype(x.dtype)


def rotary_tables(seq_len: int, head_dim: int) -> tuple[jax.Array, ...]:
  """cos and sin [1, seq_len, 1, head_dim / 2] for positions 0..seq_len-1."""
  inv_freq = ROPE_BASE ** (-jnp.arange(0, head_dim, 2, jnp.float32)
                           / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None]
  return (jnp.cos(angles)[None, :, None, :],
          jnp.sin(angles)[None, :, None, :])


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates halves of x [batch, seq_len, heads, head_dim] (GPT-NeoX style)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x.dtype)


def block(x: jax.Array, p: dict[str, jax.Array], *, cfg: Config,
          attention: Callable[..., jax.Array], cos: jax.Array,
          sin: jax.Array) -> jax.Array:
  """One pre-norm layer on x [batch, seq_len, d_model]."""
  batch, seq_len, _ = x.shape
  hd = cfg.head_dim
  h = rms_norm(x, p["attention_norm"])
  q = (h @ p["wq"]).reshape(batch, seq_len, cfg.heads, hd)
  k = (h @ p["wk"]).reshape(batch, seq_len, cfg.kv_heads, hd)
  v = (h @ p["wv"]).reshape(batch, seq_len, cfg.kv_heads, hd)
  q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
  out = attention(q, k, v).reshape(batch, seq_len, cfg.heads * hd)
  x = x + out @ p["wo"]
  h = rms_norm(x, p["mlp_norm"])
  return x + jax.nn.gelu(h @ p["w_in"]) @ p["w_out"]


def loss_fn(params: dict[str, Any], tokens: jax.Array, *, cfg: Config,
            attention: Callable[..., jax.Array]) -> jax.Array:
  """Mean next-token cross entropy (float32) of tokens [batch, seq_len + 1]."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  cos, sin = rotary_tables(inputs.shape[1], cfg.head_dim)
  layer = functools.partial(block, cfg=cfg, attention=attention, cos=cos,
                            sin=sin)
  if cfg.remat:
    # Inside scan, CSE across the recomputation is impossible anyway.
    layer = jax.checkpoint(layer, prevent_cse=not cfg.scan_layers)
  x = params["embed"][inputs]
  if cfg.scan_layers:
    x, _ = lax.scan(lambda x, p: (layer(x, p), None), x, params["layers"])
  else:
    for i in range(cfg.layers):
      x = layer(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]))
  logits = rms_norm(x, params["final_norm"]) @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
  return optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1)


def to_float32(tree: Any) -> Any:
  return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def train_step(params: dict[str, Any], opt_state: Any, tokens: jax.Array, *,
               cfg: Config, attention: Callable[..., jax.Array],
               optimizer: optax.GradientTransformation):
  """Loss, gradients and a float32 adamw update of the bf16 parameters."""
  loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg=cfg,
                                            attention=attention)
  updates, opt_state = optimizer.update(to_float32(grads), opt_state,
                                        to_float32(params))
  params = jax.tree.map(
      lambda p, u: (p.astype(jnp.float32) + u).astype(p.dtype), params,
      updates)
  return params, opt_state, loss


def count_params(cfg: Config) -> int:
  shapes = jax.eval_shape(functools.partial(init_params, cfg=cfg),
                          jax.random.key(0))
  return sum(a.size for a in jax.tree.leaves(shapes))


# Measuring.


def xla_skip_reason(batch: int, seq_len: int, cfg: Config,
                    args: argparse.Namespace) -> str | None:
  """Why the xla implementation is skipped for this shape, or None."""
  if seq_len <= args.skip_xla_above:
    return None
  # jax.nn's XLA path keeps float32 logits and bf16 probabilities.
  gib = batch * cfg.heads * seq_len**2 * (4 + 2) / 2**30
  return (f"skipped: N={seq_len} > --skip-xla-above={args.skip_xla_above} "
          f"(its [B, H, N, N] scores would take {gib:.0f} GiB per layer)")


def attention_ms(attention: Callable[..., jax.Array], batch: int,
                 seq_len: int, cfg: Config, key: jax.Array) -> float:
  """Milliseconds of one layer's attention in the step: fwd+bwd (+ fwd)."""
  shape = bench.Shape(batch, seq_len, cfg.heads, cfg.head_dim, cfg.kv_heads)
  inputs = bench.random_inputs(key, shape, jnp.bfloat16)
  total = 0.0
  passes = ("fwd+bwd", "fwd") if cfg.remat else ("fwd+bwd",)
  for pass_ in passes:
    step = bench.make_step(attention, pass_)
    total += bench.time_step(step, inputs, warmup=2, repeats=5, iters=3)[1]
  return total * 1e3


def run_impl(impl: str, batch: int, seq_len: int, cfg: Config,
             args: argparse.Namespace, batches: list[jax.Array],
             key: jax.Array, device: jax.Device) -> dict[str, Any]:
  """Times one implementation's training step on one case; never raises."""
  row = {
      "batch": batch, "seq_len": seq_len, "layers": cfg.layers,
      "d_model": cfg.d_model, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
      "head_dim": cfg.head_dim, "vocab": cfg.vocab, "impl": impl,
      "step_ms": None, "step_ms_all": None, "tokens_per_s": None,
      "vs_cudnn": None, "attention_ms": None, "attention_share": None,
      "loss_first": None, "loss_last": None, "compile_s": None,
      "mem_mib": None, "peak_mib": None, "error": None, "attention_error":
      None,
  }
  if impl == "xla":
    row["error"] = xla_skip_reason(batch, seq_len, cfg, args)
    if row["error"]:
      return row
  attention = bench.attention_fn(impl, is_causal=True)
  step = jax.jit(
      functools.partial(train_step, cfg=cfg, attention=attention,
                        optimizer=make_optimizer(args.learning_rate)),
      donate_argnums=(0, 1))
  init_key, attention_key = jax.random.split(key)
  try:
    # The same key for every implementation: the same initial parameters.
    params = jax.jit(init_params, static_argnums=1)(init_key, cfg)
    opt_state = jax.jit(
        lambda p: make_optimizer(args.learning_rate).init(to_float32(p)))(
            params)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batches[0]).compile()
    row["compile_s"] = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is not None:
      row["mem_mib"] = (
          stats.temp_size_in_bytes + stats.argument_size_in_bytes
          + stats.output_size_in_bytes - stats.alias_size_in_bytes) / 2**20
    times, losses = [], []
    for i, tokens in enumerate(batches):
      start = time.perf_counter()
      params, opt_state, loss = jax.block_until_ready(
          compiled(params, opt_state, tokens))
      if i >= args.warmup:
        times.append(time.perf_counter() - start)
      losses.append(loss)
    del params, opt_state
    losses = [float(l) for l in losses]
  except Exception as e:  # pylint: disable=broad-exception-caught
    row["error"] = bench.short_error(e)
    return row
  finally:
    peak = bench.peak_bytes(device)
    row["peak_mib"] = None if peak is None else peak / 2**20
  step_s = statistics.median(times)
  row["step_ms"] = step_s * 1e3
  row["step_ms_all"] = [t * 1e3 for t in times]
  row["tokens_per_s"] = batch * seq_len / step_s
  row["loss_first"], row["loss_last"] = losses[0], losses[-1]
  if args.attention_share:
    try:
      per_layer = attention_ms(attention, batch, seq_len, cfg, attention_key)
    except Exception as e:  # pylint: disable=broad-exception-caught
      row["attention_error"] = bench.short_error(e)
    else:
      row["attention_ms"] = per_layer * cfg.layers
      row["attention_share"] = row["attention_ms"] / row["step_ms"]
  return row


def add_ratios(case_rows: list[dict[str, Any]]) -> None:
  """`vs_cudnn` = cuDNN's step time / the row's (> 1: faster than cuDNN)."""
  cudnn = {r["impl"]: r["step_ms"] for r in case_rows}.get("cudnn")
  for r in case_rows:
    if cudnn and r["step_ms"]:
      r["vs_cudnn"] = cudnn / r["step_ms"]


def format_table(rows: list[dict[str, Any]]) -> str:
  fmt = bench.fmt
  header = (f"{'B x N':<10} {'H/K':<6} {'impl':<7} {'step ms':>9} "
            f"{'tok/s':>9} {'vs cuDNN':>8} {'attn ms':>8} {'attn %':>6} "
            f"{'loss':>7} {'compile s':>9} {'mem MiB':>9}  error")
  lines = [header, "-" * len(header)]
  for r in rows:
    share = r["attention_share"]
    error = r["error"] or (r["attention_error"] and
                           f"attention alone: {r['attention_error']}")
    lines.append(
        f"{str(r['batch']) + ' x ' + str(r['seq_len']):<10} "
        f"{str(r['heads']) + '/' + str(r['kv_heads']):<6} {r['impl']:<7} "
        f"{fmt(r['step_ms'], '.2f'):>9} {fmt(r['tokens_per_s'], '.0f'):>9} "
        f"{fmt(r['vs_cudnn'], '.3f', 'x'):>8} "
        f"{fmt(r['attention_ms'], '.2f'):>8} "
        f"{fmt(None if share is None else 100 * share, '.0f'):>6} "
        f"{fmt(r['loss_first'], '.4f'):>7} {fmt(r['compile_s'], '.1f'):>9} "
        f"{fmt(r['mem_mib'], '.0f'):>9}  {error or ''}".rstrip())
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  args = parse_args(argv[1:])
  backend = jax.default_backend()
  if backend != "gpu" and not args.allow_cpu:
    print(f"benchmarks/train_step.py needs a GPU, but JAX's default backend "
          f"is {backend!r}. Pass --tiny --allow-cpu for a smoke test.",
          file=sys.stderr)
    return 2

  device = jax.devices()[0]
  configs = [Config(layers=args.layers, d_model=args.d_model,
                    heads=args.heads, kv_heads=kv_heads, vocab=args.vocab,
                    remat=args.remat, scan_layers=args.scan_layers)
             for kv_heads in args.kv_heads]
  meta = {
      "device_kind": device.device_kind,
      "backend": backend,
      "jax_version": jax.__version__,
      "jaxlib_version": bench.package_version("jaxlib"),
      "optax_version": bench.package_version("optax"),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": shlex.join([sys.executable] + argv),
      "git_commit": bench.git_commit(),
      "impls": args.impls,
      "model": (f"{args.layers} layers, d_model {args.d_model}, "
                f"{args.heads} heads of dim {args.d_model // args.heads}, "
                f"kv heads {args.kv_heads}, MLP x{MLP_RATIO} GELU, RMSNorm, "
                f"rotary, vocab {args.vocab}, untied head, causal"),
      "params": {c.kv_heads: count_params(c) for c in configs},
      "precision": "bf16 params/activations, f32 loss, f32 adamw state",
      "layers_run": ("lax.scan" if args.scan_layers else "unrolled")
                    + (", rematerialized" if args.remat else ""),
      "timing": (f"median of {args.steps} steps, each timed to "
                 f"block_until_ready on a new random batch, after "
                 f"{args.warmup} warm-up steps"),
      "vs_cudnn": "cuDNN step time / impl step time (> 1: faster)",
  }
  for k, v in meta.items():
    print(f"{k:>15}: {v}")
  print(flush=True)

  rows = []
  key = jax.random.key(args.seed)
  for batch, seq_len in args.shapes:
    key, data_key = jax.random.split(key)
    # Token ids for every step, drawn before any timing; never all zeros.
    tokens = jax.random.randint(
        data_key, (args.warmup + args.steps, batch, seq_len + 1), 0,
        args.vocab, jnp.int32)
    batches = jax.block_until_ready(list(tokens))
    del tokens
    for cfg in configs:
      key, case_key = jax.random.split(key)
      case_rows = []
      for impl in args.impls:
        print(f"  {batch} x {seq_len}, kv heads {cfg.kv_heads}: {impl} ...",
              file=sys.stderr, flush=True)
        case_rows.append(run_impl(impl, batch, seq_len, cfg, args, batches,
                                  case_key, device))
      add_ratios(case_rows)
      rows += case_rows
      print(format_table(case_rows) + "\n", flush=True)
    del batches

  print("All rows:")
  print(format_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
