"""Examples 2, 3 and 4 run with tiny settings, and show what they claim."""

import contextlib
import importlib.util
import io
import os
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp

from tests import tolerances

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
ON_GPU = jax.default_backend() == "gpu"


def load_example(name: str):
  """Imports examples/<name>.py as a module (the folder is no package)."""
  spec = importlib.util.spec_from_file_location(
      f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_main(module, argv):
  """Runs module.main(argv); returns its result and what it printed."""
  output = io.StringIO()
  # Full float32 matmuls (not TF32 on a GPU), for tight comparisons.
  with contextlib.redirect_stdout(output), \
      contextlib.redirect_stderr(io.StringIO()), \
      jax.default_matmul_precision("highest"):
    result = module.main(argv)
  return result, output.getvalue()


class GptExampleTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.gpt = load_example("gpt_nnx")

  def test_trains_and_decodes_through_the_kernels(self):
    # --interpret: the real Pallas kernels, interpreted off a GPU.
    result, text = run_main(self.gpt, ["--tiny", "--interpret"])
    losses = result["losses"]
    self.assertLess(losses[-1], losses[0] - 0.5, msg=text)
    self.assertIn(f"first loss {losses[0]:.4f} -> last loss "
                  f"{losses[-1]:.4f}", text)
    # Cached one-token steps reproduce the full forward pass.
    self.assertLess(result["decode_last_diff"], 1e-4, msg=text)
    self.assertLess(result["decode_max_diff"], 1e-4, msg=text)
    self.assertNotEmpty(result["sample"])
    self.assertIn(result["sample"], text)

  def test_flax_attention_gives_the_same_loss_curve(self):
    # Same seed, same parameters: only the attention implementation differs.
    argv = ["--tiny", "--steps", "2", "--generate", "2", "--heads", "4",
            "--kv-heads", "2"]
    jflash_result, _ = run_main(self.gpt, argv + ["--attention", "jflash"])
    flax_result, flax_text = run_main(self.gpt, argv + ["--attention",
                                                        "flax"])
    self.assertIn("attention: flax", flax_text)
    for jflash_loss, flax_loss in zip(jflash_result["losses"],
                                      flax_result["losses"], strict=True):
      self.assertAlmostEqual(jflash_loss, flax_loss, delta=1e-4)
    self.assertLess(flax_result["decode_max_diff"], 1e-4)


class LongContextExampleTest(absltest.TestCase):

  def test_plot_and_memory(self):
    long_context = load_example("long_context")
    # tempfile, not create_tempdir(): that needs absl flags, which pytest
    # does not parse.
    out = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                       "plot.png")
    lengths = ["1024", "4096"] if ON_GPU else ["128", "512"]
    result, text = run_main(long_context, ["--lengths", *lengths,
                                           "--repeats", "1", "--out", out])
    with open(out, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    self.assertIn(f"plot saved to {out}", text)
    largest = result["results"][-1]
    self.assertEqual(largest["seq_len"], int(lengths[-1]))
    self.assertEqual(largest["jflash"]["status"], "ok", msg=text)
    self.assertGreater(largest["jflash"]["seconds"], 0)
    # Flash attention never stores the [N, N] matrix; XLA's path does.
    self.assertLess(largest["jflash"]["bytes"], largest["xla"]["bytes"],
                    msg=text)


class GeneratePagedExampleTest(absltest.TestCase):

  def test_paged_dense_and_jax_nn_agree_and_every_page_returns(self):
    # Tiny sizes; off a GPU jflash's XLA path (tests/decode_test.py runs
    # the kernel's paged path through the interpreter).
    result, text = run_main(load_example("generate_paged"), ["--tiny"])
    # The example runs in float32 off a GPU and in bf16 on one.
    tolerance = (tolerances.direct(jnp.bfloat16)
                 if jax.default_backend() == "gpu" else 1e-5)
    for name in ("paged jflash", "dense jflash"):
      self.assertLess(result[name]["relative_error"], tolerance, msg=text)
      self.assertGreater(result[name]["tokens_per_s"], 0.0)
    free, total = result["pages"]
    self.assertEqual(free, total, msg=text)
    self.assertIn("generated tokens/s", text)


if __name__ == "__main__":
  absltest.main()
