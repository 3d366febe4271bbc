"""Times jflash against cuDNN, XLA and JAX's Pallas reference, side by side.

All implementations run in one process on the same inputs, forward and
forward+backward (`jax.grad` of `sum(out * cotangent)` with respect to q, k and
v), each under `jax.jit`:

  triton: `jflash.flash_attention(..., implementation="triton")`
  mosaic: `jflash.flash_attention(..., implementation="mosaic")` (Hopper)
  mosaic_atomic: as mosaic, with the atomic dQ backward forced
          (`MosaicBlockSizes(atomic_dq=True)`, `deterministic_grads=False`)
  jflash: `jflash.flash_attention(...)`, the default choice per pass
          (on Hopper: the Mosaic kernels)
  jflash_nondet: as jflash with `deterministic_grads=False` (the atomic dQ
          where jflash's rule takes it)
  cudnn:  `jax.nn.dot_product_attention(..., implementation="cudnn")`
  tokamax: `tokamax.dot_product_attention(..., implementation="mosaic")`,
          tokamax's Mosaic GPU kernels with its default configs (Hopper;
          the package is not a jflash dependency: without it the rows
          report an ImportError; WORKSPACE_NOTES says how the GPU machine
          gets it)
  xla:    `jax.nn.dot_product_attention(..., implementation="xla")`; it
          materializes the [N, N] scores, so it is skipped above
          --skip-xla-above.
  mha:    JAX's deprecated Pallas-Triton reference,
          `jax.experimental.pallas.ops.gpu.attention.mha` with its default
          tiles and `sm_scale=1/sqrt(D)` (needs N to be a multiple of 128 and
          has no grouped-query attention, so it reports an error on GQA
          shapes).

Usage, from the repository root:

  # The default "quick" preset: three shapes, bf16, triton/cudnn/xla.
  PYTHONPATH=. python3 benchmarks/run.py --json bench.json
  # One shape (GQA: 32 query heads sharing 8 kv heads), two dtypes.
  PYTHONPATH=. python3 benchmarks/run.py --shapes 2,4096,32,128,8 \\
      --dtype bfloat16 float16 --causal yes
  # The full sweep: N = 512 ... 32768 at 16384 tokens per batch, D = 64, 128,
  # 256, causal and not, GQA shapes, bf16 and fp16, all four implementations.
  PYTHONPATH=. python3 benchmarks/run.py --preset sweep \\
      --json sweep.json --plot sweep.png

Presets fill in --shapes, --dtype and --impls; any of the three given
explicitly wins over the preset:

  quick: 1,8192,16,128  4,2048,16,128  2,4096,16,64; bfloat16;
         triton,cudnn,xla.
  sweep: N in 512, 1024, ..., 32768 with B = max(1, 16384 // N), H = 16,
         D in 64, 128, 256; plus GQA 32 query / 8 kv heads, D = 128 at
         N = 2048 and 8192; bfloat16 and float16; triton,cudnn,xla,mha.

Shapes are `B,N,H,D` or `B,N,H,D,K`: batch, sequence length (queries and
keys), query heads, head dimension and kv heads (K divides H; default H).
Per-call time is the median over --repeats of (time of --iters back-to-back
calls) / --iters. TFLOP/s count 4*B*H*N^2*D (query heads H) for the forward
pass, halved when causal, and 3.5x that for forward+backward (the backward
pass is 2.5x the forward). `vs cuDNN` divides each row's TFLOP/s by cuDNN's
for the same case; `vs mha` divides jflash's by the Pallas reference's.
`mem MiB` is the compiled step's own footprint from XLA's memory analysis
(arguments + outputs + temporaries - aliased buffers), per call rather than
the process-wide peak (which the JSON keeps as `peak_mib`). Errors of one
implementation (e.g. cuDNN not supporting a shape) are printed in its row
instead of stopping the run. A progress bar over (shape, dtype, causal,
implementation) cases goes to stderr; --plot draws TFLOP/s against N, one
panel per (head dim, causal, pass).

On a machine without a GPU the script exits unless --allow-cpu is given; then
it runs whatever (tiny) shapes are passed, with jflash in the Pallas
interpreter, e.g. as a smoke test:

  PYTHONPATH=. python3 benchmarks/run.py --allow-cpu --impls xla,triton \\
      --shapes 1,64,2,32 1,64,4,32,2 --repeats 1 --iters 1 --warmup 0
"""

import argparse
import collections
import dataclasses
import datetime
import importlib.metadata
import json
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import tqdm

# mosaic_atomic: the Mosaic kernels with the opt-in atomic dQ backward
# (MosaicBlockSizes.atomic_dq), default tiles otherwise. jflash_nondet: the
# default choice with deterministic_grads=False (atomic dQ only where
# config.atomic_dq_where_faster takes it).
IMPLS = ("triton", "mosaic", "mosaic_atomic", "jflash", "jflash_nondet",
         "cudnn", "xla", "mha", "tokamax")
PASSES = ("fwd", "fwd+bwd")
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark shape: [batch, seq_len, num_heads, head_dim], kv heads.

  q and the cotangent are [batch, seq_len, num_heads, head_dim]; k and v are
  [batch, seq_len, num_kv_heads, head_dim]. `num_kv_heads=None` means
  `num_heads` (no grouped-query attention) and is replaced by it on creation.
  """

  batch: int
  seq_len: int
  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None

  def __post_init__(self):
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)

  def __str__(self) -> str:
    text = f"{self.batch},{self.seq_len},{self.num_heads},{self.head_dim}"
    if self.num_kv_heads != self.num_heads:
      text += f",{self.num_kv_heads}"
    return text


def parse_shape(text: str) -> Shape:
  """Parses `B,N,H,D` or `B,N,H,D,K` into a `Shape`; argparse reports errors."""
  parts = text.split(",")
  if len(parts) not in (4, 5):
    raise argparse.ArgumentTypeError(
        f"expected B,N,H,D or B,N,H,D,K, got {text!r}")
  try:
    values = [int(p) for p in parts]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected integers, got {text!r}")
  if min(values) <= 0:
    raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
  shape = Shape(*values)
  if shape.num_heads % shape.num_kv_heads:
    raise argparse.ArgumentTypeError(
        f"heads H={shape.num_heads} must be a multiple of kv heads "
        f"K={shape.num_kv_heads}, got {text!r}")
  return shape


def parse_impls(text: str) -> list[str]:
  impls = [s.strip() for s in text.split(",") if s.strip()]
  unknown = sorted(set(impls) - set(IMPLS))
  if unknown or not impls:
    raise argparse.ArgumentTypeError(
        f"--impls takes a comma-separated subset of {IMPLS}, got {text!r}")
  return impls


@dataclasses.dataclass(frozen=True)
class Preset:
  """Defaults for --shapes, --dtype and --impls."""

  shapes: tuple[Shape, ...]
  dtypes: tuple[str, ...]
  impls: tuple[str, ...]


SWEEP_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_TOKENS = 16384  # B * N of every sweep shape (B >= 1).


def _sweep_shapes() -> tuple[Shape, ...]:
  shapes = [Shape(max(1, SWEEP_TOKENS // n), n, 16, head_dim)
            for head_dim in (64, 128, 256) for n in SWEEP_SEQ_LENS]
  shapes += [Shape(max(1, SWEEP_TOKENS // n), n, 32, 128, 8)
             for n in (2048, 8192)]
  return tuple(shapes)


PRESETS = {
    "quick": Preset(
        shapes=tuple(parse_shape(s) for s in
                     ("1,8192,16,128", "4,2048,16,128", "2,4096,16,64")),
        dtypes=("bfloat16",),
        impls=("triton", "cudnn", "xla")),
    "sweep": Preset(
        shapes=_sweep_shapes(),
        dtypes=("bfloat16", "float16"),
        impls=IMPLS),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n", 1)[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument(
      "--preset", choices=tuple(PRESETS), default="quick",
      help="default shapes, dtypes and impls (see the module docstring)")
  parser.add_argument(
      "--shapes", nargs="+", type=parse_shape,
      help="shapes as B,N,H,D or B,N,H,D,K (batch, seq len, heads, head dim, "
      "kv heads); default: the preset's")
  parser.add_argument("--causal", choices=("both", "yes", "no"),
                      default="both")
  parser.add_argument("--dtype", nargs="+", choices=DTYPES,
                      help="one or more dtypes; default: the preset's")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed calls after compilation")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed repeats; the median is reported")
  parser.add_argument("--iters", type=int, default=10,
                      help="back-to-back calls per timed repeat")
  parser.add_argument("--impls", type=parse_impls,
                      help="comma-separated subset of " + ",".join(IMPLS)
                      + "; default: the preset's")
  parser.add_argument("--skip-xla-above", type=int, default=8192,
                      metavar="N",
                      help="skip the xla implementation for seq len > N "
                      "(it materializes [N, N] scores)")
  parser.add_argument("--json", metavar="PATH",
                      help="also write all numbers to this JSON file")
  parser.add_argument("--plot", metavar="PATH.png",
                      help="also plot TFLOP/s against N into this PNG file")
  parser.add_argument("--progress", action=argparse.BooleanOptionalAction,
                      default=True, help="progress bar on stderr")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run without a GPU (smoke test; pass tiny shapes)")
  args = parser.parse_args(argv)
  for name in ("repeats", "iters"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1")
  if args.warmup < 0:
    parser.error("--warmup must be >= 0")
  preset = PRESETS[args.preset]
  if args.shapes is None:
    args.shapes = list(preset.shapes)
  if args.dtype is None:
    args.dtype = list(preset.dtypes)
  if args.impls is None:
    args.impls = list(preset.impls)
  # Repeats would only time the same case twice and confuse the ratios.
  args.dtype = list(dict.fromkeys(args.dtype))
  args.impls = list(dict.fromkeys(args.impls))
  return args


def attention_fn(impl: str, is_causal: bool) -> Callable[..., jax.Array]:
  """Returns `f(q, k, v) -> out` for one implementation."""
  if impl in ("triton", "mosaic", "mosaic_atomic", "jflash",
              "jflash_nondet"):
    # Imported only when asked for, so the script runs (e.g. `--impls xla`)
    # while jflash itself is broken or absent.
    import jflash  # pylint: disable=g-import-not-at-top

    # Off the GPU the Triton kernels only run in the Pallas interpreter.
    options = {}
    if impl == "triton" and jax.default_backend() != "gpu":
      options["interpret"] = True
    # "jflash": the default choice (implementation=None), per pass.
    implementation = {"jflash": None, "jflash_nondet": None,
                      "mosaic_atomic": "mosaic"}.get(impl, impl)

    def f(q, k, v):
      more = dict(options)
      if impl == "mosaic_atomic":
        # pylint: disable-next=g-import-not-at-top
        from jflash._src.backends.mosaic import config as mosaic_config
        more["block_sizes"] = dataclasses.replace(
            mosaic_config.default_block_sizes(q.shape[-1]), atomic_dq=True)
        more["deterministic_grads"] = False
      if impl == "jflash_nondet":
        more["deterministic_grads"] = False
      return jflash.flash_attention(
          q, k, v, is_causal=is_causal, implementation=implementation,
          **more)
    return f

  if impl == "mha":
    with warnings.catch_warnings():  # The module warns that it is deprecated.
      warnings.simplefilter("ignore", DeprecationWarning)
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental.pallas.ops.gpu import attention

    def f(q, k, v):
      # mha indexes k and v with the query head, so fewer kv heads would be
      # read out of bounds rather than rejected: refuse them here.
      if k.shape[2] != q.shape[2]:
        raise NotImplementedError(
            f"mha has no grouped-query attention: {q.shape[2]=} query heads, "
            f"{k.shape[2]=} kv heads")
      return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                           causal=is_causal)
    return f

  if impl == "tokamax":
    try:
      import tokamax  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          "--impls tokamax needs the tokamax package (pip install tokamax); "
          f"importing it failed: {e}") from e

    def f(q, k, v):
      return tokamax.dot_product_attention(
          q, k, v, is_causal=is_causal, implementation="mosaic")
    return f

  def f(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=is_causal, implementation=impl)
  return f


def make_step(attn: Callable[..., jax.Array], pass_: str) -> Callable[..., Any]:
  """Jits the forward, or forward+backward, of `attn` as `step(q, k, v, ct)`."""
  if pass_ == "fwd":
    return jax.jit(lambda q, k, v, ct: attn(q, k, v))

  def loss(q, k, v, ct):
    out = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def time_step(step: Callable[..., Any], inputs: tuple[jax.Array, ...],
              warmup: int, repeats: int, iters: int) -> tuple[float, float]:
  """Returns (compile+first call seconds, median per-call seconds)."""
  start = time.perf_counter()
  jax.block_until_ready(step(*inputs))
  first = time.perf_counter() - start
  for _ in range(warmup):
    jax.block_until_ready(step(*inputs))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = step(*inputs)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / iters)
  return first, statistics.median(per_call)


def balanced_orders(count: int) -> list[list[int]]:
  """Orders of `count` calls for interleaved timing rounds in which every
  call is timed right after every other one equally often (a Williams
  design: `count` rounds for an even count, 2 * count for an odd one).

  On a power-capped GPU a call starts at the clock its predecessor left: in
  an A/A test four copies of one FP8 kernel came out up to 3.6% apart, the
  one timed after cuDNN's kernel the slowest, in a fixed order and in a
  rotated one alike (a rotation keeps every call's predecessor); in this
  order within 0.13% (RECORD 2026-11-26, "an A/A test of the
  interleaved-rounds harness", "the balanced order checked").
  """
  if count == 0:
    return []
  first, low, high = [0], 1, count - 1
  while len(first) < count:
    if len(first) % 2:
      first.append(low)
      low += 1
    else:
      first.append(high)
      high -= 1
  orders = [[(i + shift) % count for i in first] for shift in range(count)]
  if count % 2:
    orders += [order[::-1] for order in orders]
  return orders


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
  """The order of `names` in each of `rounds` interleaved timing rounds
  (`balanced_orders`, cycled): use a multiple of `len(balanced_orders(
  len(names)))` rounds for a balanced run."""
  orders = balanced_orders(len(names)) or [[]]  # No names: empty rounds.
  return [[names[i] for i in orders[r % len(orders)]] for r in range(rounds)]


def step_memory_bytes(step: Callable[..., Any],
                      inputs: tuple[jax.Array, ...]) -> int | None:
  """Device memory one call of the jitted `step` needs, from XLA, if known.

  Arguments + outputs + temporaries - buffers aliased between arguments and
  outputs, from the compiled executable's memory analysis: the footprint of
  this call alone, unlike the process-wide `peak_bytes_in_use`. Unused
  arguments (the cotangent of the forward step) are pruned by `jax.jit` and
  not counted. Lowering and compiling again hits JAX's cache after a call.
  """
  try:
    stats = step.lower(*inputs).compile().memory_analysis()
  except Exception:  # pylint: disable=broad-exception-caught
    return None
  if stats is None:
    return None
  return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
          + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def flops(shape: Shape, is_causal: bool, pass_: str) -> float:
  """FLOPs of one call: 4*B*H*N^2*D forward, /2 causal, x3.5 fwd+bwd.

  H counts query heads: grouped-query attention does the same matmul work as
  multi-head attention, it only reads fewer k and v heads.
  """
  f = 4.0 * shape.batch * shape.num_heads * shape.seq_len**2 * shape.head_dim
  if is_causal:
    f *= 0.5
  if pass_ == "fwd+bwd":
    f *= 3.5
  return f


def peak_bytes(device: jax.Device) -> int | None:
  """Peak device memory so far (cumulative over the process), if known."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-exception-caught
    return None
  if not stats:
    return None
  return stats.get("peak_bytes_in_use")


def short_error(e: BaseException, limit: int = 200) -> str:
  """First line of an exception, shortened for a table cell."""
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def git_commit() -> str | None:
  """The checkout's commit (with '-dirty' if modified), best effort."""
  try:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True,
        text=True, check=True, timeout=10).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except Exception:  # pylint: disable=broad-exception-caught
    return None
  return commit + ("-dirty" if dirty else "")


def random_inputs(key: jax.Array, shape: Shape,
                  dtype: jnp.dtype) -> tuple[jax.Array, ...]:
  """Random normal (q, k, v, cotangent); k and v have the kv heads.

  Never zeros: zeros let the softmax and the matmuls take shortcuts nothing
  in real use takes.
  """
  q_dims = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
  kv_dims = (shape.batch, shape.seq_len, shape.num_kv_heads, shape.head_dim)
  keys = jax.random.split(key, 4)
  return tuple(jax.random.normal(k, dims, dtype) for k, dims in
               zip(keys, (q_dims, kv_dims, kv_dims, q_dims)))


def run_case(shape: Shape, is_causal: bool, impl: str, dtype: jnp.dtype,
             args: argparse.Namespace, inputs: tuple[jax.Array, ...],
             device: jax.Device) -> list[dict[str, Any]]:
  """Times both passes of one implementation on one shape; never raises."""
  rows = []
  for pass_ in PASSES:
    row = {
        "shape": str(shape), "batch": shape.batch, "seq_len": shape.seq_len,
        "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "causal": is_causal,
        "dtype": jnp.dtype(dtype).name, "pass": pass_, "impl": impl,
        "ms": None, "tflops": None, "vs_cudnn": None, "vs_mha": None,
        "compile_s": None, "mem_mib": None, "peak_mib": None, "error": None,
    }
    rows.append(row)
    if impl == "xla" and shape.seq_len > args.skip_xla_above:
      row["error"] = f"skipped: N={shape.seq_len} > --skip-xla-above"
      continue
    try:
      step = make_step(attention_fn(impl, is_causal), pass_)
      first, per_call = time_step(step, inputs, args.warmup, args.repeats,
                                  args.iters)
    except Exception as e:  # pylint: disable=broad-exception-caught
      row["error"] = short_error(e)
      continue
    finally:
      peak = peak_bytes(device)
      row["peak_mib"] = None if peak is None else peak / 2**20
    row["compile_s"] = first
    row["ms"] = per_call * 1e3
    row["tflops"] = flops(shape, is_causal, pass_) / per_call / 1e12
    mem = step_memory_bytes(step, inputs)
    row["mem_mib"] = None if mem is None else mem / 2**20
  return rows


def add_ratios(case_rows: list[dict[str, Any]]) -> None:
  """Fills `vs_cudnn` (every row) and `vs_mha` (triton rows) of one case."""
  for pass_ in PASSES:
    ref = {r["impl"]: r["tflops"] for r in case_rows if r["pass"] == pass_}
    for r in case_rows:
      if r["pass"] != pass_ or not r["tflops"]:
        continue
      if ref.get("cudnn"):
        r["vs_cudnn"] = r["tflops"] / ref["cudnn"]
      if r["impl"] == "triton" and ref.get("mha"):
        r["vs_mha"] = r["tflops"] / ref["mha"]


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
  return "-" if value is None else format(value, spec) + suffix


def format_table(rows: list[dict[str, Any]]) -> str:
  header = (f"{'shape B,N,H,D[,K]':<17} {'dtype':<8} {'causal':<6} "
            f"{'pass':<8} {'impl':<7} {'ms':>9} {'TFLOP/s':>8} "
            f"{'vs cuDNN':>8} {'vs mha':>7} {'mem MiB':>9}  error")
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
        f"{r['shape']:<17} {r['dtype']:<8} {str(r['causal']):<6} "
        f"{r['pass']:<8} {r['impl']:<7} {fmt(r['ms'], '.3f'):>9} "
        f"{fmt(r['tflops'], '.2f'):>8} {fmt(r['vs_cudnn'], '.2f', 'x'):>8} "
        f"{fmt(r['vs_mha'], '.2f', 'x'):>7} {fmt(r['mem_mib'], '.1f'):>9}  "
        f"{r['error'] or ''}".rstrip())
  return "\n".join(lines)


def print_table(rows: list[dict[str, Any]]) -> None:
  print(format_table(rows))


_IMPL_COLORS = {"triton": "C0", "cudnn": "C1", "xla": "C2", "mha": "C3"}
_DTYPE_STYLES = {"bfloat16": "-", "float16": "--", "float32": ":"}
_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
  """Writes TFLOP/s against N, one panel per (head dim, causal, pass).

  Panels form a grid: a row per head dim, a column per (causal, pass) pair
  present in the results. Colour is the implementation, line style the dtype,
  marker the (query heads, kv heads) pair.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")  # Files only; no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  ok = [r for r in rows if r["tflops"]]
  head_dims = sorted({r["head_dim"] for r in ok}) or [None]
  columns = sorted({(r["causal"], r["pass"]) for r in ok},
                   key=lambda c: (c[0], PASSES.index(c[1]))) or [None]
  dtypes = sorted({r["dtype"] for r in ok})
  heads = sorted({(r["num_heads"], r["num_kv_heads"]) for r in ok})

  fig, axes = plt.subplots(
      len(head_dims), len(columns), squeeze=False,
      figsize=(4.2 * len(columns), 3.4 * len(head_dims)))
  fig.suptitle(f"{meta['device_kind']} ({meta['backend']}), "
               f"{meta['date'][:10]}: TFLOP/s (4·B·H·N²·D, x0.5 causal, "
               "x3.5 fwd+bwd)")
  legend = {}
  for i, head_dim in enumerate(head_dims):
    for j, column in enumerate(columns):
      ax = axes[i][j]
      panel = [r for r in ok if column is not None
               and (r["head_dim"], r["causal"], r["pass"])
               == (head_dim, *column)]
      if not panel:
        ax.axis("off")
        continue
      series = collections.defaultdict(list)
      for r in panel:
        series[(r["impl"], r["dtype"], r["num_heads"],
                r["num_kv_heads"])].append(r)
      for (impl, dtype, h, k), points in sorted(
          series.items(), key=lambda s: (IMPLS.index(s[0][0]), s[0][1:])):
        points.sort(key=lambda r: (r["seq_len"], r["batch"]))
        label = impl
        if len(dtypes) > 1:
          label += f" {dtype}"
        if len(heads) > 1:
          label += f" H{h}/K{k}"
        (line,) = ax.plot(
            [r["seq_len"] for r in points], [r["tflops"] for r in points],
            color=_IMPL_COLORS[impl], linestyle=_DTYPE_STYLES.get(dtype, "-"),
            marker=_MARKERS[heads.index((h, k)) % len(_MARKERS)],
            markersize=4, label=label)
        legend.setdefault(label, line)
      causal, pass_ = column
      ax.set_title(f"D={head_dim}, {'causal' if causal else 'non-causal'}, "
                   f"{pass_}", fontsize=10)
      seq_lens = sorted({r["seq_len"] for r in panel})
      ax.set_xscale("log", base=2)
      ax.xaxis.set_major_locator(ticker.FixedLocator(seq_lens))
      ax.xaxis.set_minor_locator(ticker.NullLocator())
      ax.xaxis.set_major_formatter(ticker.FuncFormatter(
          lambda n, _: f"{int(n) // 1024}k" if n >= 1024 and n % 1024 == 0
          else f"{int(n)}"))
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
      if i == len(head_dims) - 1:
        ax.set_xlabel("N (sequence length)")
      if j == 0:
        ax.set_ylabel("TFLOP/s")
  if legend:
    fig.legend(legend.values(), legend.keys(), loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize=9)
  else:
    fig.text(0.5, 0.5, "no successful rows", ha="center", va="center")
  fig.tight_layout()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


def main(argv: list[str]) -> int:
  args = parse_args(argv[1:])
  backend = jax.default_backend()
  if backend != "gpu" and not args.allow_cpu:
    print(f"benchmarks/run.py needs a GPU, but JAX's default backend is "
          f"{backend!r} (devices: {jax.devices()}). Install jax[cuda13] on a "
          f"GPU machine, or pass --allow-cpu with tiny --shapes for a smoke "
          f"test.", file=sys.stderr)
    return 2

  device = jax.devices()[0]
  causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}
  meta = {
      "device_kind": device.device_kind,
      "backend": backend,
      "jax_version": jax.__version__,
      "jaxlib_version": package_version("jaxlib"),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": shlex.join([sys.executable] + argv),
      "git_commit": git_commit(),
      "preset": args.preset,
      "dtypes": args.dtype,
      "impls": args.impls,
      "timing": (f"median over {args.repeats} repeats of {args.iters} calls, "
                 f"after {args.warmup} warmup calls"),
      "flops": "4*B*H*N^2*D (H query heads), x0.5 causal, x3.5 fwd+bwd",
      "memory": ("mem_mib: compiled step's arguments + outputs + temporaries "
                 "- aliases (per call); peak_mib: process-wide peak so far"),
  }
  for k, v in meta.items():
    print(f"{k:>15}: {v}")
  print(flush=True)

  cases = [(shape, dtype, is_causal)
           for shape in args.shapes for dtype in args.dtype
           for is_causal in causal_values[args.causal]]
  progress = tqdm.tqdm(total=len(cases) * len(args.impls), unit="case",
                       file=sys.stderr, disable=not args.progress,
                       dynamic_ncols=True)
  rows = []
  key = jax.random.key(args.seed)
  inputs, inputs_for = None, None  # inputs_for: (shape, dtype) of `inputs`.
  for shape, dtype_name, is_causal in cases:
    dtype = jnp.dtype(dtype_name)
    if inputs_for != (shape, dtype_name):
      # Fresh random inputs per shape and dtype; drop the old ones first.
      inputs = None
      key, subkey = jax.random.split(key)
      inputs = random_inputs(subkey, shape, dtype)
      jax.block_until_ready(inputs)
      inputs_for = (shape, dtype_name)
    case_rows = []
    for impl in args.impls:
      progress.set_postfix_str(
          f"{shape} {dtype_name} causal={is_causal} {impl}", refresh=True)
      case_rows += run_case(shape, is_causal, impl, dtype, args, inputs,
                            device)
      progress.update()
    add_ratios(case_rows)
    case_rows.sort(key=lambda r: (PASSES.index(r["pass"]),
                                  args.impls.index(r["impl"])))
    rows += case_rows
    # tqdm.write clears and redraws the bar around the table.
    tqdm.tqdm.write(format_table(case_rows) + "\n", file=sys.stdout)
    sys.stdout.flush()
  progress.close()
  inputs = None

  print("All rows:")
  print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.json}")
  if args.plot:
    plot(rows, meta, args.plot)
    print(f"wrote {args.plot}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
