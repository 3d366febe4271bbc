"""Times jflash against cuDNN and XLA attention on one GPU, side by side.

All implementations run in one process on the same inputs, forward and
forward+backward (`jax.grad` of `sum(out * cotangent)` with respect to q, k and
v), each under `jax.jit`:

  triton: `jflash.flash_attention(..., implementation="triton")`
  cudnn:  `jax.nn.dot_product_attention(..., implementation="cudnn")`
  xla:    `jax.nn.dot_product_attention(..., implementation="xla")`; it
          materializes the [N, N] scores, so it is skipped above
          --skip-xla-above.
  mha:    JAX's deprecated Pallas-Triton reference,
          `jax.experimental.pallas.ops.gpu.attention.mha` with its default
          tiles and `sm_scale=1/sqrt(D)` (needs N to be a multiple of 128).

Usage, from the repository root:

  PYTHONPATH=. python3 benchmarks/run.py --json bench.json
  PYTHONPATH=. python3 benchmarks/run.py --shapes 1,8192,16,128 --causal yes

Shapes are `B,N,H,D`: batch, sequence length (queries and keys), heads, head
dimension. Per-call time is the median over --repeats of (time of --iters
back-to-back calls) / --iters. TFLOP/s count 4*B*H*N^2*D for the forward pass,
halved when causal, and 3.5x that for forward+backward (the backward pass is
2.5x the forward). Errors of one implementation (e.g. cuDNN not supporting a
shape) are printed in its row instead of stopping the run.

On a machine without a GPU the script exits unless --allow-cpu is given; then
it runs whatever (tiny) shapes are passed, e.g. as a smoke test:

  python3 benchmarks/run.py --allow-cpu --impls xla --shapes 1,128,2,32 \\
      --repeats 2 --iters 2
"""

import argparse
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

IMPLS = ("triton", "cudnn", "xla", "mha")
PASSES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark shape: [batch, seq_len, num_heads, head_dim]."""

  batch: int
  seq_len: int
  num_heads: int
  head_dim: int

  def __str__(self) -> str:
    return f"{self.batch},{self.seq_len},{self.num_heads},{self.head_dim}"


def parse_shape(text: str) -> Shape:
  """Parses `B,N,H,D` into a `Shape`; argparse reports the ValueError."""
  parts = text.split(",")
  if len(parts) != 4:
    raise argparse.ArgumentTypeError(f"expected B,N,H,D, got {text!r}")
  try:
    values = [int(p) for p in parts]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected integers, got {text!r}")
  if min(values) <= 0:
    raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
  return Shape(*values)


def parse_impls(text: str) -> list[str]:
  impls = [s.strip() for s in text.split(",") if s.strip()]
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
      "--shapes", nargs="+", type=parse_shape,
      default=[parse_shape(s) for s in
               ("1,8192,16,128", "4,2048,16,128", "2,4096,16,64")],
      help="shapes as B,N,H,D (batch, seq len, heads, head dim)")
  parser.add_argument("--causal", choices=("both", "yes", "no"),
                      default="both")
  parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                      default="bfloat16")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed calls after compilation")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed repeats; the median is reported")
  parser.add_argument("--iters", type=int, default=10,
                      help="back-to-back calls per timed repeat")
  parser.add_argument("--impls", type=parse_impls,
                      default=["triton", "cudnn", "xla"],
                      help="comma-separated subset of " + ",".join(IMPLS))
  parser.add_argument("--skip-xla-above", type=int, default=8192,
                      metavar="N",
                      help="skip the xla implementation for seq len > N "
                      "(it materializes [N, N] scores)")
  parser.add_argument("--json", metavar="PATH",
                      help="also write all numbers to this JSON file")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run without a GPU (smoke test; pass tiny shapes)")
  args = parser.parse_args(argv)
  for name in ("repeats", "iters"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1")
  if args.warmup < 0:
    parser.error("--warmup must be >= 0")
  return args


def attention_fn(impl: str, is_causal: bool) -> Callable[..., jax.Array]:
  """Returns `f(q, k, v) -> out` for one implementation."""
  if impl == "triton":
    # Imported only when asked for, so the script runs (e.g. `--impls xla`)
    # while jflash itself is broken or absent.
    import jflash  # pylint: disable=g-import-not-at-top

    # Off the GPU the kernels only run in the Pallas interpreter.
    interpret = jax.default_backend() != "gpu"

    def f(q, k, v):
      return jflash.flash_attention(
          q, k, v, is_causal=is_causal, implementation="triton",
          interpret=interpret)
    return f

  if impl == "mha":
    with warnings.catch_warnings():  # The module warns that it is deprecated.
      warnings.simplefilter("ignore", DeprecationWarning)
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental.pallas.ops.gpu import attention

    def f(q, k, v):
      return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                           causal=is_causal)
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


def flops(shape: Shape, is_causal: bool, pass_: str) -> float:
  """FLOPs of one call: 4*B*H*N^2*D forward, /2 causal, x3.5 fwd+bwd."""
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


def run_case(shape: Shape, is_causal: bool, impl: str, dtype: jnp.dtype,
             args: argparse.Namespace, inputs: tuple[jax.Array, ...],
             device: jax.Device) -> list[dict[str, Any]]:
  """Times both passes of one implementation on one shape; never raises."""
  rows = []
  for pass_ in PASSES:
    row = {
        "shape": str(shape), "batch": shape.batch, "seq_len": shape.seq_len,
        "num_heads": shape.num_heads, "head_dim": shape.head_dim,
        "causal": is_causal, "dtype": jnp.dtype(dtype).name, "pass": pass_,
        "impl": impl, "ms": None, "tflops": None, "vs_cudnn": None,
        "compile_s": None, "peak_mib": None, "error": None,
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
  return rows


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
  return "-" if value is None else format(value, spec) + suffix


def print_table(rows: list[dict[str, Any]]) -> None:
  header = (f"{'shape B,N,H,D':<16} {'causal':<6} {'pass':<8} {'impl':<7} "
            f"{'ms':>9} {'TFLOP/s':>8} {'vs cuDNN':>8} {'peak MiB':>9}  error")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['shape']:<16} {str(r['causal']):<6} {r['pass']:<8} "
          f"{r['impl']:<7} {fmt(r['ms'], '.3f'):>9} "
          f"{fmt(r['tflops'], '.2f'):>8} {fmt(r['vs_cudnn'], '.2f', 'x'):>8} "
          f"{fmt(r['peak_mib'], '.0f'):>9}  {r['error'] or ''}".rstrip())


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
  dtype = jnp.dtype(args.dtype)
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
      "timing": (f"median over {args.repeats} repeats of {args.iters} calls, "
                 f"after {args.warmup} warmup calls"),
  }
  for k, v in meta.items():
    print(f"{k:>15}: {v}")
  print("peak MiB is the process-wide peak so far (cumulative), not per row.")
  print(flush=True)

  rows = []
  key = jax.random.key(args.seed)
  for shape in args.shapes:
    # Fresh random inputs per shape (never zeros: zeros let the softmax and
    # the matmuls take shortcuts nothing in real use takes).
    key, *subkeys = jax.random.split(key, 5)
    dims = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
    inputs = tuple(jax.random.normal(k, dims, dtype) for k in subkeys)
    jax.block_until_ready(inputs)
    for is_causal in causal_values[args.causal]:
      case_rows = []
      for impl in args.impls:
        case_rows += run_case(shape, is_causal, impl, dtype, args, inputs,
                              device)
      for pass_ in PASSES:
        ref = next((r["tflops"] for r in case_rows
                    if r["impl"] == "cudnn" and r["pass"] == pass_), None)
        for r in case_rows:
          if r["pass"] == pass_ and ref and r["tflops"]:
            r["vs_cudnn"] = r["tflops"] / ref
      case_rows.sort(key=lambda r: (PASSES.index(r["pass"]),
                                    args.impls.index(r["impl"])))
      rows += case_rows
      print_table(case_rows)
      print(flush=True)
    del inputs

  print("All rows:")
  print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
