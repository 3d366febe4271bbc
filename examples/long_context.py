"""Example 3: memory and time of attention as the context grows.

For growing sequence lengths N, compiles forward + backward (`jax.grad` of a
scalar loss, under `jax.jit`) of `jflash.flash_attention` and of the default
`jax.nn.dot_product_attention` (implementation="xla", which materializes the
[N, N] attention matrix), and measures for each:

- memory: what XLA's compiled memory analysis
  (`jit(f).lower(...).compile().memory_analysis()`) says the program needs:
  arguments + outputs + temporaries (minus aliased buffers). It is computed
  at compile time, so it works on CPU and GPU alike and even for programs
  too big to run.
- time: the median over a few calls on fresh random inputs, each call
  waited for with `block_until_ready`.

It prints a table and one sentence on where jflash's benefit begins among
the lengths it measured, and saves a two-panel log-log plot to `--out`
(default: bench_out/long_context.png in the repository, which git ignores).

Run:
  python examples/long_context.py                # GPU: N = 1k ... 32k
  python examples/long_context.py --quick        # seconds: two lengths
  python examples/long_context.py --lengths 512 2048 --out /tmp/lc.png

The XLA path is not run where its compiled program would need more than
`--xla-limit-gb` (default 40), or where it runs out of memory; its memory is
still reported where it compiled. Without a GPU the script falls back to
N = 128 ... 2048 (under a minute; --quick: N = 128 and 512, seconds) and runs
jflash's Pallas kernels through the interpreter (`interpret=True`), so its
times there measure the interpreter, not the kernels, and jflash is the
slower one; the memory comparison still holds: from N = 256 on (4 heads of
64, float32) XLA's program, which stores the [N, N] scores, needs more
memory than jflash's: 1.2x as much at N = 256, 4.5x at N = 2048.
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
import matplotlib

matplotlib.use("Agg")  # Files only; no display needed.
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib import ticker  # pylint: disable=g-import-not-at-top

import jflash

GPU_SETTINGS = dict(lengths=[1024, 2048, 4096, 8192, 16384, 32768], batch=1,
                    heads=16, head_dim=128, dtype="bfloat16", repeats=3)
# On CPU the interpreter's times are not the point (one call each); memory
# is: XLA's [N, N] scores outgrow jflash's linear memory from N = 256 on.
CPU_SETTINGS = dict(lengths=[128, 256, 512, 1024, 2048], batch=1, heads=4,
                    head_dim=64, dtype="float32", repeats=1)
# --quick (tests): one length each side of where the benefit begins on CPU.
QUICK_LENGTHS = dict(gpu=[1024, 4096], cpu=[128, 512])
# Inside the repository (bench_out/ is in .gitignore), beside examples/.
DEFAULT_OUT = os.path.normpath(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "bench_out",
    "long_context.png"))
MIB = 2**20


def loss_gradient(attention):
  """Returns grad(sum(attention(q, k, v) * cotangent)) w.r.t. q, k, v."""

  def loss(q, k, v, cotangent):
    out = attention(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def random_inputs(key, shape, dtype):
  """q, k, v and a cotangent, all [batch, seq_len, heads, head_dim]."""
  return tuple(jax.random.normal(k, shape, dtype)
               for k in jax.random.split(key, 4))


def program_bytes(compiled) -> int | None:
  """Arguments + outputs + temporaries of a compiled program, in bytes."""
  stats = compiled.memory_analysis()
  if stats is None:  # Not every backend reports it.
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def measure(attention, shape, dtype, *, repeats: int, seed: int,
            limit_bytes: float | None) -> dict[str, Any]:
  """Compiles fwd+bwd once; returns its memory, median time and status."""
  inputs = jax.jit(random_inputs, static_argnums=(1, 2))
  args = inputs(jax.random.key(seed), shape, dtype)
  try:
    compiled = jax.jit(loss_gradient(attention)).lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:  # E.g. out of memory compiling.
    return dict(bytes=None, seconds=None, status=f"compile failed: {e}"[:80])
  size = program_bytes(compiled)
  if limit_bytes is not None and size is not None and size > limit_bytes:
    return dict(bytes=size, seconds=None,
                status=f"not run: needs {size / 2**30:.2f} GiB")
  times = []
  try:
    jax.block_until_ready(compiled(*args))  # Warm-up.
    for i in range(repeats):
      args = jax.block_until_ready(
          inputs(jax.random.key(seed + 1 + i), shape, dtype))
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - start)
  except jax.errors.JaxRuntimeError as e:  # Out of memory at run time.
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return dict(bytes=size, seconds=None, status="out of memory")
  return dict(bytes=size, seconds=statistics.median(times), status="ok")


def nan_if_none(value, scale: float) -> float:
  return float("nan") if value is None else value * scale


def plot(results, path: str, title: str):
  """Two log-log panels: memory vs N and time vs N."""
  fig, (ax_memory, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
  lengths = [r["seq_len"] for r in results]
  for name, marker in (("jflash", "o"), ("xla", "s")):
    label = "jflash.flash_attention" if name == "jflash" else \
        "jax.nn.dot_product_attention (xla)"
    # Memory is known from compiling, even where the program was not run.
    memory = [nan_if_none(r[name]["bytes"], 1 / MIB) for r in results]
    times = [nan_if_none(r[name]["seconds"], 1e3) for r in results]
    ax_memory.plot(lengths, memory, marker=marker, label=label)
    ax_time.plot(lengths, times, marker=marker, label=label)
    not_run = [(n, m) for n, m, r in zip(lengths, memory, results)
               if r[name]["seconds"] is None and not math.isnan(m)]
    if not_run:
      ax_memory.scatter(*zip(*not_run), s=90, facecolors="none",
                        edgecolors="red", zorder=3,
                        label=f"{name}: compiled, not run")
  for ax, ylabel in ((ax_memory, "compiled memory, fwd+bwd (MiB)"),
                     (ax_time, "time, fwd+bwd (ms, median)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%d"))
    ax.yaxis.set_major_formatter(ticker.LogFormatter())
    ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def first_of_lasting(lengths, wins) -> int | None:
  """The first of increasing `lengths` from which `wins` holds to the end."""
  first = None
  for seq_len, win in zip(lengths, wins):
    if not win:
      first = None
    elif first is None:
      first = seq_len
  return first


def benefit_sentence(results, *, interpreted: bool) -> str:
  """One sentence: from which measured N on jflash needs less memory than
  XLA (and runs faster, when its kernels were compiled)."""
  results = sorted(results, key=lambda r: r["seq_len"])
  memory = {r["seq_len"]: (r["jflash"]["bytes"], r["xla"]["bytes"])
            for r in results}
  known = [n for n, sizes in memory.items() if None not in sizes]
  first = first_of_lasting(known, [memory[n][0] < memory[n][1]
                                   for n in known])
  if not known:
    memory_part = "this backend reports no compiled memory"
  elif first is None:
    memory_part = (f"jflash's compiled fwd+bwd needs no less memory than "
                   f"XLA's up to the largest length measured, N = "
                   f"{known[-1]} (XLA's [N, N] scores dominate at larger N)")
  else:
    # Where the first length measured already wins, the benefit may begin
    # below it: say so rather than name it as the start.
    where = (f"from N = {first} on" if first != known[0] else
             f"at every length measured (from N = {first})")
    ratio = lambda n: memory[n][1] / memory[n][0]
    memory_part = (f"jflash's compiled fwd+bwd needs less memory than XLA's "
                   f"{where}: XLA's needs {ratio(first):.1f}x as much at "
                   f"N = {first}")
    if known[-1] != first:
      memory_part += f", {ratio(known[-1]):.1f}x at N = {known[-1]}"
  if interpreted:
    time_part = ("its times measure the Pallas interpreter, not the kernels, "
                 "so they are not compared")
  else:
    timed = [r for r in results
             if None not in (r["jflash"]["seconds"], r["xla"]["seconds"])]
    faster = first_of_lasting(
        [r["seq_len"] for r in timed],
        [r["jflash"]["seconds"] < r["xla"]["seconds"] for r in timed])
    if faster is None:
      time_part = "it is not faster at the lengths where both ran"
    elif faster == timed[0]["seq_len"]:
      time_part = "it is faster at every length where both ran"
    else:
      time_part = f"it is faster from N = {faster} on"
  return f"Benefit: {memory_part}; {time_part}."


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog="Without a GPU, --lengths, --batch, --heads, --head-dim, "
      "--dtype and --repeats default to CPU sizes (N = "
      + " ".join(map(str, CPU_SETTINGS["lengths"])) + ").")
  parser.add_argument("--lengths", type=int, nargs="+",
                      help="sequence lengths N; default: "
                      + " ".join(map(str, GPU_SETTINGS["lengths"]))
                      + " on a GPU")
  parser.add_argument("--quick", action="store_true",
                      help="two lengths, one call each (seconds on CPU; N = "
                      + " and ".join(map(str, QUICK_LENGTHS["cpu"]))
                      + " there, "
                      + " and ".join(map(str, QUICK_LENGTHS["gpu"]))
                      + " on a GPU)")
  parser.add_argument("--batch", type=int, help="batch size")
  parser.add_argument("--heads", type=int, help="attention heads")
  parser.add_argument("--head-dim", type=int, help="dimension of each head")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="dtype of q, k, v")
  parser.add_argument("--causal", action=argparse.BooleanOptionalAction,
                      default=True, help="causal attention")
  parser.add_argument("--repeats", type=int,
                      help="timed calls per point (median reported); "
                      "default: 3 on a GPU, 1 elsewhere")
  parser.add_argument("--xla-limit-gb", type=float, default=40.0,
                      help="do not run the XLA path where its compiled program "
                      "needs more than this many GiB (default: %(default)s)")
  parser.add_argument("--interpret", action=argparse.BooleanOptionalAction,
                      help="run jflash's kernels through the Pallas "
                      "interpreter; default: on without a GPU")
  parser.add_argument("--out", default=DEFAULT_OUT,
                      help="where to save the plot (PNG); default: %(default)s")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the random inputs")
  return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Measures, prints the table, saves the plot; returns the results."""
  args = parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu:
    print("No GPU found: falling back to CPU settings (jflash runs its "
          "kernels through the Pallas interpreter, so its times measure the "
          "interpreter; the memory comparison holds).")
  if args.quick:
    if args.lengths is None:
      args.lengths = QUICK_LENGTHS["gpu" if on_gpu else "cpu"]
    if args.repeats is None:
      args.repeats = 1
  for name, value in (GPU_SETTINGS if on_gpu else CPU_SETTINGS).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.interpret is None:
    args.interpret = not on_gpu
  dtype = jnp.dtype(args.dtype)
  limit_bytes = args.xla_limit_gb * 2**30

  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind})")
  print(f"fwd+bwd of attention, batch={args.batch} heads={args.heads} "
        f"head_dim={args.head_dim} {dtype.name} causal={args.causal}; "
        f"jflash {'interpreted' if args.interpret else 'compiled'}")
  print("memory = arguments + outputs + temporaries of the compiled program "
        "(XLA memory analysis)")

  implementations = {
      "jflash": functools.partial(jflash.flash_attention,
                                  is_causal=args.causal,
                                  interpret=args.interpret),
      "xla": functools.partial(jax.nn.dot_product_attention,
                               is_causal=args.causal, implementation="xla"),
  }
  header = (f"{'N':>7} | {'jflash ms':>10} {'xla ms':>10} | "
            f"{'jflash MiB':>11} {'xla MiB':>11} | xla/jflash memory")
  print(header)
  print("-" * len(header))
  results = []
  for seq_len in args.lengths:
    shape = (args.batch, seq_len, args.heads, args.head_dim)
    row = dict(seq_len=seq_len)
    for name, attention in implementations.items():
      row[name] = measure(
          attention, shape, dtype, repeats=args.repeats, seed=args.seed,
          limit_bytes=limit_bytes if name == "xla" else None)
    results.append(row)
    cells = []
    for key, scale, fmt in (("seconds", 1e3, "10.2f"), ("bytes", 1 / MIB,
                                                        "11.1f")):
      for name in implementations:
        value = row[name][key]
        width = int(fmt.split(".")[0])
        cells.append(format(value * scale, fmt) if value is not None
                     else "-".rjust(width))
    ratio = ("-" if None in (row["xla"]["bytes"], row["jflash"]["bytes"])
             else f"{row['xla']['bytes'] / row['jflash']['bytes']:.1f}x")
    notes = [f"{name}: {row[name]['status']}" for name in implementations
             if row[name]["status"] != "ok"]
    print(f"{seq_len:>7} | {cells[0]} {cells[1]} | {cells[2]} {cells[3]} | "
          f"{ratio}" + (f"  ({'; '.join(notes)})" if notes else ""))

  title = (f"attention fwd+bwd on {device.device_kind}: B={args.batch} "
           f"H={args.heads} D={args.head_dim} {dtype.name}"
           + (" causal" if args.causal else "")
           + (" (jflash interpreted)" if args.interpret else ""))
  print(benefit_sentence(results, interpreted=args.interpret))
  out_dir = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(out_dir, exist_ok=True)
  plot(results, args.out, title)
  print(f"plot saved to {os.path.abspath(args.out)}")
  return dict(results=results, out=args.out)


if __name__ == "__main__":
  main()
