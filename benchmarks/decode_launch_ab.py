"""Times the decode kernel under other split counts and launches, against
its default and cuDNN, in interleaved rounds (one process, one GPU).

Usage (repo root, GPU machine):
  PYTHONPATH=. python3 benchmarks/decode_launch_ab.py \\
      --cases 16,16384,64,8 8,8192,32,8 --splits 1 2 3 4 \\
      --launches 64,4,4 128,4,3 [--grids head,batch,split split,head,batch]
      [--rounds 11] [--json F]

Each case is B,S,N,K (batch, cache length, query heads, kv heads), head dim
128 (--head-dim), one new token (--tokens), bf16, kv lengths in [S/2, S]
(`decode_route.inputs`). Variants: "default" (`flash_attention`'s default
route), and for every split count x launch (block_k, warps, stages) the
decode backend's `kernel_attention` traced in its own jit with that split
count and `DEFAULT_LAUNCH` patched (`WIDE_TILE_LAUNCH` off, so the patched
launch is the one taken where it fits), and with --grids under each order
of the launch grid's axes (`decode.GRID_AXES`, fastest first); cuDNN with
the kv lengths. Prints µs per call (median of the rounds) and cuDNN's
time over each variant's; every variant's output is compared with the
default's first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from benchmarks import decode_route  # noqa: E402
import jflash  # noqa: E402
from jflash._src.backends.triton import decode as triton_decode  # noqa: E402
from jflash._src.backends.triton import decode_backend  # noqa: E402
from jflash._src.spec import MaskSpec  # noqa: E402

MASK = MaskSpec(is_causal=True, has_lengths=True, bottom_right=True)


def default_route(q, k, v, lengths):
  return jflash.flash_attention(q, k, v, is_causal=True,
                                causal_alignment="bottom_right",
                                key_value_seq_lengths=lengths)


def kernel_with(num_splits: int, launch: tuple[int, int, int],
                grid_axes: tuple[str, ...] | None = None):
  """The decode kernel's forward with this split count, launch and grid
  order (default: GRID_AXES)."""

  def fn(q, k, v, lengths):
    with contextlib.ExitStack() as stack:
      if grid_axes is not None:
        stack.enter_context(mock.patch.object(triton_decode, "GRID_AXES",
                                              grid_axes))
      stack.enter_context(mock.patch.object(
          decode_backend, "DEFAULT_LAUNCH",
          decode_backend.DecodeLaunch(*launch)))
      stack.enter_context(mock.patch.object(decode_backend,
                                            "WIDE_TILE_LAUNCH", None))
      return decode_backend.kernel_attention(
          q, k, v, lengths, None, None, None, mask=MASK,
          scale=q.shape[-1] ** -0.5, soft_cap=None, num_splits=num_splits,
          interpret=False)[0]

  return fn


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="+", required=True,
                      metavar="B,S,N,K")
  parser.add_argument("--splits", nargs="+", type=int, required=True)
  parser.add_argument("--launches", nargs="+", default=["64,4,4"],
                      metavar="BLOCK_K,WARPS,STAGES")
  parser.add_argument("--grids", nargs="+", default=[None],
                      metavar="AXIS,AXIS,AXIS",
                      help="orders of head, batch, split (default: "
                      "GRID_AXES only)")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--tokens", type=int, default=1)
  parser.add_argument("--rounds", type=int, default=11)
  parser.add_argument("--iters", type=int, default=30)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  rng = np.random.default_rng(0)
  launches = [tuple(int(x) for x in s.split(",")) for s in args.launches]
  rows = []
  for text in args.cases:
    batch, kv_seq, heads, kv_heads = (int(x) for x in text.split(","))
    case = (batch, kv_seq, heads, kv_heads, args.head_dim, args.tokens)
    inputs = decode_route.inputs(case, rng)
    impls = {"default": jax.jit(default_route)}
    for n in args.splits:
      for launch in launches:
        for grid in args.grids:
          axes = None if grid is None else tuple(grid.split(","))
          name = f"s{n}_k{launch[0]}w{launch[1]}s{launch[2]}"
          name += "" if axes is None else "_" + "".join(a[0] for a in axes)
          impls[name] = jax.jit(kernel_with(n, launch, axes))
    impls["cudnn"] = jax.jit(
        lambda q, k, v, lengths: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"))
    reference = impls["default"](*inputs).astype(jnp.float32)
    for name, fn in impls.items():
      if name not in ("default", "cudnn"):
        diff = float(jnp.max(jnp.abs(fn(*inputs).astype(jnp.float32)
                                     - reference)))
        if diff > 0.02:
          print(f"  {name}: max |diff| {diff} against the default", flush=True)
    times = decode_route.time_interleaved(impls, inputs, args.rounds,
                                          args.iters)
    us = {n: t * 1e6 if isinstance(t, float) else t for n, t in times.items()}
    cudnn = us.get("cudnn")
    cells = "; ".join(
        f"{n} {x:.1f}" + (f" ({cudnn / x:.3f})" if isinstance(cudnn, float)
                          and n != "cudnn" else "")
        if isinstance(x, float) else f"{n} {x}" for n, x in us.items())
    print(f"B={batch} S={kv_seq} {heads}/{kv_heads} D={args.head_dim} "
          f"T={args.tokens} (default splits "
          f"{decode_backend.default_num_splits(batch, kv_heads, kv_seq)}): "
          f"{cells}", flush=True)
    rows.append(dict(case=case, us=us))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
