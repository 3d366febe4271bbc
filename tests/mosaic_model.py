"""A CPU model of the Mosaic kernels' tile walks, and its dense reference.

No interpreter runs the Mosaic GPU kernels (Pallas' Mosaic GPU interpreter
has no case for their register-operand wgmma and their accumulators carried
through `run_state`), and tests/mosaic_lowering_test.py only lowers them. So
this module runs a model of each kernel's tile walk, forward, dQ and dK/dV,
in NumPy float64 (`run_model`), for tests/mosaic_masking_test.py to compare
with a dense float64 reference (`reference`, `assert_close`).

What it models. The model takes every decision from the code the kernels
run:

- the launch (grid, padded operand shapes, the lse array's length) from the
  kernels' own launches, traced on CPU (`_launches`);
- with segment ids, the host's padded ids and per-tile segment ranges
  (`pipeline.segment_inputs`, with the arguments the host code passed when
  traced);
- per grid point and compute warpgroup, the block's position, lengths, the
  producer's range of tiles and the consumer's runs ("skip", "full",
  "masked") from the helpers the kernels call, evaluated under named axes
  ("q_tiles", "heads", "batch", "wg") as in the kernels; for the persistent
  forward (grid axis "programs", with MODEL_SM_COUNT programs so that each
  works through several items), per program and block of it, the block's
  position from `pipeline.PersistentGrid.position`;
- per tile, the element-wise mask (with segments given the rows' and
  columns' ids as the kernels load them), the lse of rows past q_len, and in
  the dK/dV kernel the ring (the consumers' slots, what the producer loads).

Those calls are traced as jax.jit traces them, and the traced programs
(index arithmetic and selections) evaluated in NumPy with XLA's semantics
(tests/jaxpr_numpy.py): each case's program is new and runs once, and
XLA:CPU would spend about a second compiling it.

What it computes from them is the kernels' arithmetic (online softmax in
base 2 from the sink or MASK_VALUE, masked logits and probabilities on
"masked" tiles only, nothing on "skip" tiles, empty rows: O = 0, lse2 =
+inf), with TMA's behaviour: loads past an array's end read zeros (a 1-D
lse/delta load is bounded by the whole array, not by its row), stores past
it are dropped, outputs start as NaN (uninitialized memory).

What it checks, raising AssertionError: each consumer walks exactly the
producer's steps, and in the dK/dV ring reads each step from the producer's
slot; persistent programs compute every tile exactly once, none outside the
arrays; lse stores stay in their row; 1-D segment id loads stay in their
row (as the host pads the ids for); no read of the segment ranges tables
falls outside them (a GPU reads other memory there; the model reads the
widest range); launches have one producer warpgroup and TMA-aligned rows;
the host cuts the segment ranges as the model cuts the blocks. Wrong run
bounds, kinds, row offsets, ring slots or segment ranges make the results
differ from the reference (the masking test's `ModelSensitivityTest` breaks
a few on purpose).

The `jflash/_src/backends/mosaic/pipeline.py` helpers it calls (each says
so in its docstring): `query_block`, `key_block`, `row_group_start`,
`row_group_of`, `column_chunk_of`, `tile_start`, `kv_head_of`, `key_tiles`,
`query_tiles`, `consumer_runs`, `key_tile_visible`, `query_tile_visible`,
`valid_lse`, `group_slot`, `group_step_rows`, `slot_of`, `segment_inputs`,
`segment_range` (through the two block helpers and the two tile helpers),
`SegmentIds`, `PersistentGrid` (`over`, `position`, `num_blocks`) and
`sm_count` (patched to MODEL_SM_COUNT); it restates `produce`'s slots and
the rows `key_value_loader`, `query_loader` and `load_ids` copy. Beyond
pipeline.py: `forward.COMPUTE_WARPGROUPS`,
`config.backward_warpgroup_split`, and the backend's `configure`, `forward`
and `backward` (traced for their launches).

What it still restates from the kernels' code rather than calls (a change
there must be made here too): the arithmetic, in float64 on purpose (jnp
helpers would compute in float32: `numerics.logits_base2`, the online
softmax from the sink or MASK_VALUE, the epilogue, `backward._score_gradient`
as `_dlogits2`); the persistent forward's loop over a program's blocks
(`forward_kernel`'s `over_items`) and `forward_call`'s `PersistentGrid.over`
arguments (checked against the launch's programs); each kernel's cut into
row groups (`_kernel_rows`, checked against the host's `segment_inputs`
arguments where there are segments); the dK/dV consumers' order of steps
(heads of the group, then runs: `head_loop`); the column slices of a chunk
(`backward._columns`), and with the product split at head dim 256
(`config.backward_splits_products`) which warpgroup stores which gradient
(it computes them all; that the two warpgroups of a row tile walk the same
steps, which the hand-over of probabilities needs, it checks); the
backward operands' padding (`backward_call`);
the forward's row group being its warpgroup (`row_group_of(wg, 1)`).

What the model cannot see is the GPU code around those decisions (wgmma,
barriers, layouts, ping-pong, which refs the kernels hand the helpers: the
model calls them as the kernels' code does, e.g. block ranges to
query_block, row-group ranges to key_tiles): the GPU suite checks it
(JFLASH_TEST_ON_GPU=1), and the lowering test checks that it lowers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import modifiers
from jflash._src import numerics
from jflash._src.backends.mosaic import backend as mosaic_backend
from jflash._src.backends.mosaic import delta as mosaic_delta
from jflash._src.backends.mosaic import pipeline
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.backends.mosaic.config import backward_splits_products
from jflash._src.backends.mosaic.config import backward_warpgroup_split
from jflash._src.backends.mosaic.forward import COMPUTE_WARPGROUPS
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.spec import Operands
from jflash._src.spec import describe_call
from tests import jaxpr_numpy
from tests import test_util
from tests import tolerances

# Model and reference are both float64: the table's float32 floor is far
# above their rounding and far below any masking error.
TOLERANCE = tolerances.FLOOR["float32"]

# TMA copies of 16-bit [rows, head_dim] tiles into the kernels' tiled shared
# memory take rows in multiples of 8: the launches' sequence lengths must be
# (forward.py pads them to SEQ_ALIGN).
TMA_ROWS = 8

# SMs the model's persistent forward launches see (an H100 has 132): few,
# so that programs compute several items, and pairs whose second block is
# not computed.
MODEL_SM_COUNT = 3

# The results of `run_model` and `reference`, in order.
NAMES = ("out", "lse2", "dq", "dk", "dv", "dsinks")


def _check(ok, message: str):
  """Raises AssertionError(message) unless ok: a decision the model found
  wrong."""
  if not ok:
    raise AssertionError(message)


# A call, as the backend receives it.


@dataclasses.dataclass(frozen=True)
class Case:
  """One call as the backend receives it, with its lengths and tiles.

  Attributes:
    spec: the call's spec, as `describe_call` reads it off `operands`.
    operands: the call's operands as shapes (jax.ShapeDtypeStruct): q
      [B, T, N, D], k and v [B, S, K, D] bfloat16, and where the call has
      them, lengths int32 [B] and sinks float32 [B, N].
    lengths: (q_lengths, kv_lengths), B values each, or None: no lengths.
    block_sizes: the tiles, or None: the backend's default.
    segments: (q_ids, kv_ids), per batch element a tuple of T (S) segment
      ids, or None: no segments (tuples: a Case is a functools.cache key).
  """

  spec: CallSpec
  operands: Operands
  lengths: tuple[tuple[int, ...], tuple[int, ...]] | None = None
  block_sizes: MosaicBlockSizes | None = None
  segments: tuple[tuple[tuple[int, ...], ...],
                  tuple[tuple[int, ...], ...]] | None = None

  def lengths_arrays(self):
    """(q_lengths, kv_lengths) int32 [B] as the kernels read them (zeros,
    unread, without lengths)."""
    if self.lengths is None:
      zeros = np.zeros((self.spec.batch,), np.int32)
      return zeros, zeros
    return tuple(np.asarray(x, np.int32) for x in self.lengths)

  def segment_ids(self) -> pipeline.SegmentIds | None:
    """The kernels' `pipeline.SegmentIds` as `pipeline.segment_ids` builds
    them (ids int32 [B, T], [B, S]; the lengths filled with the full ones
    without lengths), or None without segments."""
    if self.segments is None:
      return None
    spec = self.spec
    q_lengths, kv_lengths = (
        (np.full(spec.batch, spec.q_len, np.int32),
         np.full(spec.batch, spec.kv_len, np.int32))
        if self.lengths is None else self.lengths_arrays())
    q_ids, kv_ids = (np.asarray(x, np.int32) for x in self.segments)
    return pipeline.SegmentIds(q_ids, kv_ids, q_lengths, kv_lengths)


def id_runs(*runs) -> tuple[int, ...]:
  """One batch element's segment ids from (id, count) runs, in order."""
  return tuple(i for i, count in runs for _ in range(count))


def make_case(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, *,
              is_causal=False, bottom_right=False, window=None,
              soft_cap=None, sinks=False, lengths=None, block_sizes=None,
              segments=None) -> Case:
  """The call on q [B, T, N, D], k/v [B, S, K, D] with scale 1/sqrt(D),
  described by the library (`describe_call`, as the public function).
  segments: (q_ids, kv_ids), per batch element a sequence of T (S) ids."""
  struct = jax.ShapeDtypeStruct
  kv = struct((batch, kv_len, num_kv_heads, head_dim), jnp.bfloat16)
  per_batch = None if lengths is None else struct((batch,), jnp.int32)
  if segments is not None:
    segments = tuple(tuple(tuple(int(i) for i in row) for row in ids)
                     for ids in segments)
    for ids, seq in zip(segments, (q_len, kv_len), strict=True):
      _check(len(ids) == batch and all(len(row) == seq for row in ids),
             "segment ids must be [B, T] and [B, S]")
  operands = Operands(
      struct((batch, q_len, num_heads, head_dim), jnp.bfloat16), kv, kv,
      q_lengths=per_batch, kv_lengths=per_batch,
      q_segment_ids=(None if segments is None
                     else struct((batch, q_len), jnp.int32)),
      kv_segment_ids=(None if segments is None
                      else struct((batch, kv_len), jnp.int32)),
      sinks=struct((batch, num_heads), jnp.float32) if sinks else None)
  spec = describe_call(
      operands, scale=head_dim ** -0.5, is_causal=is_causal,
      bottom_right=bottom_right, window=window, logits_soft_cap=soft_cap)
  return Case(spec, operands, lengths, block_sizes, segments)


def random_inputs(case: Case, seed: int):
  """q, k, v, dout (float64) and sinks [B, N] (natural log) or None."""
  rng = np.random.default_rng(seed)
  operands = case.operands
  q = rng.standard_normal(operands.query.shape)
  k, v = (rng.standard_normal(operands.key.shape) for _ in range(2))
  dout = rng.standard_normal(q.shape)
  sinks = (None if operands.sinks is None
           else 2.0 * rng.standard_normal(operands.sinks.shape))
  return q, k, v, dout, sinks


# The dense reference (float64, written from MaskSpec's documentation).


def visible(case: Case):
  """bool [B, 1, T, S]: row r sees key c."""
  spec = case.spec
  q_lens, kv_lens = ((np.full(spec.batch, spec.q_len),
                      np.full(spec.batch, spec.kv_len))
                     if case.lengths is None else case.lengths)
  rows = np.arange(spec.q_len)[:, None]
  cols = np.arange(spec.kv_len)[None, :]
  mask = spec.mask
  segments = ((None,) * spec.batch,) * 2 if case.segments is None else (
      case.segments)
  result = []
  for q_len, kv_len, q_ids, kv_ids in zip(q_lens, kv_lens, *segments):
    seen = (rows < q_len) & (cols < kv_len)
    if q_ids is not None:
      seen &= np.asarray(q_ids)[:, None] == np.asarray(kv_ids)[None, :]
    offset = kv_len - q_len if mask.bottom_right else 0
    if mask.is_causal:
      seen &= cols <= rows + offset
    if mask.window is not None:
      left, right = mask.window
      seen &= (cols >= rows + offset - left) & (cols <= rows + offset + right)
    result.append(seen)
  return np.stack(result)[:, None]


def reference(case: Case, q, k, v, dout, sinks):
  """(out, lse2 [B, N, T], dq, dk, dv, dsinks) of dense attention.

  Rows that see no key and have no sink: out 0, lse2 +inf (the kernels'
  convention); rows past q_len see nothing, not even their sink.
  """
  spec = case.spec
  k, v = (np.repeat(x, spec.group, axis=2) for x in (k, v))
  scores = spec.scale * np.einsum("btnd,bsnd->bnts", q, k)
  if spec.logits_soft_cap is None:
    logits, tanh = scores, None
  else:
    tanh = np.tanh(scores / spec.logits_soft_cap)
    logits = spec.logits_soft_cap * tanh
  seen = visible(case)
  row_max = np.max(np.where(seen, logits, -np.inf), axis=-1)
  if sinks is not None:
    q_lens = (np.full(spec.batch, spec.q_len) if case.lengths is None
              else np.asarray(case.lengths[0]))
    row_valid = np.arange(spec.q_len)[None, None, :] < q_lens[:, None, None]
    row_max = np.maximum(row_max, np.where(row_valid, sinks[..., None],
                                           -np.inf))
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  exps = np.where(seen, np.exp(logits - row_max[..., None]), 0.0)
  sink_exp = 0.0
  if sinks is not None:
    sink_exp = np.where(row_valid, np.exp(sinks[..., None] - row_max), 0.0)
  total = exps.sum(-1) + sink_exp
  has_keys = total > 0
  safe_total = np.where(has_keys, total, 1.0)
  probs = exps / safe_total[..., None]
  lse2 = np.where(has_keys, (row_max + np.log(safe_total)) * numerics.LOG2_E,
                  np.inf)
  out = np.einsum("bnts,bsnd->btnd", probs, v)

  delta = np.einsum("btnd,btnd->bnt", dout, out)
  dprobs = np.einsum("btnd,bsnd->bnts", dout, v)
  dlogits = probs * (dprobs - delta[..., None])
  if tanh is not None:
    dlogits = dlogits * (1.0 - tanh * tanh)
  dq = spec.scale * np.einsum("bnts,bsnd->btnd", dlogits, k)
  fold = lambda x: x.reshape(x.shape[:2] + (spec.num_kv_heads, spec.group,
                                            spec.head_dim)).sum(3)
  dk = fold(spec.scale * np.einsum("bnts,btnd->bsnd", dlogits, q))
  dv = fold(np.einsum("bnts,btnd->bsnd", probs, dout))
  dsinks = None
  if sinks is not None:
    dsinks = -np.sum(sink_exp / safe_total * delta, axis=-1)
  return out, lse2, dq, dk, dv, dsinks


def assert_close(ours, expected):
  """The model's results (`NAMES`) against the reference's, to TOLERANCE
  times the reference's largest finite value (at least 1)."""
  for name, x, ref in zip(NAMES, ours, expected, strict=True):
    if ref is None:
      _check(x is None, f"{name}: {x} is not None")
      continue
    chex.assert_shape(x, ref.shape)
    finite = np.isfinite(ref)
    scale = max(1.0, float(np.max(np.abs(ref[finite]), initial=0.0)))
    chex.assert_trees_all_close(x, ref, rtol=0.0, atol=TOLERANCE * scale,
                                custom_message=name)


# The kernels' launches, traced on CPU.


class Launch(NamedTuple):
  """A Mosaic GPU kernel launch: its grid, threads and operand shapes."""

  grid: tuple[int, ...]
  grid_names: tuple[str, ...]
  num_threads: int
  in_shapes: tuple[tuple[int, ...], ...]
  out_shapes: tuple[tuple[int, ...], ...]


def _launches(fn, *args) -> list[Launch]:
  """The Mosaic GPU kernel launches of fn(*args) in trace order (traced,
  nothing lowered)."""
  found = []
  for eqn in test_util.equations(jax.make_jaxpr(fn)(*args).jaxpr,
                                 "mpmd_map"):
    (mesh,) = eqn.params["meshes"]
    found.append(Launch(
        grid=tuple(mesh.grid), grid_names=tuple(mesh.grid_names),
        num_threads=mesh.num_threads,
        in_shapes=tuple(v.aval.shape for v in eqn.invars),
        out_shapes=tuple(a.shape for a in eqn.params["out_avals"])))
  if not found:
    raise AssertionError("no Mosaic GPU kernel launch in the trace (did "
                         "plgpu.kernel stop tracing to mpmd_map?)")
  return found


@functools.cache
def _kernel_launches(case: Case, sizes: MosaicBlockSizes):
  """((forward, dQ, dK/dV) launches of the backend for `case`, the keyword
  arguments of the host code's `pipeline.segment_inputs` calls, in the
  same order (none without segments))."""
  spec, operands = case.spec, case.operands
  config = mosaic_backend.BACKEND.configure(spec, block_sizes=sizes)
  # The backward's out and dout are shaped as q, its lse2 [B, N, T].
  q = operands.query
  lse2 = jax.ShapeDtypeStruct((spec.batch, spec.num_heads, spec.q_len),
                              jnp.float32)
  segment_calls = []
  segment_inputs = pipeline.segment_inputs

  def recorded(segment_ids, **kwargs):
    segment_calls.append(kwargs)
    return segment_inputs(segment_ids, **kwargs)

  with mock.patch.object(pipeline, "segment_inputs", recorded):
    (forward,) = _launches(
        functools.partial(mosaic_backend.forward, spec, config), operands)
    delta, dq, dkv = _launches(
        functools.partial(mosaic_backend.backward, spec, config), operands,
        q, lse2, q)
  # The backward's first launch computes delta (delta.py): a block per
  # DELTA_ROWS rows of each (batch, head), every row covered.
  rows = mosaic_delta.DELTA_ROWS
  if (delta.grid != (spec.batch, spec.num_heads, -(-spec.q_len // rows))
      or delta.out_shapes != ((spec.batch, spec.num_heads,
                               delta.grid[2] * rows),)):
    raise AssertionError(f"unexpected delta launch {delta} for {spec}")
  return (forward, dq, dkv), tuple(segment_calls)


# The kernels' decisions, from the helpers they call.


def _compute_warpgroups(launch: Launch) -> int:
  """The launch's compute warpgroups: all threads but the producer (the
  last)."""
  return launch.num_threads - 1


def _over_grid(fn, launch: Launch):
  """fn(*args) once per grid point and compute warpgroup (named axes as in
  the kernel, "wg" innermost), results stacked [*grid, warpgroups]."""
  axes = [("wg", _compute_warpgroups(launch)),
          *reversed(list(zip(launch.grid_names, launch.grid)))]
  for name, size in axes:
    fn = jax.vmap(fn, in_axes=None, axis_name=name, axis_size=size)
  return fn


def _int32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), tree)


class _RecordedRanges:
  """A segment ranges table ([B, 2, tiles]) that records where it is read.

  A kernel reads its ranges table from GMEM at the tile index the helpers
  compute. A read outside the table reads other memory on a GPU (where
  jnp's indexing would clamp): here it reads the widest range, first 0 and
  stop int32 max, the worst case for the run bounds; `run_model` lists
  such reads (`_reads_past_tables`).
  """

  def __init__(self, table):
    self.table = jnp.asarray(table)
    self.reads = []

  def __getitem__(self, index):
    batch, part, tile = (jnp.asarray(i, jnp.int32) for i in index)
    self.reads.append(jnp.stack([batch, part, tile]))
    inside = ((0 <= batch) & (batch < self.table.shape[0])
              & (0 <= tile) & (tile < self.table.shape[2]))
    widest = jnp.where(part == 0, 0, jnp.iinfo(jnp.int32).max)
    return jnp.where(inside, self.table[batch, part, tile], widest)

  def read_indices(self):
    """int32 [reads, 3]: the (batch, 0 or 1, tile) of each read."""
    return jnp.stack(self.reads) if self.reads else jnp.zeros((0, 3),
                                                               jnp.int32)


class KernelRows(NamedTuple):
  """How the model cuts a kernel's blocks (`_decisions`); its host code
  must cut the segment ranges the same way (`run_model` checks)."""

  queries_own: bool  # Its blocks own query rows (else key rows).
  row_groups: int  # Row groups per block.
  group_rows: int  # Rows per row group.
  streamed_rows: int  # Rows of the other axis per streamed tile.


def _kernel_rows(spec: CallSpec, sizes: MosaicBlockSizes):
  """KernelRows of the forward, dQ and dK/dV kernels (forward_call,
  backward_call)."""
  row_groups, _ = backward_warpgroup_split(spec.head_dim)
  return (KernelRows(True, COMPUTE_WARPGROUPS, sizes.block_q,
                     sizes.block_kv),
          KernelRows(True, row_groups, sizes.block_q_dq, sizes.block_kv_dq),
          KernelRows(False, row_groups, sizes.block_kv_dkv,
                     sizes.block_q_dkv))


@functools.cache
def _host_segment_inputs(case: Case, sizes: MosaicBlockSizes):
  """The (forward, dQ, dK/dV) kernels' `pipeline.SegmentInputs` (NumPy) as
  their host code computes them, with the arguments it passed when traced
  (`_kernel_launches`); Nones without segments."""
  segment_ids = case.segment_ids()
  if segment_ids is None:
    return (None,) * 3
  _, calls = _kernel_launches(case, sizes)
  if len(calls) != 3:
    raise AssertionError(f"segment_inputs calls {calls}: not one per kernel")
  return jaxpr_numpy.jit(
      lambda ids: tuple(pipeline.segment_inputs(ids, **kwargs)
                        for kwargs in calls))(segment_ids)


# Helpers of the kernels' host code, whose results `_kernel_launches` and
# `_host_segment_inputs` cache: a test that breaks one must clear the
# caches first (`clear_host_caches`), and after.
HOST_HELPERS = frozenset({"segment_inputs", "_pad_ids"})


def clear_host_caches():
  """Forgets the traced launches and host segment inputs of every case."""
  for cached in (_kernel_launches, _host_segment_inputs):
    cached.cache_clear()


def _decisions(case: Case, sizes: MosaicBlockSizes, launches, segments):
  """Every grid point's decisions of the three kernels, as NumPy arrays
  [*grid, warpgroup], and the (static) kinds of their runs; `segments`:
  the kernels' `_host_segment_inputs`."""
  spec = case.spec
  mask, q_seq, kv_seq, group = (spec.mask, spec.q_len, spec.kv_len,
                                spec.group)
  forward_launch, dq_launch, dkv_launch = launches
  forward_rows, dq_rows, dkv_rows = _kernel_rows(spec, sizes)
  _, chunks = backward_warpgroup_split(spec.head_dim)
  kinds = {}

  def runs_of(name, runs):
    kinds[name] = tuple(kind for _, _, kind in runs)
    return [(lo, hi) for lo, hi, _ in runs]

  def recorded(segments):
    """(block ranges, group ranges) as `_RecordedRanges`, or Nones."""
    if segments is None:
      return None, None
    return (_RecordedRanges(segments.block_ranges),
            _RecordedRanges(segments.group_ranges))

  def reads(block_ranges, group_ranges):
    """The tables' read indices, as decisions (none without segments)."""
    if block_ranges is None:
      return {}
    return dict(block_reads=block_ranges.read_indices(),
                group_reads=group_ranges.read_indices())

  def over_key_tiles(name, block_q, block_kv, num_row_groups, num_chunks):
    """The decisions of a kernel that walks key tiles for its query rows
    (forward, dQ): num_row_groups groups of block_q rows, each split into
    num_chunks column chunks, one per compute warpgroup."""

    def decide(q_lengths, kv_lengths, segments, position=None):
      block_ranges, group_ranges = recorded(segments)
      block = pipeline.query_block(
          mask, q_lengths, kv_lengths, q_seq=q_seq, kv_seq=kv_seq,
          block_rows=num_row_groups * block_q, block_kv=block_kv,
          ranges_ref=block_ranges, position=position)
      row_group = pipeline.row_group_of(block.warpgroup, num_chunks)
      chunk = pipeline.column_chunk_of(block.warpgroup, num_chunks)
      q_start = pipeline.row_group_start(block.start, row_group, block_q)
      own = pipeline.key_tiles(mask, block, q_start, block_q, block_kv,
                               ranges_ref=group_ranges)
      runs = pipeline.consumer_runs(own, block.steps_lo, block.steps_hi)
      return _int32(dict(
          block._asdict(), q_start=q_start, chunk=chunk,
          kv_head=pipeline.kv_head_of(block.head, group),
          runs=runs_of(name, runs), **reads(block_ranges, group_ranges)))

    return decide

  # The forward's warpgroups each own a row group, all columns.
  forward = over_key_tiles("forward", forward_rows.group_rows,
                           forward_rows.streamed_rows,
                           forward_rows.row_groups, 1)
  dq = over_key_tiles("dq", dq_rows.group_rows, dq_rows.streamed_rows,
                      dq_rows.row_groups, chunks)
  persistent = _persistent_grid(case, sizes, forward_launch)
  if persistent is not None:
    forward = _over_persistent_blocks(forward, persistent)

  num_q_tiles = -(-q_seq // sizes.block_q_dkv)

  def dkv(q_lengths, kv_lengths, segments):
    block_ranges, group_ranges = recorded(segments)
    block = pipeline.key_block(
        mask, q_lengths, kv_lengths, q_seq=q_seq, kv_seq=kv_seq,
        block_rows=dkv_rows.row_groups * sizes.block_kv_dkv,
        block_q=sizes.block_q_dkv, group=group, ranges_ref=block_ranges)
    row_group = pipeline.row_group_of(block.warpgroup, chunks)
    chunk = pipeline.column_chunk_of(block.warpgroup, chunks)
    k_start = pipeline.row_group_start(block.start, row_group,
                                       sizes.block_kv_dkv)
    own = pipeline.query_tiles(mask, block, k_start, sizes.block_kv_dkv,
                               sizes.block_q_dkv, ranges_ref=group_ranges)
    runs = pipeline.consumer_runs(own, block.tiles_lo, block.tiles_hi)
    # The ring: the consumers' slot of each (head of the group, query
    # tile); what the producer loads at each step, and where: `produce`
    # puts step i of [0, num_steps) in slot i for the first `stages`, then
    # in slot_of(i), which is the same.
    stages = sizes.backward_stages
    slots = jax.vmap(jax.vmap(
        lambda head_step, tile: pipeline.group_slot(head_step, tile, block,
                                                    stages),
        in_axes=(None, 0)), in_axes=(0, None))(
            jnp.arange(group, dtype=jnp.int32),
            jnp.arange(num_q_tiles, dtype=jnp.int32))
    steps = jnp.arange(group * num_q_tiles, dtype=jnp.int32)
    loads = jax.vmap(lambda step: (
        *pipeline.group_step_rows(step, block, group, sizes.block_q_dkv),
        pipeline.slot_of(step, 0, stages)))(steps)
    return _int32(dict(
        block._asdict(), k_start=k_start, chunk=chunk,
        runs=runs_of("dkv", runs), slots=slots, loads=loads,
        **reads(block_ranges, group_ranges)))

  def decide(q_lengths, kv_lengths, segments):
    return tuple(
        _over_grid(fn, launch)(q_lengths, kv_lengths, kernel_segments)
        for fn, launch, kernel_segments in zip(
            (forward, dq, dkv), (forward_launch, dq_launch, dkv_launch),
            segments))

  decisions = jaxpr_numpy.jit(decide)(*case.lengths_arrays(), segments)
  return decisions, kinds


def _persistent_grid(case: Case, sizes: MosaicBlockSizes, launch: Launch):
  """The forward's `pipeline.PersistentGrid` as `forward_call` builds it,
  or None for a launch of one block per tile; checked against the launch."""
  spec = case.spec
  if launch.grid_names != ("programs",):
    return None
  num_tiles = -(-spec.q_len // (COMPUTE_WARPGROUPS * sizes.block_q))
  persistent = pipeline.PersistentGrid.over(
      num_tiles, spec.num_heads, spec.batch, pairs=spec.mask.is_causal)
  if (persistent.programs,) != launch.grid:
    raise AssertionError(f"{persistent} does not match the launch {launch}")
  return persistent


def _over_persistent_blocks(decide, persistent: pipeline.PersistentGrid):
  """decide(...) of each block a program of a persistent launch computes,
  in its order, stacked [blocks] with a "valid" flag (blocks past the
  program's, and the second block of a middle tile's pair, are not
  computed)."""
  max_blocks = (-(-persistent.items // persistent.programs)
                * persistent.blocks_per_item)

  def over_blocks(q_lengths, kv_lengths, segments):
    def one(j):
      position, valid = persistent.position(j)
      decided = decide(q_lengths, kv_lengths, segments, position=position)
      return dict(decided, valid=jnp.asarray(
          jnp.logical_and(valid, j < persistent.num_blocks()), jnp.int32))

    return jax.vmap(one)(jnp.arange(max_blocks, dtype=jnp.int32))

  return over_blocks


def _block_points(launch: Launch, decisions):
  """The indices of the blocks a kernel computes in `decisions`: (grid
  point, warpgroup), or for a persistent launch (program, warpgroup,
  block) of its valid blocks, which must lie in the arrays and cover every
  (batch, head, row group) once."""
  if launch.grid_names != ("programs",):
    return list(_grid_points(launch))
  valid = np.asarray(decisions["valid"])
  points = [p for p in np.ndindex(*valid.shape) if valid[p]]
  batch, _, num_heads, _ = launch.in_shapes[0]
  rows = collections.Counter(
      tuple(int(np.asarray(decisions[key])[p])
            for key in ("batch", "head", "q_start")) for p in points)
  outside = [r for r in rows if not (0 <= r[0] < batch
                                     and 0 <= r[1] < num_heads)]
  _check(not outside, f"persistent blocks outside the arrays: {outside}")
  repeated = {r: n for r, n in rows.items() if n > 1}
  _check(not repeated, f"persistent programs compute these (batch, head, "
                       f"first row) blocks more than once: {repeated}")
  return points


def _at(decisions, index):
  """One grid point's decisions: Python ints, arrays for the tables."""

  def pick(x):
    x = np.asarray(x)[index]
    return int(x) if x.ndim == 0 else x

  return jax.tree.map(pick, decisions)


def _grid_points(launch: Launch):
  return np.ndindex(*launch.grid, _compute_warpgroups(launch))


# TMA, as the model sees it.


def _load_rows(x, start: int, rows: int):
  """x[start:start + rows] ([L, ...]), zeros outside [0, L)."""
  out = np.zeros((rows,) + x.shape[1:])
  lo, hi = max(start, 0), min(start + rows, x.shape[0])
  if lo < hi:
    out[lo - start:hi - start] = x[lo:hi]
  return out


def _store_rows(dst, start: int, values):
  """dst[start:start + len(values)] = values, rows outside dst dropped."""
  lo, hi = max(start, 0), min(start + len(values), dst.shape[0])
  if lo < hi:
    dst[lo:hi] = values[lo - start:hi - start]


def _load_stats(stats, batch: int, head: int, start: int, rows: int):
  """A 1-D copy of stats[batch, head, start:start + rows] ([B, N, L]):
  bounded by the whole array, so past L it reads the next head's rows."""
  flat = stats.reshape(-1)
  index = (batch * stats.shape[1] + head) * stats.shape[2] + start
  return _load_rows(flat, index, rows)


def _load_ids(ids, batch: int, start: int, rows: int):
  """A 1-D copy of ids[batch, start:start + rows] ([B, L'] int32), as
  `pipeline.load_ids` makes it: bounded by the whole array, not by its row.

  Past L' it would read the next batch element's ids; those positions are
  past the sequence, hence masked whatever their ids, but load_ids' contract
  is that the host pads the ids to whole tiles so that no load leaves its
  row (`segment_inputs`): the model checks it.
  """
  _check(0 <= start and start + rows <= ids.shape[1],
         f"segment ids load [{start}, {start + rows}) of batch {batch} "
         f"leaves its row of {ids.shape[1]}")
  flat = ids.reshape(-1)
  return _load_rows(flat, batch * ids.shape[1] + start, rows).astype(
      np.int32)


def _id_loads(segments, batch: int, own_start: int, own_rows: int,
              streamed_starts, streamed_rows: int):
  """The segment ids loads a consumer's tiles come with, as the kernels
  issue them whether or not the tile is then computed: its row group's own
  ids, and the ids of every tile the producer streams (`streamed_starts`).
  Only their bounds matter here (`_load_ids`' check); the masks load the
  same ids again where they need them."""
  if segments is None:
    return
  _load_ids(segments.own_ids, batch, own_start, own_rows)
  for start in streamed_starts:
    _load_ids(segments.streamed_ids, batch, start, streamed_rows)


def _streamed_starts(lo: int, hi: int, rows: int):
  """The first rows of the tiles a producer streams at steps [lo, hi)
  (forward, dQ: key tiles of `rows` rows)."""
  return [pipeline.tile_start(step, rows) for step in range(lo, hi)]


def _reads_past_tables(decisions, segments) -> list[str]:
  """The reads of the segment ranges tables ([B, 2, tiles]) outside them,
  by any grid point and warpgroup of the three kernels (a GPU would read
  other memory there)."""
  found = []
  for kernel, kernel_decisions, kernel_segments in zip(
      ("forward", "dq", "dkv"), decisions, segments):
    if kernel_segments is None:
      continue
    for name, table in (("block", kernel_segments.block_ranges),
                        ("group", kernel_segments.group_ranges)):
      reads = np.asarray(kernel_decisions[f"{name}_reads"]).reshape(-1, 3)
      batch, part, tile = reads.T
      inside = ((0 <= batch) & (batch < table.shape[0])
                & ((part == 0) | (part == 1))
                & (0 <= tile) & (tile < table.shape[2]))
      found += [f"{kernel} reads its {name} ranges {table.shape} at "
                f"{tuple(int(i) for i in read)}"
                for read in np.unique(reads[~inside], axis=0)]
  return found


# The model: the three kernels' tile walks.


def _dot(a, b):
  """a @ b of two tiles, in NumPy's own loop (einsum), single-threaded:
  a BLAS matmul of tiles this small spends more CPU time waking its
  threads than multiplying (about 30 times more with two pytest workers
  sharing two cores)."""
  return np.einsum("ij,jk->ik", a, b)


def _logits2(case: Case, scores):
  """Base-2 logits and tanh (numerics.logits_base2, in float64)."""
  spec = case.spec
  if spec.logits_soft_cap is None:
    return scores * (spec.scale * numerics.LOG2_E), None
  tanh = np.tanh(scores * (spec.scale / spec.logits_soft_cap))
  return tanh * (spec.logits_soft_cap * numerics.LOG2_E), tanh


def _dlogits2(probs, dprobs_minus_delta, tanh):
  """A tile's dS, the gradient of its scores: P (dP - delta), through the
  soft cap's tanh where there is one (tanh: of `_logits2`, or None)."""
  ds = probs * dprobs_minus_delta
  return ds if tanh is None else ds * (1.0 - tanh * tanh)


def _key_tile_masks(mask: MaskSpec, block_q: int, block_kv: int, segments):
  """seen(batch, q_start, kv_step, kv_len, offset): `key_tile_visible` of a
  row group's key tile, as NumPy (memoized: heads and warpgroups share
  them). With segments (`segments`: the kernel's SegmentInputs), the ids
  tiles the kernels pass: the rows' ids, loaded with the row group's Q at
  q_start, broadcast along the columns; the key tile's, loaded with K at
  `pipeline.tile_start(kv_step, block_kv)`, along the rows."""
  rows = np.arange(block_q)[:, None]
  columns = np.arange(block_kv)[None, :]
  shape = (block_q, block_kv)
  # Traced once per offset, kept a Python int (a top-left mask's is the
  # kernels' static 0, which masks.visible leaves out), and evaluated in
  # NumPy for every tile.
  visible = jaxpr_numpy.jit(
      lambda rows, kv_step, kv_len, offset, *ids: pipeline.key_tile_visible(
          mask, rows, columns, kv_step, block_kv, kv_len, offset, *ids),
      static_argnums=(3,))

  @functools.cache
  def seen(batch, q_start, kv_step, kv_len, offset):
    ids = ()
    if segments is not None:
      ids = (np.broadcast_to(_load_ids(segments.own_ids, batch, q_start,
                                       block_q)[:, None], shape),
             np.broadcast_to(_load_ids(
                 segments.streamed_ids, batch,
                 pipeline.tile_start(kv_step, block_kv), block_kv)[None, :],
                 shape))
    # The ids positionally, as the kernels pass them.
    return visible(q_start + rows, kv_step, kv_len, offset, *ids)

  if segments is None:
    # The same masks for every batch element.
    return lambda batch, *args: seen(None, *args)
  return seen


def _check_walk(point, runs, lo: int, hi: int):
  """A consumer steps through exactly the producer's steps [lo, hi)."""
  walked = [step for run_lo, run_hi in runs
            for step in range(run_lo, run_hi)]
  _check(walked == list(range(lo, hi)),
         f"consumer {point}: runs {runs} do not walk the producer's steps "
         f"[{lo}, {hi})")


def _computed_key_tiles(runs, kinds, k, v, block_kv: int):
  """(step, kind, k tile, v tile) of each key tile a forward or dQ consumer
  computes: the steps of its runs, "skip" runs left out. k, v: [S, D], the
  row's kv head."""
  for (lo, hi), kind in zip(runs, kinds):
    if kind == "skip":
      continue
    for step in range(lo, hi):
      start = pipeline.tile_start(step, block_kv)
      yield (step, kind, _load_rows(k, start, block_kv),
             _load_rows(v, start, block_kv))


def _model_forward(case: Case, sizes, launch: Launch, decisions, kinds,
                   segments, q, k, v, sinks):
  """(out [B, T, N, D], lse2 [B, N, T]) of the forward kernel's walk."""
  spec = case.spec
  mask = spec.mask
  block_q, block_kv = sizes.block_q, sizes.block_kv
  padded_q, padded_k = launch.in_shapes[0], launch.in_shapes[1]
  q = np.pad(q, [(0, 0), (0, padded_q[1] - spec.q_len), (0, 0), (0, 0)])
  k, v = (np.pad(x, [(0, 0), (0, padded_k[1] - spec.kv_len), (0, 0),
                     (0, 0)]) for x in (k, v))
  out = np.full(launch.out_shapes[0], np.nan)
  lse = np.full(launch.out_shapes[1], np.nan)
  tile_rows = np.arange(block_q)
  seen_of = _key_tile_masks(mask, block_q, block_kv, segments)
  for point in _block_points(launch, decisions):
    d = _at(decisions, point)
    b, h, kh, q_start = d["batch"], d["head"], d["kv_head"], d["q_start"]
    _check_walk(point, d["runs"], d["steps_lo"], d["steps_hi"])
    _id_loads(segments, b, q_start, block_q,
              _streamed_starts(d["steps_lo"], d["steps_hi"], block_kv),
              block_kv)
    q_tile = _load_rows(q[b, :, h], q_start, block_q)
    rows = q_start + tile_rows[:, None]
    acc = np.zeros((block_q, spec.head_dim))
    row_max = np.full(block_q, numerics.MASK_VALUE)
    row_sum = np.zeros(block_q)
    if sinks is not None:
      row_max[:], row_sum[:] = sinks[b, h] * numerics.LOG2_E, 1.0
    for step, kind, k_tile, v_tile in _computed_key_tiles(
        d["runs"], kinds, k[b, :, kh], v[b, :, kh], block_kv):
      logits, _ = _logits2(case, _dot(q_tile, k_tile.T))
      if kind == "masked":
        seen = seen_of(b, q_start, step, d["kv_len"], d["offset"])
        logits = np.where(seen, logits, numerics.MASK_VALUE)
      new_max = np.maximum(row_max, logits.max(axis=1))
      probs = np.exp2(logits - new_max[:, None])
      if kind == "masked":
        probs = np.where(seen, probs, 0.0)
      correction = np.exp2(row_max - new_max)
      acc = acc * correction[:, None] + _dot(probs, v_tile)
      row_sum = row_sum * correction + probs.sum(axis=1)
      row_max = new_max
    has_keys = (row_sum > 0.0) & (rows[:, 0] < d["q_len"])
    safe_sum = np.where(has_keys, row_sum, 1.0)
    _store_rows(out[b, :, h], q_start,
                np.where(has_keys[:, None], acc / safe_sum[:, None], 0.0))
    # A 1-D TMA store is bounded by the whole array: it must stay in its
    # own row of the lse array, or it would write the next head's.
    _check(0 <= q_start and q_start + block_q <= lse.shape[2],
           f"lse store of {point} leaves its row")
    lse[b, h, q_start:q_start + block_q] = np.where(
        has_keys, row_max + np.log2(safe_sum), np.inf)
  return out[:, :spec.q_len], lse[..., :spec.q_len]


def _model_dq(case: Case, sizes, launch: Launch, decisions, kinds, segments,
              q, k, v, dout, lse2, delta):
  """dq [B, T, N, D] of the dQ kernel's walk."""
  spec = case.spec
  block_q, block_kv = sizes.block_q_dq, sizes.block_kv_dq
  q, dout, k, v, lse2, delta = _padded_backward_inputs(
      case, launch, q, dout, k, v, lse2, delta)
  dq = np.full(launch.out_shapes[0], np.nan)
  tile_rows = np.arange(block_q)
  seen_of = _key_tile_masks(spec.mask, block_q, block_kv, segments)
  shared_walks = {}
  valid_lse = jaxpr_numpy.jit(pipeline.valid_lse)
  for point in _grid_points(launch):
    d = _at(decisions, point)
    b, h, kh, q_start = d["batch"], d["head"], d["kv_head"], d["q_start"]
    chunk = _columns(spec, d["chunk"], "dq")
    _check_walk(point, d["runs"], d["steps_lo"], d["steps_hi"])
    _check_shared_walk(spec, shared_walks, point, d, "q_start")
    _id_loads(segments, b, q_start, block_q,
              _streamed_starts(d["steps_lo"], d["steps_hi"], block_kv),
              block_kv)
    q_tile = _load_rows(q[b, :, h], q_start, block_q)
    do_tile = _load_rows(dout[b, :, h], q_start, block_q)
    row_ids = q_start + tile_rows
    lse = valid_lse(_load_stats(lse2, b, h, q_start, block_q), row_ids,
                    d["q_len"])
    row_delta = _load_stats(delta, b, h, q_start, block_q)
    acc = np.zeros((block_q, spec.head_dim))
    for step, kind, k_tile, v_tile in _computed_key_tiles(
        d["runs"], kinds, k[b, :, kh], v[b, :, kh], block_kv):
      logits, tanh = _logits2(case, _dot(q_tile, k_tile.T))
      probs = np.exp2(logits - lse[:, None])
      if kind == "masked":
        probs = np.where(
            seen_of(b, q_start, step, d["kv_len"], d["offset"]), probs, 0.0)
      ds = _dlogits2(probs, _dot(do_tile, v_tile.T) - row_delta[:, None], tanh)
      acc += _dot(ds, k_tile)
    if chunk is not None:
      _store_rows(dq[b, :, h, chunk], q_start, acc[:, chunk] * spec.scale)
  return dq[:, :spec.q_len]


def _model_dkv(case: Case, sizes, launch: Launch, decisions, kinds,
               segments, q, k, v, dout, lse2, delta):
  """(dk, dv) [B, S, K, D] of the dK/dV kernel's walk."""
  spec = case.spec
  block_q, block_kv = sizes.block_q_dkv, sizes.block_kv_dkv
  q, dout, k, v, lse2, delta = _padded_backward_inputs(
      case, launch, q, dout, k, v, lse2, delta)
  dk = np.full(launch.out_shapes[0], np.nan)
  dv = np.full(launch.out_shapes[1], np.nan)
  shared_walks = {}
  query_offsets = np.arange(block_q)
  shape = (block_kv, block_q)
  valid_lse = jaxpr_numpy.jit(pipeline.valid_lse)
  # As `_key_tile_masks`' visible.
  visible = jaxpr_numpy.jit(
      lambda q_start, key_ids, kv_len, offset, *ids: (
          pipeline.query_tile_visible(spec.mask, query_offsets[None, :],
                                      q_start, key_ids, kv_len, offset,
                                      *ids)),
      static_argnums=(3,))

  @functools.cache
  def seen_of(batch, ids_start, q_start, k_start, kv_len, offset):
    """The transposed tile's mask (rows: keys); with segments, the query
    ids loaded with Q in the ring at the producer's rows `ids_start`,
    broadcast along the rows, and the row group's key ids, loaded with its
    K at k_start, along the columns (positionally, as the kernel)."""
    ids = ()
    if segments is not None:
      ids = (np.broadcast_to(_load_ids(segments.streamed_ids, batch,
                                       ids_start, block_q)[None, :], shape),
             np.broadcast_to(_load_ids(segments.own_ids, batch, k_start,
                                       block_kv)[:, None], shape))
    return visible(q_start, k_start + np.arange(block_kv)[:, None], kv_len,
                   offset, *ids)

  for point in _grid_points(launch):
    d = _at(decisions, point)
    b, kh, k_start = d["batch"], d["kv_head"], d["k_start"]
    dk_columns = _columns(spec, d["chunk"], "dk")
    dv_columns = _columns(spec, d["chunk"], "dv")
    _check_shared_walk(spec, shared_walks, point, d, "k_start")
    loaded_heads, loaded_starts, loaded_slots = d["loads"]
    _id_loads(segments, b, k_start, block_kv,
              loaded_starts[:d["num_steps"]], block_q)
    k_tile = _load_rows(k[b, :, kh], k_start, block_kv)
    v_tile = _load_rows(v[b, :, kh], k_start, block_kv)
    dk_acc = np.zeros((block_kv, spec.head_dim))
    dv_acc = np.zeros_like(dk_acc)
    step = 0  # The producer's step this consumer reads next.
    for head_step in range(spec.group):
      for (lo, hi), kind in zip(d["runs"], kinds):
        for q_tile_index in range(lo, hi):
          _check(step < d["num_steps"],
                 f"consumer {point} reads past the producer's "
                 f"{d['num_steps']} steps")
          slot, loaded_slot = (d["slots"][head_step, q_tile_index],
                               loaded_slots[step])
          _check(slot == loaded_slot,
                 f"consumer {point}: (head {head_step}, query tile "
                 f"{q_tile_index}) is in slot {slot}, not in the slot "
                 f"{loaded_slot} of the producer's step {step}")
          head, rows_start = loaded_heads[step], loaded_starts[step]
          _check(0 <= q_tile_index and 0 <= head < spec.num_heads,
                 f"consumer {point}: query tile {q_tile_index}, head {head}")
          step += 1
          if kind == "skip":
            continue
          q_start = pipeline.tile_start(q_tile_index, block_q)
          q_tile = _load_rows(q[b, :, head], rows_start, block_q)
          do_tile = _load_rows(dout[b, :, head], rows_start, block_q)
          lse = valid_lse(
              _load_stats(lse2, b, head, rows_start, block_q),
              q_start + query_offsets, d["q_len"])
          logits, tanh = _logits2(case, _dot(k_tile, q_tile.T))
          probs = np.exp2(logits - lse[None, :])
          if kind == "masked":
            # Without segments the mask is the same for every batch
            # element and load position.
            ids_at = (b, rows_start) if segments is not None else (None,
                                                                  None)
            probs = np.where(seen_of(*ids_at, q_start, k_start,
                                     d["kv_len"], d["offset"]), probs, 0.0)
          dv_acc += _dot(probs, do_tile)
          row_delta = _load_stats(delta, b, head, rows_start, block_q)
          ds = _dlogits2(probs, _dot(v_tile, do_tile.T) - row_delta[None, :],
                         tanh)
          dk_acc += _dot(ds, q_tile)
    _check(step == d["num_steps"],
           f"consumer {point} reads {step} of the producer's "
           f"{d['num_steps']} steps")
    if dk_columns is not None:
      _store_rows(dk[b, :, kh, dk_columns], k_start,
                  dk_acc[:, dk_columns] * spec.scale)
    if dv_columns is not None:
      _store_rows(dv[b, :, kh, dv_columns], k_start, dv_acc[:, dv_columns])
  return dk[:, :spec.kv_len], dv[:, :spec.kv_len]


def _columns(spec: CallSpec, chunk: int, output: str) -> slice | None:
  """The head_dim columns of `output` ("dq", "dk" or "dv") that a backward
  warpgroup of column chunk `chunk` accumulates and stores, or None. A
  column split: its chunk's columns of each; a product split
  (`config.backward_splits_products`): chunk 0 (the probabilities) all of
  dV, chunk 1 (the gradients) all of dQ and dK."""
  _, chunks = backward_warpgroup_split(spec.head_dim)
  if backward_splits_products(spec.head_dim):
    owner = 0 if output == "dv" else 1
    return slice(0, spec.head_dim) if chunk == owner else None
  width = spec.head_dim // chunks
  return slice(chunk * width, (chunk + 1) * width)


def _check_shared_walk(spec: CallSpec, walks: dict, point, d, start: str):
  """With a product split the gradients warpgroup takes over the
  probabilities of its row tile's other warpgroup step by step: both must
  walk the same rows and runs (their steps, and the kinds, which `kinds`
  shares)."""
  if not backward_splits_products(spec.head_dim):
    return
  walk = (d[start], tuple(map(tuple, d["runs"])))
  first = walks.setdefault(point[:-1], walk)
  _check(walk == first,
         f"consumer {point} walks {walk}, its row tile's other warpgroup "
         f"{first}: the hand-over of probabilities would go out of step")


def _padded_backward_inputs(case: Case, launch: Launch, q, dout, k, v, lse2,
                            delta):
  """The backward kernels' operands as `backward_call` pads them (rows to
  the launch's shapes: zeros, lse2 +inf, delta 0)."""
  padded_q, padded_k = launch.in_shapes[0], launch.in_shapes[1]
  rows = lambda x, n: np.pad(x, [(0, 0), (0, n - x.shape[1]), (0, 0),
                                 (0, 0)])
  stats = lambda x, value: np.pad(
      x, [(0, 0), (0, 0), (0, launch.in_shapes[4][2] - x.shape[2])],
      constant_values=value)
  return (rows(q, padded_q[1]), rows(dout, padded_q[1]),
          rows(k, padded_k[1]), rows(v, padded_k[1]), stats(lse2, np.inf),
          stats(delta, 0.0))


def run_model(case: Case, q, k, v, dout, sinks,
              reads_past_tables: list | None = None):
  """(out, lse2, dq, dk, dv, dsinks) of the three kernels' walks.

  Args:
    case: the call.
    q, k, v, dout, sinks: its inputs (`random_inputs`).
    reads_past_tables: a list to add the reads of segment ranges outside
      their tables to (`_reads_past_tables`), or None: there must be none.

  Raises:
    AssertionError: a check of the walks (see the module docstring) fails.
  """
  with mock.patch.object(pipeline, "sm_count", lambda: MODEL_SM_COUNT):
    return _run_model(case, q, k, v, dout, sinks, reads_past_tables)


def _run_model(case: Case, q, k, v, dout, sinks, reads_past_tables):
  """run_model's work, under its patch."""
  sizes = case.block_sizes or mosaic_backend.BACKEND.configure(
      case.spec).block_sizes
  launches, segment_calls = _kernel_launches(case, sizes)
  forward_launch, dq_launch, dkv_launch = launches
  for launch in launches:
    _check(launch.num_threads == COMPUTE_WARPGROUPS + 1,
           f"{launch}: not {COMPUTE_WARPGROUPS} compute warpgroups and a "
           f"producer")
    # q, k, v (and dout): [B, rows, heads, D].
    for shape in launch.in_shapes:
      if len(shape) == 4:
        _check(shape[1] % TMA_ROWS == 0,
               f"{launch}: rows of {shape} not a multiple of {TMA_ROWS}")
  # The host code cuts the segment ranges as the model cuts the blocks.
  for rows, kwargs in zip(_kernel_rows(case.spec, sizes), segment_calls):
    expected = dict(
        queries_own=rows.queries_own,
        block_rows=rows.row_groups * rows.group_rows,
        group_rows=rows.group_rows, streamed_rows=rows.streamed_rows)
    _check(kwargs == expected,
           f"segment_inputs called with {kwargs}, the model cuts {expected}")
  segments = _host_segment_inputs(case, sizes)
  decisions, kinds = _decisions(case, sizes, launches, segments)
  for launch, kernel_segments in zip(launches, segments):
    if kernel_segments is not None:
      # The model's segment inputs are the launch's (same block sizes).
      shapes = tuple(x.shape for x in kernel_segments)
      _check(shapes in [launch.in_shapes[i:i + len(shapes)]
                        for i in range(len(launch.in_shapes))],
             f"{launch}: no segment inputs {shapes}")
  past = _reads_past_tables(decisions, segments)
  if reads_past_tables is None:
    _check(not past, f"reads of segment ranges past their tables: {past}")
  else:
    reads_past_tables += past
  out, lse2 = _model_forward(case, sizes, forward_launch, decisions[0],
                             kinds["forward"], segments[0], q, k, v, sinks)
  # The backend's delta: rowsum(dO * O), [B, N, T].
  delta = np.einsum("btnd,btnd->bnt", dout, out)
  dq = _model_dq(case, sizes, dq_launch, decisions[1], kinds["dq"],
                 segments[1], q, k, v, dout, lse2, delta)
  dk, dv = _model_dkv(case, sizes, dkv_launch, decisions[2], kinds["dkv"],
                      segments[2], q, k, v, dout, lse2, delta)
  dsinks = None
  if sinks is not None:
    dsinks = np.asarray(jax.jit(modifiers.sinks_gradient)(
        jnp.asarray(sinks, jnp.float32), jnp.asarray(lse2, jnp.float32),
        jnp.asarray(delta, jnp.float32)))
  return out, lse2, dq, dk, dv, dsinks
