"""Every launch configuration the kernels can choose fits the GPU.

A kernel whose launch asks for more shared memory than a block has fails on
the GPU only, at run time (RESOURCE_EXHAUSTED), so these tests walk every
configuration the default choices can produce (head dims, query rows per kv
head, dtypes, dense operands, GPU families) through the shared-memory
models the choices use, and assert each fits. The models are calibrated
against the bytes Triton requests on an H100
(benchmarks/launch_limits.py; benchmarks/results/RECORD.md).
"""

import dataclasses
import itertools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

import jflash
from jflash._src import api
from jflash._src.backends.mosaic import backward as mosaic_backward
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic import delta as mosaic_delta
from jflash._src.backends.mosaic import forward as mosaic_forward
from jflash._src.backends.triton import block_sizes
from jflash._src.backends.triton import decode as triton_decode
from jflash._src.backends.triton import decode_backend

DEVICE_KINDS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                "NVIDIA L4")
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The decode kernel also reads an FP8 (e4m3) query and cache, 1 byte per
# element (triton_decode.shared_memory's uncalibrated upper bound).
DECODE_ITEMSIZES = {**ITEMSIZES, "float8_e4m3fn": 1}
# Every head dim up to 256 pads to one of these widths; test each width's
# edges and a few in between.
HEAD_DIMS = (8, 16, 32, 33, 64, 80, 96, 128, 160, 192, 200, 256)

# Measured on an H100 (benchmarks/launch_limits.py calibrate_grid,
# 2026-11-25): (dtype, rows, head_dim, block_k, num_stages) -> the bytes
# Triton requested (RESOURCE_EXHAUSTED), and the launches that ran.
REQUESTED = {
    ('bfloat16', 64, 256, 64, 4): 294912,
    ('bfloat16', 128, 256, 64, 4): 327680,
    ('bfloat16', 128, 256, 64, 3): 262144,
    ('float32', 16, 256, 64, 4): 413760,
    ('float32', 16, 256, 64, 3): 282688,
    ('float32', 32, 256, 64, 4): 434304,
    ('float32', 32, 256, 64, 3): 303232,
    ('float32', 32, 256, 32, 4): 233600,
    ('float32', 64, 128, 64, 4): 246016,
    ('float32', 64, 256, 64, 4): 475392,
    ('float32', 64, 256, 64, 3): 344320,
    ('float32', 64, 256, 32, 4): 270592,
    ('float32', 128, 128, 64, 4): 295424,
    ('float32', 128, 256, 64, 4): 557568,
    ('float32', 128, 256, 64, 3): 426496,
    ('float32', 128, 256, 32, 4): 344576,
}
RAN = (
    ('bfloat16', 16, 128, 64, 4),
    ('bfloat16', 16, 128, 64, 3),
    ('bfloat16', 16, 128, 32, 4),
    ('bfloat16', 16, 256, 64, 4),
    ('bfloat16', 16, 256, 64, 3),
    ('bfloat16', 16, 256, 32, 4),
    ('bfloat16', 32, 128, 64, 4),
    ('bfloat16', 32, 128, 64, 3),
    ('bfloat16', 32, 128, 32, 4),
    ('bfloat16', 32, 256, 64, 4),
    ('bfloat16', 32, 256, 64, 3),
    ('bfloat16', 32, 256, 32, 4),
    ('bfloat16', 64, 128, 64, 4),
    ('bfloat16', 64, 128, 64, 3),
    ('bfloat16', 64, 128, 32, 4),
    ('bfloat16', 64, 256, 64, 3),
    ('bfloat16', 64, 256, 32, 4),
    ('bfloat16', 128, 128, 64, 4),
    ('bfloat16', 128, 128, 64, 3),
    ('bfloat16', 128, 128, 32, 4),
    ('bfloat16', 128, 256, 32, 4),
    ('float32', 16, 128, 64, 4),
    ('float32', 16, 128, 64, 3),
    ('float32', 16, 128, 32, 4),
    ('float32', 16, 256, 32, 4),
    ('float32', 32, 128, 64, 4),
    ('float32', 32, 128, 64, 3),
    ('float32', 32, 128, 32, 4),
    ('float32', 64, 128, 64, 3),
    ('float32', 64, 128, 32, 4),
    ('float32', 128, 128, 64, 3),
    ('float32', 128, 128, 32, 4),
)


class DecodeLaunchTest(parameterized.TestCase):

  @parameterized.product(device_kind=DEVICE_KINDS,
                         dtype=tuple(DECODE_ITEMSIZES))
  def test_every_decode_launch_fits(self, device_kind, dtype):
    limit = block_sizes.shared_memory_limit(device_kind)
    itemsize = DECODE_ITEMSIZES[dtype]
    # Packed rows: 1..16 tokens x GQA groups up to 128 query heads per kv
    # head, padded to a power of two >= 16 (decode.kernel_attention).
    # Every launch the backend prefers: DEFAULT_LAUNCH, and first
    # FP8_LAUNCH (1-byte caches) or WIDE_TILE_LAUNCH where
    # decode_backend.preferred_launches takes them (one split, long splits;
    # not short ones).
    for head_dim, rows, (num_splits, kv_seq) in itertools.product(
        HEAD_DIMS, (16, 32, 64, 128, 256, 512, 1024, 2048),
        ((1, 512), (2, 512), (2, 1 << 16))):
      preferred = decode_backend.preferred_launches(
          num_splits=num_splits, kv_seq=kv_seq, rows_padded=rows,
          head_dim=head_dim, itemsize=itemsize)
      plan = triton_decode.plan_launch(
          rows, head_dim=head_dim, itemsize=itemsize,
          device_kind=device_kind, preferred=preferred)
      need = triton_decode.shared_memory(plan.launch, rows=plan.rows,
                                         head_dim=head_dim,
                                         itemsize=itemsize)
      self.assertLessEqual(need, limit, msg=f"{head_dim=} {rows=} {plan=}")
      self.assertLessEqual(plan.rows, triton_decode.MAX_ROWS_PER_LAUNCH)
      self.assertEqual(rows % plan.rows, 0)
      # Registers: the accumulator spread over the warps' threads.
      per_thread = plan.rows * max(16, 1 << (head_dim - 1).bit_length()) / (
          32 * plan.launch.num_warps)
      self.assertLessEqual(per_thread,
                           triton_decode.MAX_ACCUMULATOR_PER_THREAD,
                           msg=f"{head_dim=} {rows=} {plan=}")

  def test_model_matches_the_gpu(self):
    # Exact where Triton asked for more than the H100 has; within the limit
    # where the launch ran.
    limit = block_sizes.shared_memory_limit(DEVICE_KINDS[0])
    need = lambda dtype, rows, head_dim, block_k, stages: (
        triton_decode.shared_memory(
            triton_decode.DecodeLaunch(block_k, 4, stages), rows=rows,
            head_dim=head_dim, itemsize=ITEMSIZES[dtype]))
    for case, requested in REQUESTED.items():
      self.assertEqual(need(*case), requested, msg=str(case))
    for case in RAN:
      self.assertLessEqual(need(*case), limit, msg=str(case))

  def test_the_reported_crash_takes_a_fallback(self):
    # Issue 22: 13 tokens x a GQA group of 8 (128 packed rows) at head dim
    # 256 in bf16 asked for 327680 bytes with the preferred launch (the
    # number in the H100's RESOURCE_EXHAUSTED message; the model is exact).
    preferred = triton_decode.DecodeLaunch()
    self.assertEqual(triton_decode.shared_memory(
        preferred, rows=128, head_dim=256, itemsize=2), 327680)
    plan = triton_decode.plan_launch(
        128, head_dim=256, itemsize=2, device_kind=DEVICE_KINDS[0],
        preferred=preferred)
    # The fastest fitting launch measured at that shape (H100).
    self.assertEqual(plan, triton_decode.DecodePlan(
        rows=128, launch=triton_decode.DecodeLaunch(32, 8, 4)))
    self.assertLessEqual(
        triton_decode.shared_memory(plan.launch, rows=plan.rows,
                                    head_dim=256, itemsize=2),
        block_sizes.shared_memory_limit(DEVICE_KINDS[0]))

  def test_launches_that_fit_keep_the_preferred_one(self):
    # The common decode shapes (<= 64 rows, head dim <= 128, 16-bit or an
    # FP8 cache) keep the measured default launch.
    for rows, head_dim, itemsize in itertools.product(
        (16, 32, 64), (64, 128), (2, 1)):
      plan = triton_decode.plan_launch(
          rows, head_dim=head_dim, itemsize=itemsize,
          device_kind=DEVICE_KINDS[0],
          preferred=triton_decode.DecodeLaunch())
      self.assertEqual(plan, triton_decode.DecodePlan(
          rows=rows, launch=triton_decode.DecodeLaunch()),
                       msg=f"{rows=} {head_dim=} {itemsize=}")

  def test_fp8_model_bounds_the_16_bit_pipeline(self):
    # Until calibrated on a GPU, the FP8 model is an upper bound: at
    # least what a 16-bit launch of the same tiles asks for, less the
    # 1 byte per element its buffered K/V tiles no longer hold, plus the
    # converted 16-bit K/V tiles, for every launch the fallbacks offer.
    for launch, rows, head_dim in itertools.product(
        (triton_decode.DecodeLaunch(), *triton_decode.FALLBACK_LAUNCHES),
        (16, 32, 64, 128), (64, 128, 256)):
      fp8 = triton_decode.shared_memory(launch, rows=rows,
                                        head_dim=head_dim, itemsize=1)
      bf16 = triton_decode.shared_memory(launch, rows=rows,
                                         head_dim=head_dim, itemsize=2)
      kv_tiles = 2 * launch.num_stages * launch.block_k * head_dim
      converted = 2 * 2 * launch.block_k * head_dim
      self.assertGreaterEqual(fp8, bf16 - kv_tiles + converted,
                              msg=f"{launch} {rows=} {head_dim=}")


class TrainingLaunchTest(parameterized.TestCase):

  @parameterized.product(device_kind=DEVICE_KINDS, dtype=tuple(ITEMSIZES))
  def test_every_default_triton_tile_fits(self, device_kind, dtype):
    # float32 with the 16-bit tiles (128x128, 3 stages, D=128) failed to
    # compile on an H200; a dense bias's tiles on top of 128x128 bf16 tiles
    # asked 288 KiB on an H100 (RECORD.md): the heuristic must count both.
    limit = block_sizes.shared_memory_limit(device_kind)
    itemsize = ITEMSIZES[dtype]
    # Dense operands streamed by tile: none, a mask (1 byte), a float32
    # bias (4), both (5).
    for head_dim, length, is_causal, dense in itertools.product(
        HEAD_DIMS, (16, 300, 512, 1024, 2048, 8192), (False, True),
        (0, 1, 4, 5)):
      tiles = block_sizes.default_block_sizes(
          q_len=length, kv_len=length, head_dim=head_dim, dtype=dtype,
          is_causal=is_causal, device_kind=device_kind,
          dense_itemsize=dense)
      where = f"{head_dim=} {length=} {is_causal=} {dense=} {tiles}"
      self.assertLessEqual(block_sizes.forward_shared_memory(
          tiles.block_q, tiles.block_k, tiles.num_stages,
          head_dim=head_dim, itemsize=itemsize, dense_itemsize=dense),
                           limit, msg=where)
      self.assertLessEqual(block_sizes.backward_shared_memory(
          tiles.block_q_dkv, tiles.block_k_dkv, tiles.block_q_dq,
          tiles.block_k_dq, tiles.num_stages_bwd, head_dim=head_dim,
          itemsize=itemsize, dense_itemsize=dense), limit, msg=where)

  def test_user_tiles_over_shared_memory_are_a_value_error(self):
    # 128x128 forward tiles with 4 stages at head dim 256: Triton requests
    # 589824 bytes on an H100 (the model's number), a runtime crash.
    q = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)
    tiles = jflash.BlockSizes(block_q=128, block_k=128, num_stages=4)
    with self.assertRaisesRegex(ValueError, r"block_sizes=.*589824"):
      jflash.flash_attention(q, q, q, implementation="triton",
                             block_sizes=tiles, interpret=True)

  def test_every_default_mosaic_tile_fits(self):
    for head_dim in (64, 128, 256):
      sizes = mosaic_config.default_block_sizes(head_dim, 2)
      self.assertLessEqual(sizes.smem_bytes(head_dim, 2),
                           mosaic_config.SMEM_BUDGET_BYTES)
      self.assertLessEqual(sizes.backward_smem_bytes(head_dim, 2),
                           mosaic_config.SMEM_BUDGET_BYTES)

  def test_mosaic_atomic_dq_chosen_where_faster(self):
    # 16-bit calls without GQA take atomic_dq on their default tiles
    # (config.atomic_dq_where_faster), which fit: with
    # deterministic_grads=False (float32 adds) at head dim 64 from 4096
    # queries and keys and at 128 from 16384, deterministic calls (int32
    # fixed point) at head dim 64 from 8192, causal from 16384, not with a
    # window or segment ids; shorter ones, GQA, head dim 256 (slower with
    # it) and FP8 keep two backward kernels; tiles asking for atomic_dq are
    # taken in both kinds of call.
    def spec_of(head_dim, deterministic, length=4096, kv_heads=2,
                kv_length=None, **mask):
      q = jnp.zeros((1, length, 2, head_dim), jnp.bfloat16)
      kv = jnp.zeros((1, kv_length or length, kv_heads, head_dim),
                     jnp.bfloat16)
      return api.describe(q, kv, kv, deterministic_grads=deterministic,
                          **mask).spec

    ids = jnp.zeros((1, 16384), jnp.int32)
    for mask, length, expected in (
        (dict(is_causal=True), 8192, False),
        (dict(is_causal=True), 16376, False),
        (dict(is_causal=True), 16384, True),
        (dict(local_window_size=(1024, 0)), 16384, False),
        (dict(q_segment_ids=ids, kv_segment_ids=ids), 16384, False)):
      for deterministic in (True, False):
        spec = spec_of(64, deterministic, length, **mask)
        self.assertEqual(
            mosaic_config.MosaicConfig.for_call(spec).block_sizes.atomic_dq,
            expected or not deterministic,
            msg=f"{mask.keys()} {length=} {deterministic=}")

    for head_dim, deterministic, length, kv_length, kv_heads, expected in (
        (64, False, 4096, None, 2, True), (64, False, 4088, None, 2, False),
        (64, False, 4096, None, 1, False), (64, True, 4096, None, 2, False),
        (64, True, 8192, None, 2, True), (64, True, 8184, None, 2, False),
        (64, True, 8192, 4096, 2, False), (64, True, 4096, 8192, 2, False),
        (64, True, 8192, None, 1, False), (128, True, 8192, None, 2, False),
        (128, False, 4096, None, 2, False), (128, False, 16384, None, 2, True),
        (128, False, 16376, None, 2, False), (128, True, 16384, None, 2, False),
        (128, False, 16384, None, 1, False),
        (256, False, 4096, None, 2, False)):
      spec = spec_of(head_dim, deterministic, length, kv_heads, kv_length)
      tiles = mosaic_config.MosaicConfig.for_call(spec).block_sizes
      self.assertEqual(tiles.atomic_dq, expected,
                       msg=f"{head_dim=} {deterministic=} {length=} "
                       f"{kv_length=} {kv_heads=}")
      self.assertLessEqual(tiles.backward_smem_bytes(head_dim, 2),
                           mosaic_config.SMEM_BUDGET_BYTES)
    for deterministic in (True, False):
      fp8 = dataclasses.replace(spec_of(64, deterministic, 8192),
                                dtype="float8_e4m3fn")
      self.assertFalse(mosaic_config.atomic_dq_where_faster(
          mosaic_config.default_fp8_block_sizes(64), fp8).atomic_dq)
    atomic = dataclasses.replace(mosaic_config.default_block_sizes(128),
                                 atomic_dq=True)
    for deterministic in (True, False):
      self.assertTrue(mosaic_config.MosaicConfig.for_call(
          spec_of(128, deterministic), block_sizes=atomic
      ).block_sizes.atomic_dq)

  def test_mosaic_register_splits_fit(self):
    # Every Mosaic kernel runs two compute warpgroups and one producer
    # (128 threads each) with setmaxnreg: each count a multiple of 8 in
    # [24, 256]. The block launches with at most 65536 / 384 registers a
    # thread, rounded down to a multiple of 8 (ptxas: "Used 168
    # registers"), and setmaxnreg only moves registers within that
    # allocation (SASS: USETMAXREG ... CTAPOOL): the three counts must sum
    # to at most 3 * 168 = 504, or `setmaxnreg.inc` waits forever (240,
    # 240, 32 hung the fixed-point dK/dV kernel on an H100, 2026-11-26).
    threads = 128 * (mosaic_forward.COMPUTE_WARPGROUPS + 1)
    launch_registers = 65536 // threads // 8 * 8
    self.assertEqual(launch_registers, 168)
    self.assertEqual(mosaic_forward.COMPUTE_WARPGROUPS,
                     mosaic_backward.COMPUTE_WARPGROUPS)
    for compute, producer in (
        (mosaic_forward.COMPUTE_REGISTERS, mosaic_forward.PRODUCER_REGISTERS),
        (mosaic_backward.COMPUTE_REGISTERS,
         mosaic_backward.PRODUCER_REGISTERS),
        mosaic_backward.ATOMIC_DQ_REGISTERS):
      for count in (compute, producer):
        self.assertEqual(count % 8, 0)
        self.assertBetween(count, 24, 256)
      self.assertLessEqual(
          mosaic_forward.COMPUTE_WARPGROUPS * compute + producer,
          3 * launch_registers, (compute, producer))

  def test_mosaic_d256_backward_counts_the_hand_over(self):
    # The product split at head dim 256 (config.backward_splits_products)
    # hands a float32 [block_q, block_kv] tile of probabilities between the
    # warpgroups of each backward kernel: the model counts it, and the
    # default tiles still fit (lowered for CUDA, the dK/dV kernel with
    # segments asked 217176 bytes, 2026-11-26).
    sizes = mosaic_config.default_block_sizes(256, 2)
    with mock.patch.object(mosaic_config, "BWD_SHARED_ROW_SPLIT",
                           "columns"):
      columns = sizes.backward_smem_bytes(256, 2)
    products = sizes.backward_smem_bytes(256, 2)
    self.assertEqual(products - columns,
                     sizes.block_kv_dkv * sizes.block_q_dkv * 4)
    self.assertLessEqual(products, mosaic_config.SMEM_BUDGET_BYTES)

  def test_mosaic_output_tiles_only_where_they_fit(self):
    # The persistent forward adds output tiles (its Q prefetch) where
    # `fits_output_tiles` says so: at the default tiles for head dims 64
    # and 128 (run on an H100: RECORD 2026-11-25, "Q prefetch"), not 256;
    # tiles that fit Hopper only without them (3 stages of 128 keys at
    # head dim 128: 224.5 KiB) run without them.
    for head_dim, expected in ((64, True), (128, True), (256, False)):
      sizes = mosaic_config.default_block_sizes(head_dim, 2)
      self.assertEqual(sizes.fits_output_tiles(head_dim, 2), expected,
                       msg=f"{head_dim=} {sizes}")

  def test_mosaic_delta_kernel_fits_every_head_dim(self):
    # The backward's delta kernel (one launch configuration per head dim;
    # bfloat16 and float16 tiles are the same bytes): its model's bytes
    # within Hopper's, and the kernel lowered for CUDA, where Mosaic
    # refuses launches over 227 KiB.
    for head_dim in (64, 128, 256):
      self.assertLessEqual(mosaic_delta.delta_smem_bytes(head_dim, 2),
                           mosaic_config.SMEM_BYTES, msg=f"{head_dim=}")
      x = jax.ShapeDtypeStruct((1, 100, 2, head_dim), jnp.bfloat16)
      text = jax.jit(mosaic_delta.delta_call).trace(x, x).lower(
          lowering_platforms=("cuda",)).as_text()
      self.assertIn("mosaic_gpu", text)

  def test_mosaic_forward_counts_its_alignment_and_segment_ids(self):
    # 128-key tiles with 3 stages at head dim 128: 229,888 bytes unaligned,
    # but Mosaic allocates 1 KiB-aligned buffers: 230,400 (230,520 asked
    # with the barriers, lowered for CUDA: mosaic_lowering_test's
    # test_other_tiles_lower_for_cuda); with segment ids 3 KiB more, over
    # Hopper's 232,448: refused here, first.
    tiles = mosaic_config.MosaicBlockSizes(64, 128, 3)
    self.assertEqual(tiles.aligned_forward_bytes(128, 2), 230400)
    tiles.check_fits(128, 2)
    with self.assertRaisesRegex(ValueError, r"block_sizes=.*forward pass"):
      tiles.check_fits(128, 2, has_segments=True)
    # Every head dim's default tiles fit with segment ids, and their output
    # tiles (the Q prefetch) where they fit without.
    for head_dim in (64, 128, 256):
      sizes = mosaic_config.default_block_sizes(head_dim, 2)
      sizes.check_fits(head_dim, 2, has_segments=True)
      self.assertEqual(
          sizes.fits_output_tiles(head_dim, 2, has_segments=True),
          sizes.fits_output_tiles(head_dim, 2), msg=f"{head_dim=}")

if __name__ == "__main__":
  absltest.main()
