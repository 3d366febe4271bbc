"""BlockSizes validation and the default heuristic."""

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

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

  @parameterized.product(head_dim=(32, 64, 80, 128, 192, 256),
                         dtype=("float32", "bfloat16", "float16"))
  def test_default_forward_tiles_fit_shared_memory(self, head_dim, dtype):
    # Estimate of the forward's shared memory: a q tile plus `num_stages`
    # buffered k and v tiles. Hopper gives a block at most 227 KiB; float32
    # with the 16-bit tiles (128x128, 3 stages, D=128) asks for ~448 KiB and
    # failed to compile on an H200 (see WORKSPACE_NOTES.md).
    sizes = jflash.default_block_sizes(
        q_len=8192, kv_len=8192, head_dim=head_dim, dtype=dtype,
        is_causal=False, device_kind="NVIDIA H200")
    padded = max(16, 1 << (head_dim - 1).bit_length())
    itemsize = jnp.dtype(dtype).itemsize
    estimate = itemsize * padded * (
        sizes.block_q + 2 * sizes.num_stages * sizes.block_k)
    self.assertLessEqual(estimate, 227 * 1024, msg=str(sizes))


if __name__ == "__main__":
  absltest.main()
