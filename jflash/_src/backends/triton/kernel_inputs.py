"""The inputs of the Triton kernels: one pytree for arrays, specs and refs.

Every kernel but delta takes one `KernelInputs`. A host wrapper builds it
twice with the same structure, once of arrays and once of BlockSpecs, and
`pallas_call` hands the kernel a `KernelInputs` of refs: a kernel reads
`refs.bias is None`, never positions in a list. An absent operand is None in
all three (no operand, no BlockSpec, no ref), so kernel signatures never
shift. Fields are in the order the kernels' flattened inputs have always had
(fixed inputs, segment inputs, bias, mask, modifier operands), which keeps
the kernels' jaxprs unchanged.

The kernel-side helpers here read scalars and small vectors from those refs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import masks
from jflash._src import modifiers
from jflash._src import numerics
from jflash._src.spec import MaskSpec
from jflash._src.spec import ModifierSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelInputs:
  """A kernel's inputs (arrays, BlockSpecs or refs), batch axis first.

  Attributes:
    q, k, v: [batch, seq, heads, head_dim] (refs: the program's slices).
    do: the output cotangent (backward kernels).
    lse: float32 [batch, num_heads, q_len] base-2 lse (backward kernels).
    delta: float32 [batch, num_heads, q_len] (backward kernels).
    q_lengths, kv_lengths: int32 [batch] (always present: full lengths when
      the call has none).
    q_segment_ids, kv_segment_ids: int32 [batch, seq].
    segment_first, segment_stop: int32 [batch, num_tiles], per tile of the
      axis the kernel's programs own, the range of the other axis's tiles its
      segments can meet (`masks.segment_tile_ranges`).
    bias: [bias_batch, 1 or num_heads, q_len, kv_len] (dense.py).
    mask: int8, shaped as bias (1 = attend).
    sinks, alibi_slopes: float32 [batch, num_heads].
    dropout_seed0, dropout_seed1: uint32 [batch, num_heads] (two arrays: a
      scalar load at a constant trailing index does not discharge in the
      interpreter).
    block_table: int32 [batch, max_pages], a paged cache's page ids (the
      forward kernel); k and v are then pages [num_pages, page_size,
      num_kv_heads, head_dim] (refs: one kv head's pages).
  """

  q: Any
  k: Any
  v: Any
  do: Any = None
  lse: Any = None
  delta: Any = None
  q_lengths: Any = None
  kv_lengths: Any = None
  q_segment_ids: Any = None
  kv_segment_ids: Any = None
  segment_first: Any = None
  segment_stop: Any = None
  bias: Any = None
  mask: Any = None
  sinks: Any = None
  alibi_slopes: Any = None
  dropout_seed0: Any = None
  dropout_seed1: Any = None
  block_table: Any = None

  def modifier_refs(self) -> list[Any]:
    """The modifier operands present, in field order."""
    return [x for x in (self.sinks, self.alibi_slopes, self.dropout_seed0,
                        self.dropout_seed1) if x is not None]


def modifier_operands(spec: ModifierSpec, sinks, alibi_slopes,
                      dropout_seeds) -> dict[str, Any]:
  """The `KernelInputs` fields of the modifiers `spec` turns on."""
  return dict(
      sinks=sinks if spec.has_sinks else None,
      alibi_slopes=alibi_slopes if spec.has_alibi else None,
      dropout_seed0=dropout_seeds[..., 0] if spec.has_dropout else None,
      dropout_seed1=dropout_seeds[..., 1] if spec.has_dropout else None)


def modifier_specs(operands: dict[str, Any], num_heads: int,
                   order=lambda f: f) -> dict[str, Any]:
  """BlockSpecs of `modifier_operands`: each program gets its batch row.

  Every jflash grid has the batch on axis 1; `order` adapts an index map
  written for (tile, batch, head) grids (`forward.query_tile_grid`).
  """
  spec = lambda: pl.BlockSpec((None, num_heads),
                              order(lambda i, b, h: (b, 0)))
  return {name: None if x is None else spec() for name, x in operands.items()}


def optional_inputs(operands, mods: ModifierSpec, *, block_q: int,
                    block_k: int, own_axis: str, dense_spec,
                    order=lambda f: f):
  """(arrays, BlockSpecs) of the optional `KernelInputs` fields present.

  Args:
    operands: a `spec.Operands` with filled lengths (and an int8 mask).
    mods: the modifiers the kernel applies.
    block_q, block_k: the kernel's tiles.
    own_axis: as `segment_inputs`'s.
    dense_spec: the BlockSpec of a dense bias or mask operand.
    order: as `forward.query_tile_grid`'s.
  """
  arrays, specs = {}, {}
  if operands.q_segment_ids is not None:
    segment_arrays, segment_specs = segment_inputs(
        operands, block_q, block_k, own_axis=own_axis, order=order)
    arrays.update(segment_arrays)
    specs.update(segment_specs)
  for name in ("bias", "mask"):
    operand = getattr(operands, name)
    if operand is not None:
      arrays[name] = operand
      specs[name] = dense_spec(operand)
  modifiers_present = modifier_operands(
      mods, operands.sinks, operands.alibi_slopes, operands.dropout_seeds)
  arrays.update(modifiers_present)
  specs.update(modifier_specs(modifiers_present,
                              operands.query.shape[2], order))
  return arrays, specs


def segment_inputs(operands, block_q: int, block_k: int, *, own_axis: str,
                   order=lambda f: f):
  """(arrays, BlockSpecs) of the segment fields, for grids (tile, batch, head).

  Args:
    operands: a `spec.Operands` with segment ids and filled lengths.
    block_q, block_k: the kernel's query and key tiles.
    own_axis: "q" when each program owns a query tile (forward, dQ): the
      ranges hold, per query tile, the key tiles its segments can meet; "kv"
      when it owns a key tile (dK/dV): the other way round.
    order: as `forward.query_tile_grid`'s, for grids in another axis order.
  """
  q_ids, kv_ids = operands.q_segment_ids, operands.kv_segment_ids
  q_lens, kv_lens = operands.q_lengths, operands.kv_lengths
  if own_axis == "q":
    first, stop = masks.segment_tile_ranges(q_ids, q_lens, block_q, kv_ids,
                                            kv_lens, block_k)
  else:
    first, stop = masks.segment_tile_ranges(kv_ids, kv_lens, block_k, q_ids,
                                            q_lens, block_q)
  row = lambda size: pl.BlockSpec((None, size),
                                  order(lambda i, b, h: (b, 0)))
  arrays = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                segment_first=first, segment_stop=stop)
  specs = dict(q_segment_ids=row(q_ids.shape[1]),
               kv_segment_ids=row(kv_ids.shape[1]),
               segment_first=row(first.shape[1]),
               segment_stop=row(first.shape[1]))
  return arrays, specs


def load_lengths(mask: MaskSpec, q_len_ref, kv_len_ref, q_seq: int,
                 kv_seq: int):
  """(q_len, kv_len) of this program's batch element (grid axis 1).

  The array lengths `q_seq`, `kv_seq` as Python ints when the call has no
  lengths, else traced int32 scalars read from the length arrays.
  """
  if not mask.has_lengths:
    return q_seq, kv_seq
  batch_index = pl.program_id(1)
  return (plgpu.load(q_len_ref.at[batch_index]),
          plgpu.load(kv_len_ref.at[batch_index]))


def segment_range(refs: KernelInputs) -> masks.SegmentRange | None:
  """Reader of the program's segment tile range, or None without one."""
  if refs.segment_first is None:
    return None
  return lambda tile_index: (plgpu.load(refs.segment_first.at[tile_index]),
                             plgpu.load(refs.segment_stop.at[tile_index]))


def load_ids(ref, start, size: int, batch_index=None):
  """Segment ids of positions [start, start + size) of an int32 [seq] ref.

  Positions past the array read -1; they are masked by the lengths anyway
  (columns) or never stored (rows). `batch_index`: for [batch, seq] refs.
  """
  positions = start + jnp.arange(size, dtype=jnp.int32)
  idx = pl.ds(start, size)
  idx = idx if batch_index is None else (batch_index, idx)
  return plgpu.load(ref.at[idx], mask=positions < ref.shape[-1], other=-1)


def load_head_modifiers(spec: ModifierSpec, refs: KernelInputs, head,
                        batch_index=None) -> modifiers.HeadModifiers:
  """The query head's modifiers, its scalars loaded once.

  Args:
    spec: the static modifiers.
    refs: the kernel's refs; their modifier refs are [num_heads] slices,
      or whole [batch, num_heads] arrays when `batch_index` is given.
    head: returns the query head's index; only called (traced) when some
      modifier ref is present, so that the default kernels are unchanged.
    batch_index: the batch element, for whole-array refs (dbias kernel).
  """
  head = head() if refs.modifier_refs() else None
  if batch_index is not None:
    head = (batch_index, head)
  # Both in base 2, like the kernels' logits.
  sink2 = slope2 = seeds = None
  if refs.sinks is not None:
    sink2 = plgpu.load(refs.sinks.at[head]) * numerics.LOG2_E
  if refs.alibi_slopes is not None:
    slope2 = plgpu.load(refs.alibi_slopes.at[head]) * numerics.LOG2_E
  if refs.dropout_seed0 is not None:
    seeds = (plgpu.load(refs.dropout_seed0.at[head]),
             plgpu.load(refs.dropout_seed1.at[head]))
  return modifiers.HeadModifiers(spec, sink2=sink2, slope2=slope2,
                                 seeds=seeds)
