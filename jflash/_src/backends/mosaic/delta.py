"""delta = rowsum(dO * O) for the Mosaic backward, by a kernel.

The backward's dS = p (dP - delta) needs delta per query row. Left to XLA
as a reduction, its bits followed the tiling XLA's autotuner picked in
each process, and dQ's and dK's with them (equal run to run in a process,
not between processes: RECORD.md, 2026-11-26, "where the 16-bit gradients
differ across processes"). Here every row is summed by one warpgroup in
the same order whatever the process: a TMA load of a [DELTA_ROWS, D] tile
of O and of dO (one (batch, head) per block), their product in float32
registers (the wgmma layout, rows across the warps), a row sum within
each warp, and a TMA store.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jflash._src.backends.mosaic import forward

# Rows of O and dO per block (one warpgroup: the wgmma layout's 64 rows).
DELTA_ROWS = 64


def delta_scratch(head_dim: int, dtype) -> tuple:
  """The kernel's shared memory: an O and a dO tile (swizzled as the
  forward's), the row sums, the load barrier."""
  tile = plgpu.SMEM((DELTA_ROWS, head_dim), dtype,
                    transforms=forward.smem_transforms(dtype))
  return (tile, tile, plgpu.SMEM((DELTA_ROWS,), jnp.float32),
          plgpu.Barrier(num_arrivals=2))


def delta_smem_bytes(head_dim: int, itemsize: int) -> int:
  """`delta_scratch`'s bytes as Mosaic allocates them (each allocation at
  1 KiB alignment; the barrier within the last KiB)."""
  aligned = lambda n: -(-n // 1024) * 1024
  return (2 * aligned(DELTA_ROWS * head_dim * itemsize)
          + aligned(DELTA_ROWS * 4) + 1024)


def delta_call(out: jax.Array, dout: jax.Array) -> jax.Array:
  """rowsum(dout * out) of [batch, q_len, num_heads, head_dim] arrays:
  float32 [batch, num_heads, q_len]."""
  batch, q_len, num_heads, head_dim = out.shape
  # TMA wants rows in multiples of SEQ_ALIGN (the backward pads dout the
  # same way: XLA computes the pad once).
  out = forward.pad_rows(out, forward.SEQ_ALIGN)
  dout = forward.pad_rows(dout, forward.SEQ_ALIGN)
  num_tiles = pl.cdiv(q_len, DELTA_ROWS)

  def kernel(out_ref, dout_ref, delta_ref, scratch):
    out_tile, dout_tile, delta_tile, ready = scratch
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    rows = pl.ds(lax.axis_index("tiles") * DELTA_ROWS, DELTA_ROWS)
    # Rows past q_len read as zeros (TMA) and are stored past it, into the
    # padding of the output's last tile.
    plgpu.copy_gmem_to_smem(out_ref.at[b, rows, h], out_tile, ready)
    plgpu.copy_gmem_to_smem(dout_ref.at[b, rows, h], dout_tile, ready)
    plgpu.barrier_wait(ready)
    o = plgpu.load(out_tile, layout=plgpu.Layout.WGMMA)
    do = plgpu.load(dout_tile, layout=plgpu.Layout.WGMMA)
    delta_tile[...] = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32),
                              axis=1)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(delta_tile, delta_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  # Whole tiles per row of the output: a 1-D TMA store past a row's end
  # would land on the next row.
  delta = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(
          (batch, num_heads, num_tiles * DELTA_ROWS), jnp.float32),
      scratch_types=[delta_scratch(head_dim, out.dtype)],
      grid=(batch, num_heads, num_tiles),
      grid_names=("batch", "heads", "tiles"),
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
  )(out, dout)
  return delta[..., :q_len]
