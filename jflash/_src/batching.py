"""`vmap` for kernels whose launch grid cannot grow: fold into the batch.

A Pallas-Triton grid has at most three axes, all taken (tile, batch, head),
so `pallas_call`'s own batching rule (one more grid axis) cannot serve
`vmap`. Every launch is wrapped with `fold_vmap_into_batch` instead: under
`vmap` the mapped axis is merged into the batch axis the kernels already
have, and nested `vmap`s never add grid dimensions.
"""

from __future__ import annotations

import jax
from jax import custom_batching
import jax.numpy as jnp


def fold_vmap_into_batch(fn, vmappable: bool = True,
                         unsupported: str = ""):
  """Makes `fn` batch under `vmap` by folding the mapped axis into axis 0.

  Every array leaf of `fn`'s arguments (pytrees; None leaves are absent
  operands) and outputs must have the kernels' batch axis first. Under
  `vmap`, the mapped axis (moved to the front) and the batch axis are
  merged, `fn` runs once on the larger batch, and the outputs are split
  back. Unbatched arguments are broadcast first (the kernels index every
  operand by batch element).

  Args:
    fn: the launch.
    vmappable: False makes `vmap` raise NotImplementedError(`unsupported`).
    unsupported: the error message for vmappable=False.
  """

  def flat_fn(treedef, *leaves):
    return fn(*jax.tree.unflatten(treedef, leaves))

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)

    @custom_batching.custom_vmap
    def folded(*leaves):
      return flat_fn(treedef, *leaves)

    @folded.def_vmap
    def _rule(axis_size, in_batched, *leaves):
      if not vmappable:
        raise NotImplementedError(unsupported)
      merged = []
      for leaf, batched in zip(leaves, in_batched):
        if not batched:
          leaf = jnp.broadcast_to(leaf, (axis_size, *leaf.shape))
        merged.append(
            leaf.reshape((axis_size * leaf.shape[1], *leaf.shape[2:])))
      outs = folded(*merged)
      outs = jax.tree.map(
          lambda x: x.reshape((axis_size, x.shape[0] // axis_size,
                               *x.shape[1:])), outs)
      return outs, jax.tree.map(lambda _: True, outs)

    return folded(*leaves)

  return call
