"""The Mosaic GPU kernels lower for CUDA, on any machine.

No interpreter runs Mosaic GPU kernels (they need Hopper's wgmma, TMA and
setmaxnreg), so on CPU this is what checks them: each configuration is
traced and lowered for the "cuda" platform, which builds the kernel's
Mosaic GPU module (shapes, layouts, barriers, shared-memory budget) without
a GPU. Their numerics are checked by the GPU suite (JFLASH_TEST_ON_GPU=1 on
an H100 or H200: every kernel test runs with implementation="mosaic"); on
CPU, tests/mosaic_masking_test.py checks their masking and tiling
numerically, with a model of their tile walks built from the helpers they
call.
"""

import dataclasses
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from jflash._src.backends.mosaic import backend as mosaic_backend
from jflash._src.backends.mosaic import backward as mosaic_backward
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic import forward as mosaic_forward
from jflash._src.backends.mosaic import pipeline
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.spec import ModifierSpec
from jflash._src.spec import Operands

# name, (B, T, S, N, K, H), dtype, MaskSpec options, soft cap. Few cases,
# each combining features (the backward's lowering takes 1-2.5 s on CPU).
CASES = (
    ("plain", (2, 256, 256, 4, 4, 128), "bfloat16", {}, None),
    ("fp16_d64_ragged_causal", (1, 100, 300, 2, 2, 64), "float16",
     dict(is_causal=True), None),
    ("d256_gqa_causal_lengths_segments", (3, 128, 256, 4, 1, 256),
     "bfloat16", dict(is_causal=True, has_lengths=True, has_segments=True),
     None),
    ("ragged_gqa_segments_soft_cap", (2, 200, 130, 4, 2, 128), "bfloat16",
     dict(has_segments=True), 10.0),
    ("bottom_right_window_soft_cap", (1, 200, 520, 2, 2, 128), "bfloat16",
     dict(is_causal=True, bottom_right=True, window=(100, 0)), 20.0),
    ("two_sided_window_sinks", (2, 256, 256, 2, 2, 64), "bfloat16",
     dict(window=(64, 30)), None),
    # Head dim 256: the backward's product split (config.
    # backward_splits_products), with and without a mask and a cap.
    ("d256_mqa_sinks", (1, 192, 256, 4, 1, 256), "bfloat16", {}, None),
    ("d256_bottom_right_window_soft_cap", (2, 200, 330, 4, 2, 256),
     "float16", dict(is_causal=True, bottom_right=True, window=(100, 20)),
     30.0),
)


def _kernel_jaxpr(pass_fn, *args) -> str:
  """The printed jaxpr of pass_fn, its kernels' bodies included: unlike
  the lowered module's bytes, the same for the same kernel. Traced through
  a new function object each time: make_jaxpr, as jit, reuses the first
  trace of a function object it has seen (module switches patched in
  between would not be read again)."""
  return str(jax.make_jaxpr(lambda *a: pass_fn(*a))(*args))


def _fp8_operands(batch, q_len, kv_len, heads, kv_heads, head_dim):
  """Shapes of float8_e4m3fn q, k, v and their float32 [B, K] descales."""
  sds = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  descale = sds((batch, kv_heads), jnp.float32)
  return Operands(
      query=sds((batch, q_len, heads, head_dim), fp8),
      key=sds((batch, kv_len, kv_heads, head_dim), fp8),
      value=sds((batch, kv_len, kv_heads, head_dim), fp8),
      q_descale=descale, k_descale=descale, v_descale=descale)


def _lower(pass_fn, *args):
  """(the lowered module's text for CUDA, the output shapes). One trace
  gives both: tracing the kernels again for their shapes costs ~0.5 s."""
  # A new function object: jit reuses the first trace of one it has seen.
  traced = jax.jit(lambda *a: pass_fn(*a)).trace(*args)
  return (traced.lower(lowering_platforms=("cuda",)).as_text(),
          traced.out_info)


class MosaicLoweringTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(c[0], *c) for c in CASES])
  def test_both_passes_lower_for_cuda(self, name, shape, dtype,
                                      mask_options, soft_cap):
    self._check_lowering(name, shape, dtype, mask_options, soft_cap)

  def test_d256_column_split_lowers_for_cuda(self):
    # config.BWD_SHARED_ROW_SPLIT = "columns" (the option), with segments
    # and a soft cap.
    with mock.patch.object(mosaic_config, "BWD_SHARED_ROW_SPLIT",
                           "columns"):
      self._check_lowering(
          "d256_columns", (2, 128, 200, 4, 2, 256), "bfloat16",
          dict(is_causal=True, has_segments=True), 20.0)

  @parameterized.named_parameters(
      # (LONGEST_FIRST_MAX_BYTES, modeled tail, expected grid_names with
      # "T" for the kernel's tile axis). The case streams 196608 bytes per
      # kernel (K/V or Q/dO), 98304 per batch element.
      ("longest_first_past_the_tail", 0, 1.0, ("T", "heads", "batch")),
      ("longest_first_per_batch_element", 98304, 0.0,
       ("batch", "T", "heads")),
      ("tile_last", 0, 0.0, ("batch", "heads", "T")),
  )
  def test_causal_grid_orders_lower_for_cuda(self, max_bytes, tail,
                                             expected):
    # The orders `pipeline.tile_grid` picks above LONGEST_FIRST_MAX_BYTES
    # (only at sizes the suite's shapes never reach), forced on a small
    # causal call with lengths (the forward not persistent: its grid is a
    # tile grid too), every kernel lowered with its grid in that order.
    grids = []
    tile_grid = pipeline.tile_grid

    def spy(*args, **kwargs):
      grid = tile_grid(*args, **kwargs)
      grids.append(tuple("T" if name.endswith("_tiles") else name
                         for name in grid["grid_names"]))
      return grid

    with mock.patch.object(pipeline, "LONGEST_FIRST_MAX_BYTES", max_bytes), \
        mock.patch.object(pipeline, "tile_last_tail", lambda *_: tail), \
        mock.patch.object(pipeline, "tile_grid", spy):
      self._check_lowering("grid_order", (2, 192, 192, 2, 2, 64),
                           "bfloat16", dict(is_causal=True,
                                            has_lengths=True), None)
    self.assertEqual(grids, [expected] * 3)  # Forward, dQ, dK/dV.

  def test_other_tiles_lower_for_cuda(self):
    # A deeper forward ring of 128-key tiles (230,400 bytes of tiles at
    # head dim 128: it fits without Mosaic's reduction scratch, which the
    # kernels do not reserve), wider backward ring tiles.
    self._check_lowering(
        "tiles", (1, 192, 320, 2, 2, 128), "bfloat16", dict(is_causal=True),
        None, block_sizes=MosaicBlockSizes(
            block_kv=128, num_stages=3, block_kv_dq=128, block_q_dkv=128,
            backward_stages=2))

  @parameterized.named_parameters(
      # The opt-in 5-product backward (dQ by reduce-adds from the dK/dV
      # kernel): its dQ pieces (`config.atomic_dq_pieces`) by columns at
      # head dim 128, by rows at 64 with its default 128-row query tiles,
      # one warpgroup's alone at 64 x 64; int32 fixed point in
      # deterministic calls, float32 with deterministic_grads=False.
      ("d128_gqa_causal_segments", (2, 200, 300, 4, 2, 128),
       dict(is_causal=True, has_segments=True), None, {}, True),
      ("d64_lengths_window_soft_cap", (2, 256, 320, 2, 2, 64),
       dict(is_causal=True, has_lengths=True, window=(100, 0)), 20.0, {},
       True),
      ("d64_one_piece", (1, 192, 130, 2, 1, 64), {}, None,
       dict(block_q_dkv=64), False),
  )
  def test_atomic_dq_lowers_for_cuda(self, shape, mask_options, soft_cap,
                                     tiles, deterministic):
    head_dim = shape[-1]
    sizes = dataclasses.replace(
        mosaic_config.default_block_sizes(head_dim), atomic_dq=True,
        **tiles)
    self._check_lowering("atomic_dq", shape, "bfloat16", mask_options,
                         soft_cap, block_sizes=sizes,
                         deterministic_grads=deterministic)

  def test_fixed_point_exponents_bound_every_partial_sum(self):
    # dQ's int32 fixed point (atomic_dq): against dense float32 dS and
    # every block of 128 keys' partial dQ, with rows of dO from 1e-3 to
    # 1e3 and GQA, the sum of the blocks' |partial| times 2^e stays under
    # 2^30 (so no running int32 sum can overflow), while each row's largest
    # |dQ| still spans at least 2^12 units; a non-finite input marks its
    # rows (an inf in dO: that row; a nan in K: its kv head's rows).
    batch, q_len, kv_len, heads, kv_heads, head_dim = 1, 64, 512, 4, 2, 64
    keys = jax.random.split(jax.random.key(3), 4)
    q, do = (jax.random.normal(key, (batch, q_len, heads, head_dim))
             for key in keys[:2])
    do = do * jnp.logspace(-3, 3, q_len)[None, :, None, None]
    k, v = (jax.random.normal(key, (batch, kv_len, kv_heads, head_dim))
            for key in keys[2:])
    q, do, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32)
                   for x in (q, do, k, v))
    group = heads // kv_heads
    kg, vg = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqnh,bknh->bnqk", q, kg) * head_dim ** -0.5
    p = jax.nn.softmax(s, axis=-1)
    dp = jnp.einsum("bqnh,bknh->bnqk", do, vg)
    out = jnp.einsum("bnqk,bknh->bqnh", p, vg)
    delta = jnp.einsum("bqnh,bqnh->bnq", do, out)
    ds = p * (dp - delta[..., None])
    blocks = kv_len // 128
    partial = jnp.einsum(  # [B, N, T, blocks, H]
        "bnqjk,bjknh->bnqjh", ds.reshape(batch, heads, q_len, blocks, 128),
        kg.reshape(batch, blocks, 128, heads, head_dim))
    exponents, finite = mosaic_backward.dq_fixed_point_exponents(
        k, v, do, delta, group)
    self.assertTrue(bool(jnp.all(finite)))
    units = jnp.ldexp(1.0, exponents)[..., None, None]  # [B, N, T, 1, 1]
    magnitude = jnp.sum(jnp.abs(partial) * units, axis=3)  # Over blocks.
    self.assertLess(float(jnp.max(magnitude)), 2.0 ** 30)
    dq_units = jnp.abs(jnp.sum(partial, axis=3)) * units[..., 0]
    self.assertGreater(float(jnp.min(jnp.max(dq_units, axis=-1))), 2.0 ** 12)
    _, finite = mosaic_backward.dq_fixed_point_exponents(
        k.at[0, 5, 1, 0].set(jnp.nan), v, do.at[0, 7, 0, 3].set(jnp.inf),
        delta, group)
    expected = jnp.ones((batch, heads, q_len), bool)
    expected = expected.at[0, 2:].set(False).at[0, 0, 7].set(False)
    np.testing.assert_array_equal(np.asarray(finite), np.asarray(expected))

  @parameterized.named_parameters(
      ("d128_gqa_causal_lengths_sinks", (2, 200, 300, 4, 2, 128),
       dict(is_causal=True, has_lengths=True), None, True),
      ("d64_window_soft_cap", (1, 256, 256, 2, 2, 64),
       dict(is_causal=True, window=(100, 0)), 20.0, False),
      ("d256_segments_bottom_right", (1, 100, 300, 2, 1, 256),
       dict(is_causal=True, bottom_right=True, has_segments=True), None,
       False),
      # 128-key tiles at head dim 256 (64-key ones with segment ids).
      ("d256_gqa_lengths", (2, 200, 300, 4, 2, 256),
       dict(is_causal=False, has_lengths=True), None, False),
      # The persistent kernel with the Q prefetch at head dim 256 (its
      # 128-key tiles leave 1 KiB of shared memory).
      ("d256_persistent", (2, 256, 384, 4, 2, 256), dict(is_causal=False),
       None, False),
  )
  def test_fp8_forward_lowers_for_cuda(self, shape, mask_options, soft_cap,
                                       sinks):
    # float8_e4m3fn q/k/v with [B, K] descales: the FP8 variant of the
    # forward kernel at its default tiles; a bfloat16 output.
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    fp8 = "float8_e4m3fn"
    spec = CallSpec(batch=batch, q_len=q_len, kv_len=kv_len,
                    num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype=fp8, scale=head_dim**-0.5,
                    mask=MaskSpec(**{"has_lengths": False, **mask_options}),
                    logits_soft_cap=soft_cap,
                    modifiers=ModifierSpec(has_sinks=sinks),
                    out_dtype="bfloat16")
    self.assertIsNone(mosaic_backend.check(spec, "forward"))
    config = mosaic_backend.BACKEND.configure(spec)
    if mosaic_forward.runs_persistent(spec):
      # The persistent FP8 kernel prefetches Q at every head dim.
      self.assertTrue(mosaic_forward.q_prefetch(True, head_dim))
    sds = jax.ShapeDtypeStruct
    ids = lambda length: (sds((batch, length), jnp.int32)
                          if spec.mask.has_segments else None)
    lengths = sds((batch,), jnp.int32) if spec.mask.has_lengths else None
    operands = _fp8_operands(batch, q_len, kv_len, heads, kv_heads,
                             head_dim).replace(
        q_lengths=lengths, kv_lengths=lengths,
        q_segment_ids=ids(q_len), kv_segment_ids=ids(kv_len),
        sinks=sds((batch, heads), jnp.float32) if sinks else None)
    text, (out, lse2) = _lower(
        lambda ops: mosaic_backend.forward(spec, config, ops), operands)
    self.assertIn("mosaic_gpu", text)
    self._check_ping_pong(text, spec)
    self.assertEqual((out.shape, out.dtype),
                     ((batch, q_len, heads, head_dim), jnp.bfloat16))
    self.assertEqual((lse2.shape, lse2.dtype),
                     ((batch, heads, q_len), jnp.float32))

  @parameterized.parameters((128, False), (64, True))
  def test_forward_with_q_prefetch_lowers_for_cuda(self, head_dim,
                                                   is_causal):
    # forward.Q_PREFETCH (on by default) off and on: the persistent forward
    # with output tiles and the next block's Q load, and without them.
    spec = CallSpec(batch=2, q_len=256, kv_len=256, num_heads=4,
                    num_kv_heads=2, head_dim=head_dim, dtype="bfloat16",
                    scale=head_dim**-0.5,
                    mask=MaskSpec(is_causal=is_causal, has_lengths=False))
    config = mosaic_backend.BACKEND.configure(spec)
    self.assertTrue(mosaic_forward.is_persistent(spec.mask))
    q = jax.ShapeDtypeStruct((2, 256, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
    run = lambda q, k, v: mosaic_backend.forward(spec, config,
                                                 Operands(q, k, v))
    jaxprs = {}
    for prefetch in (False, True):
      with mock.patch.object(mosaic_forward, "Q_PREFETCH", prefetch):
        text, (out, _) = _lower(run, q, kv, kv)
        jaxprs[prefetch] = _kernel_jaxpr(run, q, kv, kv)
      self.assertIn("mosaic_gpu", text)
      self.assertEqual(out.shape, q.shape)
    # Another kernel (output tiles, the load in the epilogue).
    self.assertNotEqual(jaxprs[False], jaxprs[True])

  def test_fp8_q_prefetch_at_its_head_dims(self):
    # The FP8 forward prefetches Q at forward.FP8_Q_PREFETCH_HEAD_DIMS
    # (measured faster at each); 16-bit calls wherever their output tiles
    # fit; neither with Q_PREFETCH off.
    self.assertTrue(mosaic_forward.q_prefetch(False, 128))
    for head_dim in (64, 128, 256):
      self.assertTrue(mosaic_forward.q_prefetch(True, head_dim))
    with mock.patch.object(mosaic_forward, "Q_PREFETCH", False):
      self.assertFalse(mosaic_forward.q_prefetch(True, 64))
      self.assertFalse(mosaic_forward.q_prefetch(False, 128))
    # And the kernel follows it: a persistent FP8 call at head dim 128
    # lowers to another kernel when 128 leaves the table.
    fp8 = "float8_e4m3fn"
    spec = CallSpec(batch=2, q_len=256, kv_len=256, num_heads=4,
                    num_kv_heads=2, head_dim=128, dtype=fp8,
                    scale=128**-0.5, out_dtype="bfloat16",
                    mask=MaskSpec(is_causal=False, has_lengths=False))
    self.assertTrue(mosaic_forward.is_persistent(spec.mask))
    config = mosaic_backend.BACKEND.configure(spec)
    operands = _fp8_operands(2, 256, 256, 4, 2, 128)
    run = lambda ops: mosaic_backend.forward(spec, config, ops)
    jaxprs = []
    for dims in ((), (128,)):
      with mock.patch.object(mosaic_forward, "FP8_Q_PREFETCH_HEAD_DIMS",
                             dims):
        self.assertIn("mosaic_gpu", _lower(run, operands)[0])
        jaxprs.append(_kernel_jaxpr(run, operands))
    self.assertNotEqual(jaxprs[0], jaxprs[1])
    self.assertEqual(jaxprs[1], _kernel_jaxpr(run, operands))  # The default.

  def test_fp8_causal_head_dim_256_runs_one_block_per_tile(self):
    # forward.runs_persistent: FP8 causal calls at head dim 256 launch one
    # block per tile (measured faster at every length), every other call
    # the persistent kernel wherever the mask allows it.
    fp8 = "float8_e4m3fn"

    def spec_of(dtype, head_dim, is_causal):
      return CallSpec(batch=1, q_len=256, kv_len=256, num_heads=2,
                      num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                      scale=head_dim**-0.5,
                      out_dtype="bfloat16" if dtype == fp8 else None,
                      mask=MaskSpec(is_causal=is_causal, has_lengths=False))

    self.assertFalse(mosaic_forward.runs_persistent(spec_of(fp8, 256, True)))
    for dtype, head_dim, is_causal in ((fp8, 256, False), (fp8, 128, True),
                                       ("bfloat16", 256, True)):
      self.assertTrue(mosaic_forward.runs_persistent(
          spec_of(dtype, head_dim, is_causal)))
    # The launch follows: a grid of (tile, head, batch) blocks, lowered.
    spec = spec_of(fp8, 256, True)
    config = mosaic_backend.BACKEND.configure(spec)
    operands = _fp8_operands(1, 256, 256, 2, 2, 256)
    run = lambda ops: mosaic_backend.forward(spec, config, ops)
    self.assertIn("mosaic_gpu", _lower(run, operands)[0])
    jaxpr = _kernel_jaxpr(run, operands)
    self.assertNotIn("grid_names=('programs',)", jaxpr)
    self.assertIn("'q_tiles'", jaxpr)

  def test_forward_orderings_follow_their_tables(self):
    # forward.K_WAIT_UNDER_PV ("auto": its measured table) decides per
    # call, SOFTMAX_BARRIER_16BIT (off) is an A/B switch; the kernel
    # follows both. (Compared as jaxprs: the lowered module's bytes differ
    # between two lowerings of the same kernel.)
    self.assertFalse(mosaic_forward.waits_for_k_under_pv(True, 128, False))
    self.assertTrue(mosaic_forward.waits_for_k_under_pv(False, 64, False))
    self.assertFalse(mosaic_forward.waits_for_k_under_pv(False, 64, True))
    self.assertFalse(mosaic_forward.waits_for_k_under_pv(False, 128, False))
    spec = CallSpec(batch=1, q_len=256, kv_len=256, num_heads=2,
                    num_kv_heads=2, head_dim=128, dtype="bfloat16",
                    scale=128**-0.5,
                    mask=MaskSpec(is_causal=False, has_lengths=False))
    config = mosaic_backend.BACKEND.configure(spec)
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    run = lambda q, k, v: mosaic_backend.forward(spec, config,
                                                 Operands(q, k, v))
    jaxprs = {}
    default = _kernel_jaxpr(run, q, q, q)
    for switch in ("K_WAIT_UNDER_PV", "SOFTMAX_BARRIER_16BIT"):
      for value in (False, True):
        with mock.patch.object(mosaic_forward, switch, value):
          jaxprs[switch, value] = _kernel_jaxpr(run, q, q, q)
      # Both off by default at D=128 without a causal mask.
      self.assertEqual(default, jaxprs[switch, False])
      self.assertNotEqual(jaxprs[switch, True], jaxprs[switch, False])
    with mock.patch.object(mosaic_forward, "K_WAIT_UNDER_PV", True), \
        mock.patch.object(mosaic_forward, "SOFTMAX_BARRIER_16BIT", True):
      self.assertIn("mosaic_gpu", _lower(run, q, q, q)[0])

  def _check_ping_pong(self, forward_text, spec):
    # The consumers' turns go through the named barriers (PTX `bar` over
    # both consumers' 256 threads, in the serialized Mosaic module) exactly
    # where forward.named_ping_pong says so.
    self.assertEqual("bar.sync $0, 256;" in forward_text,
                     mosaic_forward.named_ping_pong(spec.mask, spec.head_dim))
    self.assertEqual("bar.arrive $0, 256;" in forward_text,
                     mosaic_forward.named_ping_pong(spec.mask, spec.head_dim))

  def _check_lowering(self, name, shape, dtype, mask_options, soft_cap,
                      block_sizes=None, deterministic_grads=True):
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    spec = CallSpec(batch=batch, q_len=q_len, kv_len=kv_len,
                    num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype=dtype, scale=head_dim**-0.5,
                    mask=MaskSpec(**{"is_causal": False, "has_lengths": False,
                                       **mask_options}),
                    logits_soft_cap=soft_cap,
                    modifiers=ModifierSpec(has_sinks=name.endswith("sinks")),
                    deterministic_grads=deterministic_grads)
    config = mosaic_backend.BACKEND.configure(spec, block_sizes=block_sizes)
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)

    sinks = jax.ShapeDtypeStruct((batch, heads), jnp.float32)
    segment_ids = (jax.ShapeDtypeStruct((batch, q_len), jnp.int32),
                   jax.ShapeDtypeStruct((batch, kv_len), jnp.int32))

    def operands_of(q, k, v, q_lengths, kv_lengths, sinks, segment_ids):
      operands = Operands(query=q, key=k, value=v,
                          sinks=sinks if name.endswith("sinks") else None)
      if spec.mask.has_lengths:
        operands = operands.replace(q_lengths=q_lengths,
                                    kv_lengths=kv_lengths)
      if spec.mask.has_segments:
        operands = operands.replace(q_segment_ids=segment_ids[0],
                                    kv_segment_ids=segment_ids[1])
      return operands

    def forward(*args):
      return mosaic_backend.forward(spec, config, operands_of(*args))

    args = (q, kv, kv, lengths, lengths, sinks, segment_ids)
    text, (out, lse2) = _lower(forward, *args)
    self.assertIn("mosaic_gpu", text)
    self._check_ping_pong(text, spec)
    self.assertEqual((out.shape, out.dtype), (q.shape, jnp.dtype(dtype)))
    self.assertEqual((lse2.shape, lse2.dtype),
                     ((batch, heads, q_len), jnp.float32))

    def backward(q, k, v, q_lengths, kv_lengths, sinks, segment_ids, out,
                 lse2, dout, dlse):
      return mosaic_backend.backward(
          spec, config,
          operands_of(q, k, v, q_lengths, kv_lengths, sinks, segment_ids),
          out, lse2, dout, dlse)

    text, grads = _lower(backward, *args, out, lse2, out, lse2)
    self.assertIn("mosaic_gpu", text)
    self.assertEqual((grads.query.shape, grads.key.shape,
                      grads.value.shape), (q.shape, kv.shape, kv.shape))
    self.assertEqual(grads.sinks is not None, name.endswith("sinks"))


if __name__ == "__main__":
  absltest.main()
