"""The measured default route (jflash/_src/tuning/route.py): which backend
`implementation=None` runs where the priority order is not the fastest, on
a mocked Hopper GPU. Plans only: no kernel runs (the GPU suite and
benchmarks/decode_route.py time the choices)."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from jflash._src import platform
from jflash._src import registry
from jflash._src.spec import BackendOptions
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.tuning import route


def _spec(batch, kv_seq, num_heads, num_kv_heads, head_dim, tokens, *,
          dtype="bfloat16", paged=False):
  """A decode-shaped call's spec: bottom-right causal with kv lengths."""
  return CallSpec(
      batch=batch, q_len=tokens, kv_len=kv_seq, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
      scale=head_dim ** -0.5,
      mask=MaskSpec(is_causal=True, bottom_right=True, has_lengths=True,
                    paged=paged))


class RouteTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.capability = "9.0"
    self.enter_context(mock.patch.object(registry, "current_platform",
                                         return_value="cuda"))
    self.enter_context(mock.patch.object(
        platform, "cuda_compute_capability",
        side_effect=lambda: self.capability))

  def _forward(self, spec):
    return registry.plan(spec, None, BackendOptions()).forward

  @parameterized.named_parameters(
      # GQA caches: the decode kernel packs the group (1.5-4x faster).
      ("gqa_serving_batch", (128, 1024, 32, 8, 128, 1), "decode"),
      ("gqa_long_cache", (1, 32768, 32, 8, 128, 4), "decode"),
      ("mqa_d256", (8, 8192, 8, 1, 256, 1), "decode"),
      # MHA: nothing to pack; the decode kernel is level with the training
      # kernels or faster (issue 23's rows 32 x 1024 and 64 x 2048), but
      # Mosaic runs the shortest calls faster, and Triton 4 tokens on 4 x
      # 8k.
      ("mha_issue_row", (32, 1024, 32, 32, 128, 1), "decode"),
      ("mha_large_batch", (64, 2048, 32, 32, 128, 1), "decode"),
      ("mha_small_batch_short_cache", (4, 512, 32, 32, 128, 1), "mosaic"),
      ("mha_small_batch_long_cache", (4, 8192, 32, 32, 128, 4), "triton"),
      # A head dim Mosaic lacks: among decode and Triton only.
      ("mha_d96", (4, 512, 32, 32, 96, 1), "triton"))
  def test_decode_shaped_calls(self, case, expected):
    self.assertEqual(self._forward(_spec(*case)), expected)

  def test_backward_keeps_the_priority_order(self):
    plan = registry.plan(_spec(4, 8192, 32, 32, 128, 4), None,
                         BackendOptions())
    self.assertEqual((plan.forward, plan.backward), ("triton", "mosaic"))

  def test_every_record_chooses_its_own_fastest(self):
    # A call at a record's exact shape takes that record's verdict: decode
    # unless another backend was faster there by more than MARGIN and
    # NOISE_US.
    for record in route.RECORDS:
      with self.subTest(record=record[:6]):
        decode_us, fastest_us = record[6], min(record[6:])
        close = (decode_us <= route.MARGIN * fastest_us
                 or decode_us - fastest_us <= route.NOISE_US)
        expected = ("decode" if close
                    else route.BACKENDS[record.index(fastest_us, 6) - 6])
        self.assertEqual(self._forward(_spec(*record[:6])), expected)

  def test_no_preference_off_hopper_or_in_float32(self):
    mha = (32, 1024, 32, 32, 128, 1)
    self.assertEqual(self._forward(_spec(*mha, dtype="float32")), "decode")
    self.capability = "8.0"  # An A100: nothing measured, priority order.
    self.assertEqual(self._forward(_spec(*mha)), "decode")

  @parameterized.named_parameters(
      # Rows per kv head = tokens x group: the gather pays from 512 on.
      ("mha_chunk_256_rows", (8, 4096, 32, 32, 128, 256), "triton"),
      ("gqa_chunk_2048_rows", (4, 8192, 32, 8, 128, 512), "mosaic"),
      ("long_chunk", (1, 32768, 32, 8, 128, 2048), "mosaic"),
      ("new_tokens", (8, 4096, 32, 32, 128, 4), "decode"))
  def test_paged_calls(self, case, expected):
    self.assertEqual(self._forward(_spec(*case, paged=True)), expected)


if __name__ == "__main__":
  absltest.main()
