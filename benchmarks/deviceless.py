"""Compile Mosaic GPU kernels for an H100 on a machine with no GPU.

XLA compiles for a GPU described by a target config (no device needed):
`jax.jit(...).trace(...).lower().compile()` on a compile-only H100 runs
the whole pipeline a GPU machine runs, our kernels' lowering, XLA's passes
and Mosaic GPU's compile of each kernel with ptxas, and stops before
loading anything. So ptxas's register and spill report of every kernel
(`MOSAIC_GPU_DUMP_PTXAS=1`) and the compile time are readable here; the
numbers a kernel *runs* at still need the GPU machine.

Setup (once, in a venv of its own: the CUDA plugin would replace the CPU
backend the test suite uses):
  PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/gv
  /tmp/gv/bin/pip install jax==0.11.2 jaxlib==0.11.2 \
      jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
and a `ptxas` on PATH (this workspace: /usr/local/bin/ptxas, CUDA 13.0,
the GPU machine's version). Run scripts with
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu PYTHONPATH=.
(the plugin finds no CUDA runtime here; JAX's default backend stays the
CPU, and jflash is told it is on a Hopper: `pretend_hopper`).

Usage:
  ... /tmp/gv/bin/python benchmarks/deviceless.py --shape 2,2048,8,128 \
      [--causal] [--nondeterministic] [--atomic-dq] [--fwd-only]
prints lower and compile seconds and one line per kernel: registers,
spill stores, ptxas milliseconds (in the order XLA compiles them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

TARGET = pathlib.Path(__file__).parent / "targets" / "h100_sxm.txtpb"


def h100_device() -> jax.Device:
  """A compile-only H100 (JAX's CUDA plugin must be installed)."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(
      "h100", platform="cuda", target_config=TARGET.read_text(),
      topology="1x1x1")
  return topology.devices[0]


def pretend_hopper() -> None:
  """Makes jflash choose as on an H100 although JAX's backend is the CPU."""
  # pylint: disable-next=g-import-not-at-top
  from jflash._src import platform
  platform.cuda_gpu_available = lambda: True
  platform.cuda_compute_capability = lambda: "9.0"
  platform.device_kind = lambda: "NVIDIA H100 80GB HBM3"
  platform.multiprocessor_count = lambda: 132


def abstract(shape: tuple[int, ...], dtype: Any,
             device: jax.Device) -> jax.ShapeDtypeStruct:
  """An input of `shape` placed on `device` (nothing allocated)."""
  return jax.ShapeDtypeStruct(
      shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def capture_stdout(fn):
  """fn()'s result and what was written to file descriptor 1 meanwhile
  (ptxas's report is printed there by C++ code)."""
  # pylint: disable-next=g-import-not-at-top
  import tempfile
  sys.stdout.flush()
  saved = os.dup(1)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 1)
    try:
      result = fn()
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
    tmp.seek(0)
    return result, tmp.read().decode(errors="replace")


@dataclasses.dataclass(frozen=True)
class KernelReport:
  name: str
  registers: int
  spill_stores: int
  ptxas_ms: float
  # ptxas's performance advisories (e.g. C7510-C7515: wgmma serialized).
  advisories: tuple[str, ...] = ()


def parse_ptxas(text: str) -> list[KernelReport]:
  """One report per `Compiling entry function` block of ptxas -v (an
  advisory printed before a block belongs to it)."""
  reports = []
  blocks = text.split("Compiling entry function")
  for before, block in zip(blocks, blocks[1:]):
    name = re.search(r"'([^']+)'", block)
    regs = re.search(r"Used (\d+) registers", block)
    spills = re.search(r"(\d+) bytes spill stores", block)
    ms = re.search(r"Compile time = ([\d.]+) ms", block)
    reports.append(KernelReport(
        name.group(1) if name else "?", int(regs.group(1)) if regs else -1,
        int(spills.group(1)) if spills else -1,
        float(ms.group(1)) if ms else -1.0,
        tuple(sorted(set(re.findall(r"\((C75\d\d)\)[^\n]*", before))))))
  return reports


def compile_report(fn, *args) -> tuple[float, float, list[KernelReport]]:
  """(lower s, compile s, ptxas reports) of a fresh `jax.jit(fn)`."""
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  start = time.perf_counter()
  lowered = jax.jit(lambda *a: fn(*a)).trace(*args).lower(
      lowering_platforms=("cuda",))
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  _, printed = capture_stdout(lowered.compile)
  return lower_s, time.perf_counter() - start, parse_ptxas(printed)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="2,2048,8,128",
                      help="B,N,H,D or B,N,H,D,KV_HEADS")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--nondeterministic", action="store_true",
                      help="deterministic_grads=False")
  parser.add_argument("--atomic-dq", action="store_true",
                      help="MosaicBlockSizes(atomic_dq=True) at the head "
                      "dim's default tiles (int32 fixed-point adds; with "
                      "--nondeterministic float32 ones)")
  parser.add_argument("--fwd-only", action="store_true")
  args = parser.parse_args(argv)
  pretend_hopper()
  # pylint: disable-next=g-import-not-at-top
  import jflash
  from jflash._src.backends.mosaic import config as mosaic_config  # pylint: disable=g-import-not-at-top
  batch, seq, heads, head_dim, *kv = (int(x) for x in args.shape.split(","))
  kv_heads = kv[0] if kv else heads
  device = h100_device()
  dtype = jnp.dtype(args.dtype)
  q = abstract((batch, seq, heads, head_dim), dtype, device)
  k = abstract((batch, seq, kv_heads, head_dim), dtype, device)
  options: dict[str, Any] = {"implementation": "mosaic",
                             "is_causal": args.causal}
  if args.nondeterministic:
    options["deterministic_grads"] = False
  if args.atomic_dq:
    options["block_sizes"] = dataclasses.replace(
        mosaic_config.default_block_sizes(head_dim), atomic_dq=True)

  def attention(q, k, v):
    return jflash.flash_attention(q, k, v, **options)

  def grads(q, k, v):
    return jax.grad(lambda *a: attention(*a).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  fn = attention if args.fwd_only else grads
  lower_s, compile_s, reports = compile_report(fn, q, k, k)
  print(f"{args.shape} {args.dtype} causal={args.causal} "
        f"{'fwd' if args.fwd_only else 'fwd+bwd'} {options.get('block_sizes', '')}")
  print(f"lower {lower_s:.2f} s, compile {compile_s:.2f} s")
  for r in reports:
    print(f"  {r.name:26} {r.registers:4d} registers  {r.spill_stores:4d} "
          f"bytes spilled  ptxas {r.ptxas_ms:7.1f} ms  "
          f"{' '.join(r.advisories)}")


if __name__ == "__main__":
  main()
