"""Times fixed calls of whatever jflash is on PYTHONPATH, cuDNN beside them.

For A/B runs of two source trees in one device call (a refactor that must
not change speed): run this once per tree, alternating, and compare the
ratios to cuDNN, which absorb the device's drift between processes:

  for tree in .baseline . .baseline .; do
    PYTHONPATH=$tree python3 benchmarks/ab_binding.py --label $tree \\
        --json $OUT/ab.jsonl
  done
  python3 benchmarks/ab_binding.py --summarize $OUT/ab.jsonl

Cases (bf16, D=128, 16 heads): 1x8192 causal and not, forward and
forward+backward; 1x4096 with a dense [1, 16, 4096, 4096] bias (forward
tiles 128x64 in both trees); and, where
the tree has the sharding layer, the same 1x8192 call on a one-device
Explicit mesh (shard_map) and Auto mesh. Each time is the median over
--repeats of (--iters back-to-back calls) / --iters after warm-up, on fresh
random inputs.
"""

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def _median_ms(fn, args, repeats: int, iters: int, warmup: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / iters * 1e3)
  return statistics.median(times)


def _step(attention, backward: bool):
  if not backward:
    return jax.jit(attention)

  def loss(q, k, v, dout, *rest):
    return jnp.sum(attention(q, k, v, *rest).astype(jnp.float32) * dout)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _inputs(seq_len: int, seed: int, bias: bool):
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (1, seq_len, 16, 128)
  q, k, v, dout = (jax.random.normal(key, shape, jnp.bfloat16)
                   for key in keys[:4])
  extra = ()
  if bias:
    extra = (jax.random.normal(keys[4], (1, 16, seq_len, seq_len),
                               jnp.bfloat16),)
  return q, k, v, dout, extra


def _cases():
  """(name, seq_len, causal, bias, mesh kind or None)."""
  cases = [(f"plain causal={c}", 8192, c, False, None) for c in (False, True)]
  cases.append(("bias", 4096, False, True, None))
  try:
    import jflash._src.sharding  # noqa: F401  pylint: disable=unused-import
    cases += [(f"mesh {kind}", 8192, False, False, kind)
              for kind in ("explicit", "auto")]
  except ImportError:
    pass
  return cases


def run(label: str, repeats: int, iters: int) -> list[dict]:
  import jflash  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,g-multiple-import
  rows = []
  for seed, (name, seq_len, causal, bias, mesh_kind) in enumerate(_cases()):
    q, k, v, dout, extra = _inputs(seq_len, seed, bias)
    # With a bias: fixed tiles in both trees (128x128 forward tiles with a
    # bias tile exceed an H100's shared memory; the heuristic now counts
    # them, the tree before did not).
    tiles = {} if not bias else dict(block_sizes=jflash.BlockSizes(
        block_q=128, block_k=64, num_warps=8, num_stages=3))
    impls = {
        "jflash": lambda q, k, v, *b, c=causal: jflash.flash_attention(
            q, k, v, *b, is_causal=c, implementation="triton", **tiles),
        "cudnn": lambda q, k, v, *b, c=causal: jax.nn.dot_product_attention(
            q, k, v, *b, is_causal=c, implementation="cudnn"),
    }
    mesh = None
    if mesh_kind is not None:
      mesh = jax.make_mesh(
          (1,), ("data",), devices=jax.devices()[:1],
          axis_types=(AxisType.Explicit if mesh_kind == "explicit"
                      else AxisType.Auto,))
    for impl, attention in impls.items():
      for backward in (False, True):
        args = (q, k, v, dout, *extra) if backward else (q, k, v, *extra)
        with (jax.set_mesh(mesh) if mesh is not None
              else contextlib.nullcontext()):
          if mesh is not None:
            args = tuple(jax.device_put(x, NamedSharding(mesh, P("data")))
                         for x in args)
          ms = _median_ms(_step(attention, backward), args, repeats, iters)
        rows.append(dict(label=label, case=name, impl=impl,
                         pass_="fwd+bwd" if backward else "fwd", ms=ms))
        print(f"{label:10s} {name:22s} {impl:7s} "
              f"{rows[-1]['pass_']:8s} {ms:8.3f} ms", flush=True)
  return rows


def summarize(path: str) -> None:
  """Per case and pass: each label's median ms and jflash / cuDNN time."""
  rows = [json.loads(line) for line in open(path)]
  table = collections.defaultdict(list)
  for row in rows:
    table[(row["label"], row["case"], row["pass_"], row["impl"])].append(
        row["ms"])
  labels = sorted({r["label"] for r in rows})
  print(f"{'case':22s} {'pass':8s} " + " ".join(
      f"{l + ' ms':>12s} {l + ' /cuDNN':>12s}" for l in labels))
  for case, pass_ in sorted({(r["case"], r["pass_"]) for r in rows}):
    cells = []
    for label in labels:
      ours = table.get((label, case, pass_, "jflash"))
      theirs = table.get((label, case, pass_, "cudnn"))
      if not ours:
        cells.append(f"{'-':>12s} {'-':>12s}")
        continue
      ratio = statistics.median(
          o / t for o, t in zip(ours, theirs)) if theirs else float("nan")
      cells.append(f"{statistics.median(ours):12.3f} {ratio:12.3f}")
    print(f"{case:22s} {pass_:8s} " + " ".join(cells))


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--label", default="tree")
  parser.add_argument("--json", help="append rows to this JSON-lines file")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--summarize", metavar="JSONL",
                      help="print the comparison table of a JSON-lines file")
  args = parser.parse_args(argv)
  if args.summarize:
    summarize(args.summarize)
    return
  rows = run(args.label, args.repeats, args.iters)
  if args.json:
    with open(args.json, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])
