"""The ring loop of context parallelism: forward, and its `custom_vjp`.

Runs on local shards inside `shard_map` (ring.py builds the `Ring` and
calls `ring_attention`). Device r of the ring axis (d devices) holds query
shard r and, at step s = 0 .. d-1, the key/value shard of device
src = (r - s) mod d, which travels around the ring with `lax.ppermute`
(r sends to r + 1). Each step is one call of jflash's own passes
(binding.forward_pass / backward_pass), so every backend the registry has
(Triton, Mosaic, the XLA path) runs the blocks, with its tiles, tile
skipping and segment ids.

Forward (FlashAttention-2's online softmax, one level up): each block
returns its output normalized over its own keys and its base-2 lse; the
running pair is merged with it in float32 (`merge`), so the result is the
attention over all keys, exact up to rounding. The next shard's transfer is
issued before the current block is computed, so XLA may overlap them.

Backward: recompute per block with the GLOBAL residuals. With the merged
output O and lse L of a row, the probabilities of one key shard are
p = exp2(s2 - L) (already globally normalized) and delta = rowsum(dO * O)
is the row's: every backend's backward computes exactly that shard's share
of dQ, dK, dV from these residuals (registry.Backend.backward). dQ stays
home; fp32 dK/dV accumulators travel with their K/V shard, each device
adding its share, and make one last hop home after the final step.

Memory per device: q, k, v, out (input dtype), lse (float32) saved, plus
one K/V shard in flight and the fp32 accumulators: O(T / d). Autodiff of
the forward loop would instead store every rotated K/V shard and every
partial output (O(T)).

Causal masking across blocks (top-left, positions global):
- layout "contiguous": device r holds positions [r C, (r + 1) C). Step 0 is
  causal on the diagonal; a shard from src < r is seen in full; from
  src > r not at all (skipped; device d - 1 does d blocks, device 0 one).
- layout "balanced": the sequence is 2d chunks of C; device r holds chunks
  r and 2d - 1 - r (2C rows). Step 0 is top-left causal on those 2C rows
  (chunk r sees itself causally, chunk 2d-1-r sees chunk r and itself
  causally: exactly the causal mask of the concatenation). A shard from
  src < r: all 2C queries see its first chunk (src) in full and its second
  (2d-1-src > 2d-1-r) not at all ("lower" block, 2C x C). From src > r:
  only the second local chunk sees it, both chunks in full ("upper" block,
  C x 2C). Every device does the same work at every step.

Skipped and half blocks are chosen with `lax.cond` on the device's rank:
the branch not taken costs nothing (no launch, no zeros), which masking a
whole block (e.g. key lengths 0) would not give on the XLA path, and the
balanced layout's two half blocks have different shapes anyway. On a GPU
a conditional reads its predicate on the host side of the stream; one
such read per step, against blocks of milliseconds at long sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from jflash._src import binding
from jflash._src import registry
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands


@dataclasses.dataclass(frozen=True)
class Block:
  """One kind of (query rows, key shard) call of the loop (hashable).

  Attributes:
    spec: the call's spec on the block's shapes (no sinks, no lse output).
    plan: the backends of its two passes.
  """

  spec: CallSpec
  plan: registry.Plan

  def forward(self, q, k, v, q_ids, kv_ids):
    """(out [B, Tb, N, H] in q's dtype, lse2 float32 [B, N, Tb], +inf on
    rows that see no key of this block)."""
    return binding.forward_pass(self.spec, self.plan, Operands(
        q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids))

  def backward(self, q, k, v, q_ids, kv_ids, out, lse2, dout, dlse):
    """(dq, dk, dv) of this block from the rows' global residuals."""
    grads = binding.backward_pass(
        self.spec, self.plan,
        Operands(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids),
        out, lse2, dout, dlse)
    return grads.query, grads.key, grads.value


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static description of one ring loop (hashable).

  Attributes:
    axis_name: the mesh axis of the ring.
    num_devices: its size d.
    is_causal: top-left causal mask over global positions.
    balanced: the balanced layout (only with is_causal; without a mask the
      order of positions does not matter).
    return_lse: also return the merged natural lse ([B, N, T], float32);
      the output is then float32 too (ring.py applies sinks to both).
    first: step 0's block (own keys): causal, or full without is_causal.
    other: contiguous, steps >= 1: a full block (skipped above the
      diagonal when causal).
    lower: balanced, shard of a device before this one: every local query
      against the shard's first chunk (2C x C).
    upper: balanced, shard of a device after: the second local chunk
      against the whole shard (C x 2C).
  """

  axis_name: str
  num_devices: int
  is_causal: bool
  balanced: bool
  return_lse: bool
  first: Block
  other: Block | None = None
  lower: Block | None = None
  upper: Block | None = None

  def rotate(self, tree):
    """Sends every array of `tree` to the next device of the ring."""
    perm = [(i, (i + 1) % self.num_devices) for i in range(self.num_devices)]
    return lax.ppermute(tree, self.axis_name, perm)


# Merging partial attentions. Each partial is (out, lse2): out float32
# [B, T, N, H] normalized over its own keys, lse2 float32 [B, N, T] their
# base-2 log-sum-exp, -inf for a row that has seen no key (the kernels'
# residual uses +inf there; `_merge_form` converts).


def _merge_form(lse2):
  """A block's lse2 (+inf: no key) in the merge's form (-inf: no key)."""
  return jnp.where(jnp.isposinf(lse2), -jnp.inf, lse2)


def _residual_form(lse2):
  """A merged lse2 (-inf: no key) as the backward passes take it (+inf),
  so that their p = exp2(s2 - lse2) is exactly 0 on such rows."""
  return jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)


def per_row(x):
  """[B, N, T] -> [B, T, N, 1], to scale outputs [B, T, N, H] per row."""
  return jnp.swapaxes(x, 1, 2)[..., None]


def merge(partial_a, partial_b):
  """The attention over the union of two disjoint key sets, in float32.

  With L = log2(2^La + 2^Lb): out = 2^(La - L) out_a + 2^(Lb - L) out_b.
  Evaluated relative to m = max(La, Lb), so each weight 2^(L_i - m) is in
  [0, 1] (1 for the larger) and nothing overflows; a row where one side
  is -inf takes the other side exactly (weights 0 and 1). Where both are
  -inf (no key yet) m is replaced by 0: -inf - (-inf) = NaN is never
  formed, the weights are 0 and the row stays (0, -inf). Differentiable
  without NaN (the divisions and logs see safe operands), so autodiff of
  the loop can serve as a test oracle.
  """
  out_a, lse_a = partial_a
  out_b, lse_b = partial_b
  top = jnp.maximum(lse_a, lse_b)
  top = lax.stop_gradient(jnp.where(jnp.isneginf(top), 0.0, top))
  weight_a, weight_b = jnp.exp2(lse_a - top), jnp.exp2(lse_b - top)
  total = weight_a + weight_b
  seen = total > 0.0
  safe_total = jnp.where(seen, total, 1.0)
  lse = jnp.where(seen, top + jnp.log2(safe_total), -jnp.inf)
  out = (out_a.astype(jnp.float32) * per_row(weight_a / safe_total)
         + out_b.astype(jnp.float32) * per_row(weight_b / safe_total))
  return out, lse


def _block_partial(block: Block, q, k, v, q_ids, kv_ids):
  out, lse2 = block.forward(q, k, v, q_ids, kv_ids)
  return out.astype(jnp.float32), _merge_form(lse2)


def slice_rows(x, start, stop):
  """Rows [start, stop) of an optional [B, T, ...] array."""
  return None if x is None else x[:, start:stop]


def forward_loop(ring: Ring, q, k, v, q_ids, kv_ids, block_partial=None):
  """The ring's forward: (out float32 [B, T, N, H], lse2 [B, N, T] with
  -inf on rows that saw no key).

  `block_partial(block, q, k, v, q_ids, kv_ids)` computes one block's
  partial (default: the block's forward pass); the tests pass a
  differentiable one to compare with autodiff of this loop.
  """
  block_partial = block_partial or _block_partial
  rank = lax.axis_index(ring.axis_name)
  kv = (k, v, kv_ids)
  acc = None
  for step in range(ring.num_devices):
    # Issue the next shard's transfer before this step's block, so that
    # the two can overlap (XLA schedules collective-permute-start/done
    # around the block on a GPU), but not before the previous block is
    # done (`_after`), so only two shards are ever held.
    if step > 0:
      kv, acc = _after(kv, acc)
    next_kv = ring.rotate(kv) if step + 1 < ring.num_devices else None
    if step == 0:
      acc = block_partial(ring.first, q, *kv[:2], q_ids, kv[2])
    else:
      acc = _forward_step(ring, block_partial, rank, step, q, q_ids, kv, acc)
    kv = next_kv
  return acc


def _after(kv, acc):
  """(kv, acc), with kv's next uses ordered after acc is computed.

  The rotations of K/V depend only on each other, so a scheduler may run
  all of them first and hold every shard at once (O(T) memory per device:
  measured on XLA:CPU, +4 shards of memory per step). The barrier makes
  the transfer of step s's shard wait for step s - 1's block.
  """
  return lax.optimization_barrier((kv, acc))


def _forward_step(ring: Ring, block_partial, rank, step, q, q_ids, kv, acc):
  """Merges step `step`'s block (keys of device rank - step) into acc."""
  k, v, kv_ids = kv
  if not ring.is_causal:
    return merge(acc, block_partial(ring.other, q, k, v, q_ids, kv_ids))
  # src = (rank - step) mod d is before this device iff step <= rank.
  before = step <= rank
  if not ring.balanced:

    def visit(acc):
      return merge(acc, block_partial(ring.other, q, k, v, q_ids, kv_ids))

    return lax.cond(before, visit, lambda acc: acc, acc)

  half = k.shape[1] // 2

  def lower(acc):
    return merge(acc, block_partial(
        ring.lower, q, k[:, :half], v[:, :half], q_ids,
        slice_rows(kv_ids, 0, half)))

  def upper(acc):
    out, lse2 = acc
    high = merge((out[:, half:], lse2[..., half:]), block_partial(
        ring.upper, q[:, half:], k, v, slice_rows(q_ids, half, None),
        kv_ids))
    return (out.at[:, half:].set(high[0]),
            lse2.at[..., half:].set(high[1]))

  return lax.cond(before, lower, upper, acc)


def _outputs(ring: Ring, dtype, out, lse2):
  if ring.return_lse:
    return out, lse2 * math.log(2.0)  # -inf stays -inf.
  return out.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(ring: Ring, q, k, v, q_ids, kv_ids):
  """Attention of local query shard `q` over the keys of every device.

  Args:
    ring: the loop.
    q: [B, T, N, H], this device's query rows.
    k, v: [B, T, K, H], this device's key/value shard.
    q_ids, kv_ids: int32 [B, T] segment ids, or None.

  Returns:
    out [B, T, N, H] in q's dtype; with ring.return_lse, (out float32, the
    natural lse float32 [B, N, T], -inf on rows without keys).
  """
  out, lse2 = forward_loop(ring, q, k, v, q_ids, kv_ids)
  return _outputs(ring, q.dtype, out, lse2)


def _forward_rule(ring: Ring, q, k, v, q_ids, kv_ids):
  out, lse2 = forward_loop(ring, q, k, v, q_ids, kv_ids)
  # The residual output is rounded to the input dtype, as a single call's
  # is: delta = rowsum(dout * out) is then computed as flash_attention's.
  residuals = (q, k, v, q_ids, kv_ids, out.astype(q.dtype),
               _residual_form(lse2))
  return _outputs(ring, q.dtype, out, lse2), residuals


def _backward_rule(ring: Ring, residuals, cotangent):
  q, k, v, q_ids, kv_ids, out, lse2 = residuals
  dlse = None
  if ring.return_lse:
    dout, dlse = cotangent
    # Rows without keys pass nothing (their p is 0 in every block).
    dlse = jnp.where(jnp.isinf(lse2), 0.0, dlse.astype(jnp.float32))
  else:
    dout = cotangent
  dout = dout.astype(q.dtype)
  rows = (out, lse2, dout, dlse)
  rank = lax.axis_index(ring.axis_name)
  kv = (k, v, kv_ids)
  f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
  dq = dk = dv = None
  for step in range(ring.num_devices):
    if step > 0:
      # As in forward_loop; dq is the previous block's output (dK/dV, in
      # flight, are left free to overlap this step's block).
      kv, dq = _after(kv, dq)
    next_kv = ring.rotate(kv) if step + 1 < ring.num_devices else None
    if step == 0:
      dq, dk, dv = f32(*ring.first.backward(q, *kv[:2], q_ids, kv[2],
                                            *rows))
    else:
      dq, (key_share, value_share) = _backward_step(ring, rank, step, q,
                                                    q_ids, kv, rows, dq)
      # The block does not wait for the accumulators: only this sum does,
      # so their transfer from the previous device overlaps the block.
      dk, dv = dk + key_share, dv + value_share
    if ring.num_devices > 1:
      # dK/dV travel with their shard: to the device that holds it next,
      # and after the last step, home.
      dk, dv = ring.rotate((dk, dv))
    kv = next_kv
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          None)


def _backward_step(ring: Ring, rank, step, q, q_ids, kv, rows, dq):
  """Step `step`'s block: (dq plus its share, its float32 shares of the
  shard's (dK, dV), whole-shard shaped, zero where it has none)."""
  k, v, kv_ids = kv
  f32 = lambda x: x.astype(jnp.float32)
  zeros = lambda x: jnp.zeros_like(x, dtype=jnp.float32)

  def visit(dq):
    gq, gk, gv = ring.other.backward(q, k, v, q_ids, kv_ids, *rows)
    return dq + f32(gq), (f32(gk), f32(gv))

  if not ring.is_causal:
    return visit(dq)
  before = step <= rank
  if not ring.balanced:
    return lax.cond(before, visit, lambda dq: (dq, (zeros(k), zeros(v))),
                    dq)

  half = k.shape[1] // 2
  # Shares of the shard's first chunk only, padded to the whole shard.
  pad = lambda x: jnp.concatenate([f32(x), zeros(x)], axis=1)

  def lower(dq):
    gq, gk, gv = ring.lower.backward(q, k[:, :half], v[:, :half], q_ids,
                                     slice_rows(kv_ids, 0, half), *rows)
    return dq + f32(gq), (pad(gk), pad(gv))

  def upper(dq):
    out, lse2, dout, dlse = rows
    gq, gk, gv = ring.upper.backward(
        q[:, half:], k, v, slice_rows(q_ids, half, None), kv_ids,
        out[:, half:], lse2[..., half:], dout[:, half:],
        None if dlse is None else dlse[..., half:])
    return dq.at[:, half:].add(f32(gq)), (f32(gk), f32(gv))

  return lax.cond(before, lower, upper, dq)


ring_attention.defvjp(_forward_rule, _backward_rule)
