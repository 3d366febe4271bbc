"""BlockSizes validation and the default heuristic."""

from absl.testing import absltest
from absl.testing import parameterized

import jflash
from jflash._src.backends.triton import block_sizes


class BlockSizesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("not_power_of_two", dict(block_q=48), "block_q=48"),
      ("too_small", dict(block_k=8), "block_k=8"),
      ("too_large", dict(block_q_dq=512), "block_q_dq=512"),
      ("warps", dict(num_warps=3), "num_warps=3"),
      ("stages", dict(num_stages_bwd=0), "num_stages_bwd=0"),
  )
  def test_invalid(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      jflash.BlockSizes(**kwargs)

  def test_hashable_and_frozen(self):
    a, b = jflash.BlockSizes(), jflash.BlockSizes()
    self.assertEqual(hash(a), hash(b))
    with self.assertRaises(AttributeError):
      a.block_q = 32  # pytype: disable=not-writable

  @parameterized.product(head_dim=(32, 64, 80, 128, 192, 256),
                         seq_len=(1, 17, 100, 4096))
  def test_default_is_valid_and_fits_the_lengths(self, head_dim, seq_len):
    sizes = jflash.default_block_sizes(
        q_len=seq_len, kv_len=2 * seq_len, head_dim=head_dim,
        dtype="bfloat16", is_causal=True, device_kind="NVIDIA H100")
    rounded_q = max(16, 1 << (seq_len - 1).bit_length())
    for tile in (sizes.block_q, sizes.block_q_dkv, sizes.block_q_dq):
      self.assertLessEqual(tile, max(rounded_q, 16))
    self.assertIsInstance(sizes, jflash.BlockSizes)

  def test_estimate_rejects_the_bias_tiles_that_failed(self):
    # bf16, D=128, 128x128 tiles, 3 stages with a bf16 bias: Triton asked
    # 294912 bytes of 232448 on an H100 (2026-11-23).
    self.assertLessEqual(
        block_sizes.forward_shared_memory(128, 128, 3, head_dim=128,
                                          itemsize=2),
        block_sizes.shared_memory_limit("NVIDIA H100 80GB HBM3"))
    self.assertGreater(
        block_sizes.forward_shared_memory(128, 128, 3, head_dim=128,
                                          itemsize=2, dense_itemsize=2),
        block_sizes.shared_memory_limit("NVIDIA H100 80GB HBM3"))

  def test_estimate_rejects_the_float32_tiles_that_failed(self):
    self.assertGreater(
        block_sizes.forward_shared_memory(128, 128, 3, head_dim=128,
                                          itemsize=4),
        block_sizes.shared_memory_limit("NVIDIA H200"))

  def test_hopper_defaults_are_the_measured_best(self):
    # bf16, D=128 on an H200: forward 128x128, 8 warps, 3 stages; backward
    # 64x64 tiles, 4 warps, 2 stages (RECORD.md, H200 tile sweeps).
    sizes = jflash.default_block_sizes(
        q_len=8192, kv_len=8192, head_dim=128, dtype="bfloat16",
        is_causal=True, device_kind="NVIDIA H200")
    self.assertEqual(sizes, jflash.BlockSizes(
        block_q=128, block_k=128, block_q_dkv=64, block_k_dkv=64,
        block_q_dq=64, block_k_dq=64, num_warps=8, num_stages=3,
        num_warps_bwd=4, num_stages_bwd=2))

  @parameterized.parameters((512, 64), (512, 128), (1024, 128))
  def test_short_sequences_get_smaller_forward_tiles(self, seq_len, head_dim):
    sizes = jflash.default_block_sizes(
        q_len=seq_len, kv_len=seq_len, head_dim=head_dim, dtype="bfloat16",
        is_causal=False, device_kind="NVIDIA H200")
    long = jflash.default_block_sizes(
        q_len=8192, kv_len=8192, head_dim=head_dim, dtype="bfloat16",
        is_causal=False, device_kind="NVIDIA H200")
    short = seq_len <= 512
    self.assertEqual((sizes.block_q, sizes.block_k, sizes.num_warps),
                     (64, 64, 4) if short else
                     (long.block_q, long.block_k, long.num_warps))
    # The backward tiles do not depend on the length (above the tile size).
    self.assertEqual(sizes.block_q_dkv, long.block_q_dkv)

  @parameterized.parameters((1024, True, (64, 32)), (2048, True, (64, 32)),
                            (4096, True, (128, 128)),
                            (1024, False, (128, 128)))
  def test_short_causal_sequences_get_narrow_key_tiles(self, seq_len,
                                                       is_causal, tiles):
    sizes = jflash.default_block_sizes(
        q_len=seq_len, kv_len=seq_len, head_dim=128, dtype="bfloat16",
        is_causal=is_causal, device_kind="NVIDIA H200")
    self.assertEqual((sizes.block_q, sizes.block_k), tiles)


if __name__ == "__main__":
  absltest.main()
