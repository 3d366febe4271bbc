"""BlockSizes validation and the default heuristic."""

from absl.testing import absltest
from absl.testing import parameterized

import jflash


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


if __name__ == "__main__":
  absltest.main()
