"""Examples 2, 3 and 4 run with tiny settings, and show what they claim."""

import contextlib
import importlib.util
import io
import os
import sys
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
  # Registered first, as an import would: dataclasses look their module up.
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def run_main(module, argv, stderr: io.StringIO | None = None):
  """Runs module.main(argv); returns its result and what it printed
  (stdout; stderr goes to `stderr`, or nowhere)."""
  output = io.StringIO()
  # Full float32 matmuls (not TF32 on a GPU), for tight comparisons.
  with contextlib.redirect_stdout(output), \
      contextlib.redirect_stderr(stderr or io.StringIO()), \
      jax.default_matmul_precision("highest"):
    result = module.main(argv)
  return result, output.getvalue()


class GptExampleTest(absltest.TestCase):
  # The kernels interpreted off a GPU (--interpret), --tiny's settings.
  KERNEL_RUN = ("--tiny", "--interpret")
  # Two steps, GQA: shared by the tests below (run_gpt runs it once).
  SHORT_RUN = ("--tiny", "--steps", "2", "--generate", "2", "--heads", "4",
               "--kv-heads", "2")
  if not ON_GPU:
    # On CPU every run compiles a training step (~5 s): the kernel run is
    # also the run the tests below compare with flax (its --interpret
    # ignored there), with GQA. tests/nnx_test.py covers the layer's
    # plain-JAX path on CPU.
    KERNEL_RUN = SHORT_RUN = ("--tiny", "--interpret", "--heads", "4",
                              "--kv-heads", "2")

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.gpt = load_example("gpt_nnx")
    cls.runs = {}

  def run_gpt(self, *argv):
    """run_main of the GPT example with its stderr, each argv run once."""
    if argv not in self.runs:
      stderr = io.StringIO()
      result, text = run_main(self.gpt, list(argv), stderr)
      self.runs[argv] = result, text, stderr.getvalue()
    return self.runs[argv]

  def test_trains_and_decodes_through_the_kernels(self):
    # --interpret: the real Pallas kernels, interpreted off a GPU.
    result, text, _ = self.run_gpt(*self.KERNEL_RUN, "--attention",
                                   "jflash")
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
    jflash_result, _, _ = self.run_gpt(*self.SHORT_RUN, "--attention",
                                       "jflash")
    flax_result, flax_text, _ = self.run_gpt(*self.SHORT_RUN, "--attention",
                                             "flax")
    self.assertIn("attention: flax", flax_text)
    for jflash_loss, flax_loss in zip(jflash_result["losses"],
                                      flax_result["losses"], strict=True):
      self.assertAlmostEqual(jflash_loss, flax_loss, delta=1e-4)
    self.assertLess(flax_result["decode_max_diff"], 1e-4)

  def test_no_progress_bar_when_stderr_is_no_terminal(self):
    # Redirected output (here a StringIO) reads as a clean log: the bar's
    # redraws would interleave with the log lines.
    _, text, stderr = self.run_gpt(*self.SHORT_RUN, "--attention", "jflash")
    self.assertNotIn("training:", stderr)
    self.assertNotIn("\r", stderr + text)
    self.assertRegex(text, r"\nstep +0  loss [\d.]+  validation loss")


class LongContextExampleTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.long_context = load_example("long_context")

  def test_quick_run_plots_and_shows_the_memory_benefit(self):
    # tempfile, not create_tempdir(): that needs absl flags, which pytest
    # does not parse.
    out = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                       "plot.png")
    result, text = run_main(self.long_context, ["--quick", "--out", out])
    with open(out, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    self.assertIn(f"plot saved to {out}", text)
    lengths = self.long_context.QUICK_LENGTHS["gpu" if ON_GPU else "cpu"]
    self.assertEqual([r["seq_len"] for r in result["results"]], lengths)
    smallest, largest = result["results"]
    self.assertEqual(largest["jflash"]["status"], "ok", msg=text)
    self.assertGreater(largest["jflash"]["seconds"], 0)
    # Flash attention never stores the [N, N] matrix; XLA's path does.
    self.assertLess(largest["jflash"]["bytes"], largest["xla"]["bytes"],
                    msg=text)
    if not ON_GPU:  # On CPU --quick's lengths straddle where it begins.
      self.assertGreater(smallest["jflash"]["bytes"],
                         smallest["xla"]["bytes"], msg=text)
      self.assertIn("Benefit: jflash's compiled fwd+bwd needs less memory "
                    f"than XLA's from N = {lengths[1]} on", text)
    self.assertIn("Benefit: ", text)

  def test_default_out_is_git_ignored_not_the_repository_root(self):
    root = os.path.abspath(os.path.join(EXAMPLES, ".."))
    out = self.long_context.build_parser().get_default("out")
    self.assertEqual(os.path.dirname(os.path.abspath(out)),
                     os.path.join(root, "bench_out"))
    with open(os.path.join(root, ".gitignore"), encoding="utf-8") as f:
      self.assertIn("/bench_out/", f.read().splitlines())

  def test_benefit_sentence(self):
    def row(seq_len, jflash_mib, xla_mib, jflash_s=None, xla_s=None):
      return dict(seq_len=seq_len,
                  jflash=dict(bytes=jflash_mib * 2**20, seconds=jflash_s),
                  xla=dict(bytes=xla_mib * 2**20, seconds=xla_s))

    sentence = self.long_context.benefit_sentence
    self.assertEqual(
        sentence([row(128, 3, 2), row(256, 6, 7), row(512, 12, 24)],
                 interpreted=True),
        "Benefit: jflash's compiled fwd+bwd needs less memory than XLA's "
        "from N = 256 on: XLA's needs 1.2x as much at N = 256, 2.0x at "
        "N = 512; its times measure the Pallas interpreter, not the kernels, "
        "so they are not compared.")
    # Less memory at every length, faster from the second on, in any order.
    self.assertEqual(
        sentence([row(2048, 10, 40, 1.0, 2.0), row(1024, 5, 10, 1.0, 0.5)],
                 interpreted=False),
        "Benefit: jflash's compiled fwd+bwd needs less memory than XLA's at "
        "every length measured (from N = 1024): XLA's needs 2.0x as much at "
        "N = 1024, 4.0x at N = 2048; it is faster from N = 2048 on.")
    # A win followed by a loss is no benefit.
    self.assertStartsWith(
        sentence([row(64, 1, 2, 1.0, 2.0), row(128, 3, 2, 2.0, 1.0)],
                 interpreted=False),
        "Benefit: jflash's compiled fwd+bwd needs no less memory than XLA's "
        "up to the largest length measured, N = 128")


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



class ServePagedExampleTest(absltest.TestCase):

  def test_paged_and_dense_serving_agree_and_every_page_returns(self):
    # Tiny sizes; off a GPU jflash's XLA path (tests/paged_prefill_test.py
    # and tests/decode_test.py run the kernels' paged reads through the
    # interpreter). Prompts of 2-34 tokens in chunks of 16: several
    # requests take two or three prefill chunks.
    result, text = run_main(load_example("serve_paged"), ["--tiny"])
    tolerance = (tolerances.direct(jnp.bfloat16)
                 if jax.default_backend() == "gpu" else 1e-5)
    self.assertLess(result["relative_error"], tolerance, msg=text)
    self.assertTrue(result["same_tokens"], msg=text)
    free, total = result["pages"]
    self.assertEqual(free, total, msg=text)
    for name in ("paged", "dense"):
      requests = result[name]["requests"]
      self.assertTrue(all(len(r.generated) == r.max_new for r in requests))
      self.assertTrue(any(len(r.prompt) > 16 for r in requests))
      self.assertGreater(result[name]["tokens_per_s"], 0.0)
      self.assertGreaterEqual(result[name]["ttft_ms"], 0.0)
    self.assertIn("time to first token", text)

if __name__ == "__main__":
  absltest.main()
