"""Merges benchmark JSON files into one markdown table and one plot.

  python3 benchmarks/summarize.py benchmarks/results/sweep_*.json \\
      --plot benchmarks/results/sweep.png

Prints, per case, jflash's TFLOP/s with its ratios to cuDNN and to JAX's
Pallas reference `mha` measured in the same run (the JSON files come from
`benchmarks/run.py --json`). Needs no GPU.
"""

import argparse
import json
import sys

from benchmarks import run as bench


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("files", nargs="+")
  parser.add_argument("--plot", metavar="PATH.png")
  args = parser.parse_args(argv[1:])
  rows, metas = [], []
  for path in args.files:
    with open(path) as f:
      data = json.load(f)
    rows += data["rows"]
    metas.append(data["meta"])
  meta = dict(metas[0])
  meta["command"] = " ; ".join(m["command"] for m in metas)
  print(f"{meta['device_kind']}, jax {meta['jax_version']}, "
        f"{meta['date'][:10]}, {meta['timing']}\n")
  print("| B,N,H,D[,K] | dtype | causal | pass | jflash TFLOP/s | vs cuDNN "
        "| vs mha |")
  print("|---|---|---|---|---|---|---|")
  for row in rows:
    if row["impl"] != "triton":
      continue
    fmt = lambda x, spec: "-" if x is None else format(x, spec) + "x"
    tflops = (f"{row['tflops']:.0f}" if row["error"] is None
              else row["error"][:40])
    print(f"| {row['shape']} | {row['dtype']} | {'yes' if row['causal'] else 'no'} "
          f"| {row['pass']} | {tflops} | {fmt(row['vs_cudnn'], '.2f')} "
          f"| {fmt(row['vs_mha'], '.2f')} |")
  if args.plot:
    bench.plot(rows, meta, args.plot)
    print(f"\nwrote {args.plot}")


if __name__ == "__main__":
  main(sys.argv)
