"""Context parallelism: attention over a sequence sharded along a mesh axis.

Public functions: `ring_attention` (global arrays and a mesh: it wraps
`jax.shard_map`), `ring_attention_local` (for callers already inside
`shard_map`), `load_balance` / `load_unbalance` (the balanced layout's
permutation of a batch). Two strategies:

- "ring": K/V shards travel around the ring (ring_loop.py), one block per
  step through jflash's own passes, merged through the lse; a `custom_vjp`
  ring for the backward. Memory per device O(T / devices).
- "all_gather": K/V (and kv segment ids) gathered once; each device runs
  one `flash_attention` of its query rows against all keys, the causal
  mask placed by bottom-right alignment with key lengths: device r's rows
  start at global position r C, so with kv_len = (r + 1) C and q_len = C,
  row t sees keys s <= t + kv_len - q_len = t + r C, the global causal
  mask, and key tiles past kv_len are never visited. Autodiff gives the
  backward (all_gather transposes to a reduce-scatter of dK/dV). Memory
  per device O(T) for K/V.

Options that need global positions inside the kernels (windows, ALiBi,
dropout's hash) and dense bias/mask or lengths raise NotImplementedError.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jflash._src import api
from jflash._src import modifiers
from jflash._src import registry
from jflash._src import ring_loop
from jflash._src.spec import CallSpec
from jflash._src.spec import FP8_DTYPES
from jflash._src.spec import Operands
from jflash._src.spec import describe_call

LAYOUTS = ("contiguous", "balanced")
STRATEGIES = ("ring", "all_gather")


def ring_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    axis_name: str,
    is_causal: bool = False,
    layout: str = "contiguous",
    strategy: str = "ring",
    q_segment_ids: jax.typing.ArrayLike | None = None,
    kv_segment_ids: jax.typing.ArrayLike | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    interpret: bool = False,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    alibi_slopes: jax.typing.ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
  """Attention with the sequence sharded over a mesh axis (context parallel).

  The same result as `jflash.flash_attention` on the unsharded arrays (up
  to rounding: the partial results are merged in float32), computed with
  the sequence axis split over `mesh.shape[axis_name]` = d devices. Each
  device holds T / d query rows and T / d keys; memory per device is
  O(T / d) with strategy="ring".

  Shapes: query [B, T, N, H], key and value [B, S, K, H] with S == T (or
  unbatched [T, N, H], [S, K, H]); GQA as in flash_attention (query head n
  reads key/value head n // (N // K)). The sequence axis is sharded over
  `axis_name` (inputs are resharded to that if they are not). On a mesh
  with Explicit axes, the batch and head axes keep the query's sharding
  over the other mesh axes (the head axes must divide K); on other meshes
  they are replicated over them. The output is sharded like that.

  Strategies:
    "ring": K/V (and kv segment ids) travel around the ring with
      `lax.ppermute`, the next transfer issued before the current block is
      computed; each device merges its blocks' outputs through their
      log-sum-exp. The backward is a ring too (a `custom_vjp`): each block
      is recomputed with the global lse, fp32 dK/dV accumulators travel
      with their K/V shard and return home at the end. The transfers
      overlap the blocks only where XLA may keep several collectives in
      flight: jit the step with `compiler_options=
      jflash.ring_compiler_options()` (7% faster on 4 H100s at 128k).
    "all_gather": K/V gathered once; each device attends its rows to all
      keys (one flash_attention call per chunk of rows). Simpler, often
      faster at 2-4 devices; K/V memory O(T) per device.

  Layouts (with is_causal=True; without a mask the order of positions does
  not matter and both layouts compute the same):
    "contiguous": device i holds positions [i T/d, (i + 1) T/d). Device
      d - 1 computes d blocks, device 0 one: the ring waits for the last.
    "balanced": the sequence is cut into 2d chunks; device i holds chunks
      i and 2d - 1 - i, so every device does the same causal work. The
      inputs (and segment ids) must be in that order, and the output is:
      permute a batch once in the data pipeline with
      `jflash.load_balance(x, d)` and back with `jflash.load_unbalance`.
      For d = 2, 8 positions (chunks 0..3 of 2):
      device 0 holds positions 0 1 6 7, device 1 holds 2 3 4 5.

  Causal masking is top-left over global positions (row t sees keys
  s <= t, positions as in the unsharded sequence, i.e. before
  load_balance). Rows with no visible key output 0 (never NaN).

  Args:
    query: [B, T, N, H] (or [T, N, H]).
    key: [B, S, K, H] (or [S, K, H]), S == T; N must be a multiple of K.
    value: same shape and dtype as `key`.
    mesh: the device mesh (`jax.make_mesh`, `jax.sharding.Mesh`).
    axis_name: the mesh axis the sequence is sharded over.
    is_causal: top-left causal mask over global positions.
    layout: "contiguous" or "balanced" (see above).
    strategy: "ring" or "all_gather" (see above).
    q_segment_ids: integer [B, T] (packed sequences), with kv_segment_ids,
      as in flash_attention; they travel with their shards, and key tiles
      of other segments are skipped in every block.
    kv_segment_ids: integer [B, S].
    scale: logit scale; default 1 / sqrt(H).
    logits_soft_cap: as in flash_attention.
    sinks: float [N], per-head attention sinks as in flash_attention,
      applied once to the merged result (differentiable).
    implementation: the backend of every block, as in flash_attention
      ("mosaic", "triton", "xla"; None chooses per pass). "cudnn" has no
      separate passes and raises NotImplementedError.
    block_sizes: kernel tiles of every block, as in flash_attention.
    interpret: run the kernels through the Pallas interpreter.
    bias, mask, query_seq_lengths, key_value_seq_lengths,
    local_window_size, alibi_slopes, dropout_rate, dropout_rng: not
      supported with a sharded sequence (windows, ALiBi and dropout need
      global position offsets in the kernels; use segment ids for padding
      and packing): setting one raises NotImplementedError naming it.

  Returns:
    [B, T, N, H] (or [T, N, H]) in query's dtype, sharded like the inputs
    along the sequence (in the balanced order with layout="balanced").

  Raises:
    ValueError: for bad input, naming the argument and shapes: S != T, a
      sequence not divisible by the devices (2 x devices with
      layout="balanced"), an axis_name not in the mesh, an unknown layout or
      strategy, or anything flash_attention itself would refuse.
    NotImplementedError: for the options above, and backends that cannot
      run a block.
  """
  _check_options("ring_attention", locals())  # Its arguments, by name.
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise ValueError("mesh must be a jax.sharding.Mesh (e.g. from "
                     f"jax.make_mesh); got {type(mesh).__name__}.")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                     f"(its axes: {tuple(mesh.axis_names)}).")
  num_devices = mesh.shape[axis_name]
  # The one description of the call, as given (errors name the caller's
  # shapes); unbatched inputs get their batch axis here and lose it on
  # return. The shard_map body takes its shards from it undescribed.
  call = api.describe(
      query, key, value, is_causal=is_causal, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, scale=scale,
      logits_soft_cap=logits_soft_cap, sinks=sinks, block_sizes=block_sizes,
      interpret=interpret)
  _check_sequence(call, num_devices, layout, "the mesh axis "
                  f"{axis_name!r} has {num_devices} devices")
  # The call as given must have backends, checked before shard_map; the
  # blocks are planned on their own shapes (_make_ring).
  registry.plan(call.spec, implementation, call.options)
  batch_axes, head_axes = _other_axes(call.operands.query, mesh, axis_name,
                                      call.spec)
  rows = P(_entry(batch_axes), axis_name, _entry(head_axes), None)
  ids = P(_entry(batch_axes), axis_name)
  heads = P(_entry(head_axes))
  operands = call.operands
  args = (operands.query, operands.key, operands.value,
          operands.q_segment_ids, operands.kv_segment_ids,
          None if sinks is None else jnp.asarray(sinks, jnp.float32))
  specs = (rows, rows, rows, ids, ids, heads)
  if jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ()):
    # shard_map on an Explicit mesh takes inputs already laid out as its
    # in_specs say.
    args = tuple(None if x is None else jax.sharding.reshard(
        x, NamedSharding(mesh, spec)) for x, spec in zip(args, specs))
  local = functools.partial(
      _shard_attention, call.spec, call.options, axis_name=axis_name,
      num_devices=num_devices, layout=layout, strategy=strategy,
      implementation=implementation, block_sizes=block_sizes,
      interpret=interpret)
  # check_vma=False: the body is ours (kernels run unchanged, as in
  # sharding.shard_map_call); the sinks' gradient is summed over the
  # devices that share them by shard_map's transpose.
  out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=rows,
                      check_vma=False)(*args)
  return out[0] if call.unbatched else out


def ring_attention_local(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: str,
    is_causal: bool = False,
    layout: str = "contiguous",
    strategy: str = "ring",
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    interpret: bool = False,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    alibi_slopes: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
  """`ring_attention` on local shards, inside a caller's `jax.shard_map`.

  Arguments and semantics as `ring_attention`, but the arrays are this
  device's shards along the sequence axis, which is sharded over mesh axis
  `axis_name` of the enclosing `shard_map` (its size d is read with
  `lax.axis_size`): query [B, T/d, N, H], key/value [B, T/d, K, H],
  segment ids [B, T/d], sinks [N] of the local heads. Device i of the axis
  holds positions [i T/d, (i + 1) T/d) (layout="contiguous"), or chunks i
  and 2d - 1 - i of T / (2d) positions each (layout="balanced"). Works
  under `shard_map(..., check_vma=False)` and with check_vma=True.

  Returns:
    The local output shard, [B, T/d, N, H] in query's dtype.

  Raises:
    ValueError: axis_name not bound by an enclosing shard_map; local
      query and key lengths that differ; an odd local length with
      layout="balanced"; and everything `ring_attention` refuses.
    NotImplementedError: as `ring_attention`.
  """
  _check_options("ring_attention_local", locals())  # Its arguments, by name.
  try:
    num_devices = lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not a mesh axis of an enclosing "
        "jax.shard_map; ring_attention_local runs inside shard_map (use "
        "jflash.ring_attention on global arrays).") from e
  call = api.describe(
      query, key, value, is_causal=is_causal, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, scale=scale,
      logits_soft_cap=logits_soft_cap, sinks=sinks, block_sizes=block_sizes,
      interpret=interpret)
  _check_sequence(call, 1, layout, "local shards")
  out = _local_attention(
      call, sinks, axis_name=axis_name, num_devices=num_devices,
      layout=layout, strategy=strategy, implementation=implementation,
      block_sizes=block_sizes, interpret=interpret)
  return out[0] if call.unbatched else out


def _shard_attention(spec: CallSpec, options, query, key, value,
                     q_segment_ids, kv_segment_ids, sinks, **kwargs):
  """`ring_attention`'s shard_map body: `_local_attention` of this
  device's shards of the call described as `spec` and `options`.

  The shards are not described again: they are slices of the global call,
  validated and normalized (batched, int32 ids, float32 sinks) by
  `ring_attention`, whose checks (T == S, T divisible into the shards)
  hold for them too. Only what depends on the shards' shapes is formed
  here, as `api.describe` forms it: the per-head sinks and the spec.
  """
  batch, _, num_heads, _ = query.shape
  operands = Operands(
      query, key, value, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      sinks=modifiers.per_head(sinks, batch=batch, num_heads=num_heads))
  local_spec = describe_call(operands, scale=spec.scale,
                             is_causal=spec.mask.is_causal,
                             logits_soft_cap=spec.logits_soft_cap)
  call = api.DescribedCall(spec=local_spec, operands=operands,
                           options=options, unbatched=False)
  return _local_attention(call, sinks, **kwargs)


def _local_attention(call: api.DescribedCall, sinks, *, axis_name,
                     num_devices, layout, strategy, implementation,
                     block_sizes, interpret):
  """The work of one device on its described shards: runs a strategy.
  Returns batched [B, T/d, N, H]."""
  balanced = layout == "balanced" and call.spec.mask.is_causal
  if strategy == "all_gather":
    out = _all_gather_attention(
        call, sinks, axis_name=axis_name, num_devices=num_devices,
        balanced=balanced, implementation=implementation,
        block_sizes=block_sizes, interpret=interpret)
  else:
    ring = _make_ring(call, axis_name=axis_name, num_devices=num_devices,
                      balanced=balanced, implementation=implementation)
    ops = call.operands
    result = ring_loop.ring_attention(ring, ops.query, ops.key, ops.value,
                                      ops.q_segment_ids, ops.kv_segment_ids)
    if ring.return_lse:
      out, lse = result
      out = _apply_sinks(out, lse, ops.sinks).astype(ops.query.dtype)
    else:
      out = result
  return out


# The ring strategy.


def _make_ring(call: api.DescribedCall, *, axis_name: str, num_devices: int,
               balanced: bool, implementation) -> ring_loop.Ring:
  """The loop's blocks, each described and planned like a flash_attention
  call on its shapes (so each pass gets its backend and tiles).

  The blocks differ in their static spec, not only in their arrays: step
  0's block is causal, the others are not, and the balanced layout's half
  blocks have other shapes (so other tiles). Each distinct spec is planned
  once: without is_causal, step 0's block and the others share theirs.
  """
  spec, ops = call.spec, call.operands
  batch, seq, num_heads, head_dim = ops.query.shape
  num_kv_heads = ops.key.shape[2]
  with_ids = ops.q_segment_ids is not None
  dtype = ops.query.dtype
  plans = {}  # By block spec.

  def block(q_len: int, kv_len: int, causal: bool) -> ring_loop.Block:
    struct = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    ids = lambda n: (jax.ShapeDtypeStruct((batch, n), jnp.int32)
                     if with_ids else None)
    operands = Operands(
        struct(batch, q_len, num_heads, head_dim),
        struct(batch, kv_len, num_kv_heads, head_dim),
        struct(batch, kv_len, num_kv_heads, head_dim),
        q_segment_ids=ids(q_len), kv_segment_ids=ids(kv_len))
    block_spec = describe_call(operands, scale=spec.scale, is_causal=causal,
                               logits_soft_cap=spec.logits_soft_cap)
    if block_spec not in plans:
      plan = registry.plan(block_spec, implementation, call.options)
      if registry.get(plan.forward).forward is None:
        raise NotImplementedError(
            f"jflash.ring_attention: implementation={plan.forward!r} runs "
            "only as one whole call; the ring needs a backend with separate "
            "forward and backward passes (mosaic, triton or xla), or "
            "strategy='all_gather'.")
      plans[block_spec] = plan
    return ring_loop.Block(block_spec, plans[block_spec])

  is_causal = spec.mask.is_causal
  blocks = dict(first=block(seq, seq, is_causal))
  if num_devices > 1 and balanced:
    blocks.update(lower=block(seq, seq // 2, False),
                  upper=block(seq // 2, seq, False))
  elif num_devices > 1:
    blocks.update(other=block(seq, seq, False))
  return ring_loop.Ring(
      axis_name=axis_name, num_devices=num_devices, is_causal=is_causal,
      balanced=balanced, return_lse=ops.sinks is not None, **blocks)


def _apply_sinks(out, lse, sinks):
  """Adds each head's sink to the merged softmax's denominator, once.

  out_t = sum_s e^x_ts v_s / (e^sink + sum_s e^x_ts) = out_merged * a / (a
  + e^sink) with a = e^lse (a row's merged lse). Relative to m = max(lse,
  sink) (0 where both are -inf: no -inf - -inf), so nothing overflows or
  turns NaN; differentiable in out, lse and sinks.

  Args:
    out: float32 [B, T, N, H], the merged output (0 on rows without keys).
    lse: float32 [B, N, T], natural, -inf on rows without keys.
    sinks: float32 [B, N], natural-log sink logits (-inf: no sink).
  """
  sinks = sinks[..., None]
  top = jnp.maximum(lse, sinks)
  top = lax.stop_gradient(jnp.where(jnp.isneginf(top), 0.0, top))
  keys, sink = jnp.exp(lse - top), jnp.exp(sinks - top)
  total = keys + sink
  factor = keys / jnp.where(total > 0.0, total, 1.0)
  return out * ring_loop.per_row(factor)


# The all-gather strategy.


def _all_gather_attention(call: api.DescribedCall, sinks, *, axis_name,
                          num_devices, balanced, implementation, block_sizes,
                          interpret):
  """Local rows against the gathered keys: one flash_attention call per
  chunk of rows, its causal mask placed by bottom-right alignment."""
  spec, ops = call.spec, call.operands
  gather = lambda x: None if x is None else lax.all_gather(
      x, axis_name, axis=1, tiled=True)
  key, value, kv_ids = (gather(x) for x in (ops.key, ops.value,
                                            ops.kv_segment_ids))
  is_causal = spec.mask.is_causal
  flash = functools.partial(
      api.flash_attention, scale=spec.scale,
      logits_soft_cap=spec.logits_soft_cap, sinks=sinks,
      implementation=implementation, block_sizes=block_sizes,
      interpret=interpret)
  if not is_causal:
    # Every row sees every key: the order of the gathered keys (balanced
    # or not) does not matter, as long as their ids travel with them.
    return flash(ops.query, key, value, q_segment_ids=ops.q_segment_ids,
                 kv_segment_ids=kv_ids)
  batch, seq = ops.query.shape[:2]
  rank = lax.axis_index(axis_name)
  if balanced:
    # Gathered in device order (chunks 0, 2d-1, 1, 2d-2, ...): back to
    # positions.
    key, value, kv_ids = (None if x is None else load_unbalance(
        x, num_devices) for x in (key, value, kv_ids))
    chunk = seq // 2
    # Local chunks r and 2d - 1 - r end at global positions (r + 1) C and
    # (2d - r) C.
    ends = ((0, chunk, rank + 1), (chunk, seq, 2 * num_devices - rank))
  else:
    chunk = seq
    ends = ((0, seq, rank + 1),)
  outs = []
  for start, stop, end in ends:
    kv_len = jnp.full((batch,), end * chunk, jnp.int32)
    outs.append(flash(
        ops.query[:, start:stop], key, value, is_causal=True,
        causal_alignment="bottom_right", key_value_seq_lengths=kv_len,
        q_segment_ids=ring_loop.slice_rows(
            ops.q_segment_ids, start, stop),
        kv_segment_ids=kv_ids))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


# The balanced layout's permutation.


def _balanced_order(num_shards: int) -> np.ndarray:
  """Chunk order of the balanced layout: 0, 2n-1, 1, 2n-2, ..., n-1, n."""
  pairs = [(i, 2 * num_shards - 1 - i) for i in range(num_shards)]
  return np.array([c for pair in pairs for c in pair])


def _permute_chunks(x, num_shards, axis, order, name):
  if isinstance(num_shards, bool) or not isinstance(
      num_shards, (int, np.integer)) or num_shards < 1:
    raise ValueError(f"{name}: num_shards must be a positive int; got "
                     f"{num_shards!r}.")
  ndim = np.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"{name}: axis={axis} is out of range for an array of "
                     f"shape {np.shape(x)}.")
  axis %= ndim
  shape = np.shape(x)
  length = shape[axis]
  if length % (2 * num_shards):
    raise ValueError(
        f"{name}: the length of axis {axis} ({length}, shape {shape}) must "
        f"be divisible by 2 * num_shards = {2 * num_shards}.")
  chunked = shape[:axis] + (2 * num_shards, length // (2 * num_shards))
  chunked += shape[axis + 1:]
  if isinstance(x, np.ndarray):
    return np.take(x.reshape(chunked), order, axis=axis).reshape(shape)
  chunks = jnp.reshape(x, chunked)
  sharding = jax.typeof(chunks).sharding
  index = (slice(None),) * axis + (order,)
  if (not sharding.mesh.empty
      and jax.sharding.AxisType.Explicit in sharding.mesh.axis_types):
    # On an Explicit mesh the gather's output sharding must be named: the
    # input's (chunks move between devices, the layout stays).
    chunks = chunks.at[index].get(out_sharding=sharding)
  else:
    chunks = chunks[index]
  return jnp.reshape(chunks, shape)


def load_balance(x, num_shards: int, axis: int = 1):
  """Permutes a sequence axis into the balanced layout of `num_shards`.

  Cuts axis `axis` into 2 * num_shards equal chunks and orders them
  0, 2n-1, 1, 2n-2, ..., n-1, n, so that sharding the result evenly over n
  devices gives device i chunks i and 2n - 1 - i: the order
  `ring_attention(..., layout="balanced")` takes. Apply it once to every
  per-position array of a batch (tokens, targets, segment ids, q/k/v) in
  the data pipeline; `load_unbalance` is its inverse.

  Args:
    x: a NumPy or JAX array.
    num_shards: the number of devices of the ring axis.
    axis: the sequence axis (default 1: [batch, seq, ...]).

  Returns:
    The permuted array, of x's shape and kind (NumPy stays NumPy).

  Raises:
    ValueError: if the axis length is not divisible by 2 * num_shards, or
      num_shards or axis are invalid.
  """
  return _permute_chunks(x, num_shards, axis, _balanced_order(num_shards),
                         "load_balance")


def load_unbalance(x, num_shards: int, axis: int = 1):
  """The inverse of `load_balance`: from the balanced layout back to
  positions in order (e.g. for a model's output). Arguments as
  `load_balance`."""
  return _permute_chunks(x, num_shards, axis,
                         np.argsort(_balanced_order(num_shards)),
                         "load_unbalance")


def ring_compiler_options(collectives_in_flight: int = 4) -> dict[str, Any]:
  """XLA options for a `jax.jit` whose program runs `ring_attention`, so
  that its transfers overlap the blocks:

      step = jax.jit(train_step,
                     compiler_options=jflash.ring_compiler_options())

  The ring issues each step's K and V transfers (and, in the backward, the
  float32 dK/dV accumulators) before the block that does not need them.
  XLA's GPU scheduler keeps one collective in flight by default, so of the
  two transfers of a step one overlaps the block and the other waits in
  full: on 4 H100s 12% of a 128k-token causal fwd+bwd (RECORD 2026-11-26,
  "ring attention and sharded training on 4 GPUs"). With 4 in flight and
  the latency-hiding scheduler on, that step was 7% faster (0.905x of one
  GPU's speed per GPU, from 0.84x; 4% at 256k). The same settings by
  environment, for every program of the process:
  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_experimental_parallel_collective_overlap_limit=4".

  Args:
    collectives_in_flight: how many collectives the scheduler may overlap
      at once (XLA's default is 1). The ring needs 2 in the forward (K and
      V) and 4 in the backward (with dK and dV).

  Returns:
    A new dict for `jax.jit(..., compiler_options=...)` (or
    `.lower(...).compile(...)`); XLA on other platforms ignores them.

  Raises:
    ValueError: if collectives_in_flight is not a positive int.
  """
  if (not isinstance(collectives_in_flight, int)
      or isinstance(collectives_in_flight, bool)
      or collectives_in_flight < 1):
    raise ValueError("ring_compiler_options: collectives_in_flight must be "
                     f"a positive int, got {collectives_in_flight!r}")
  return {
      "xla_gpu_enable_latency_hiding_scheduler": True,
      "xla_gpu_experimental_parallel_collective_overlap_limit":
          collectives_in_flight,
  }


# Validation.


# The options a sharded sequence does not support, in the order they are
# checked, and why.
_UNSUPPORTED = {
    "bias": "a dense [T, S] bias would have to be sharded over both axes",
    "mask": "a dense [T, S] mask would have to be sharded over both axes",
    "query_seq_lengths": "lengths are not split over shards; mask padding "
                         "with segment ids",
    "key_value_seq_lengths": "lengths are not split over shards; mask "
                             "padding with segment ids",
    "local_window_size": "windows need global position offsets in the "
                         "kernels",
    "alibi_slopes": "ALiBi needs global position offsets in the kernels",
    "dropout_rate": "dropout's mask hashes global positions in the kernels",
    "dropout_rng": "dropout's mask hashes global positions in the kernels",
}


def _check_options(name: str, arguments: dict[str, Any]):
  """The checks `ring_attention` and `ring_attention_local` share.

  Args:
    name: the public function, for the messages.
    arguments: its arguments by name (its `locals()` on entry), so both
      check the same options the same way.

  Raises:
    ValueError: for an unknown layout or strategy, or a dropout_rate
      outside [0, 1).
    NotImplementedError: naming the first option of `_UNSUPPORTED` set.
  """
  layout, strategy = arguments["layout"], arguments["strategy"]
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}.")
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}; got "
                     f"{strategy!r}.")
  rate = arguments["dropout_rate"]
  if not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be a float in [0, 1); got "
                     f"{rate!r}.")
  dtype = jnp.result_type(arguments["query"])
  if jnp.dtype(dtype).name in FP8_DTYPES:
    raise NotImplementedError(
        f"jflash.{name}: FP8 inputs ({jnp.dtype(dtype).name}) are not "
        "supported with a sharded sequence (the blocks' descales are not "
        "passed through the ring); use jflash.flash_attention, or 16-bit "
        "inputs.")
  for option, reason in _UNSUPPORTED.items():
    value = arguments[option]
    if value is None or (option == "dropout_rate" and value == 0.0):
      continue
    raise NotImplementedError(
        f"jflash.{name}: {option} is not supported with a sharded "
        f"sequence ({reason}).")


def _check_sequence(call: api.DescribedCall, num_devices: int, layout: str,
                    what: str):
  """Query and key lengths equal, and divisible as the layout needs."""
  query, key = call.operands.query, call.operands.key
  q_len, kv_len = query.shape[1], key.shape[1]
  if q_len != kv_len:
    raise ValueError(
        f"the query and key/value sequence lengths must be equal (T == S) "
        f"to shard them together; got query.shape={query.shape}, "
        f"key.shape={key.shape} ({what}).")
  parts = num_devices * (2 if layout == "balanced" else 1)
  if q_len % parts:
    needs = (f"2 x {num_devices} = {parts} chunks (layout='balanced')"
             if layout == "balanced" else f"{num_devices} shards")
    raise ValueError(
        f"the sequence length T={q_len} (query.shape={query.shape}) must "
        f"be divisible into {needs}; {what}.")


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: Sequence[str]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _other_axes(query, mesh, axis_name: str, spec):
  """(batch axes, head axes) the query's Explicit type shards over, or
  ((), ()) when its type carries no Explicit sharding."""
  sharding = jax.typeof(query).sharding
  query_mesh = sharding.mesh
  if (query_mesh.empty
      or jax.sharding.AxisType.Explicit not in query_mesh.axis_types):
    return (), ()
  entries = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
  batch_axes, head_axes = _axes(entries[0]), _axes(entries[2])
  if axis_name in batch_axes + head_axes:
    raise ValueError(
        f"query.shape={query.shape} is sharded over the ring axis "
        f"{axis_name!r} along its batch or heads (spec {sharding.spec}); "
        "that axis must shard the sequence only.")
  if _axes(entries[3]):
    raise ValueError(f"query.shape={query.shape} is sharded along head_dim "
                     f"(spec {sharding.spec}); only the batch and head axes "
                     "may be sharded besides the sequence.")
  devices = math.prod(mesh.shape[a] for a in head_axes)
  if spec.num_kv_heads % devices:
    raise ValueError(
        f"the heads are sharded {devices} ways over mesh axes {head_axes}, "
        f"which does not divide num_kv_heads={spec.num_kv_heads}: each "
        "device must hold whole GQA groups.")
  return batch_axes, head_axes

