"""The examples run, so they cannot rot."""

import argparse
import contextlib
import io
import os
import re
import runpy
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax

import jflash

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
# Every example, so a new one gets its --help checked too.
EXAMPLE_NAMES = sorted(name.removesuffix(".py") for name in os.listdir(EXAMPLES)
                       if name.endswith(".py"))


def run_script(name: str, *args: str) -> tuple[int | str | None, str]:
  """Runs examples/<name>.py as `python <name>.py args...` would, in this
  process; returns its exit code (None: it returned) and its stdout."""
  path = os.path.join(EXAMPLES, f"{name}.py")
  output = io.StringIO()
  code = None
  with mock.patch.object(sys, "argv", [path, *args]), \
      contextlib.redirect_stdout(output), \
      contextlib.redirect_stderr(io.StringIO()):
    try:
      runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
      code = e.code
  return code, output.getvalue()


class ExamplesTest(absltest.TestCase):

  def test_quickstart_passes(self):
    code, text = run_script("quickstart")
    self.assertEqual(code, 0, msg=text)
    errors = re.findall(r"max \|jflash - jax\.nn\| / max \|jax\.nn\| = "
                        r"(\S+) <= (\S+): ok", text)
    self.assertLen(errors, 4, msg=text)  # Output, dq, dk, dv.
    for error, tolerance in errors:
      self.assertLessEqual(float(error), float(tolerance), msg=text)
    # float32 on a CPU, bfloat16 on a GPU.
    self.assertRegex(text, r"\nPASS: 4 of 4 relative errors within \S+ "
                     r"\((float32|bfloat16)\)\n", msg=text)

  def test_quickstart_fails_with_exit_status_1(self):
    # A wrong attention (10% too large) in place of jflash's: quick, and
    # every comparison must fail.
    def wrong_attention(q, k, v, *, is_causal, interpret):
      del interpret
      return 1.1 * jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)

    with mock.patch.object(jflash, "flash_attention", wrong_attention):
      code, text = run_script("quickstart")
    self.assertEqual(code, 1, msg=text)
    self.assertEqual(text.count("TOO LARGE"), 4, msg=text)
    self.assertIn("\nFAIL: 0 of 4 relative errors within", text)

  def test_long_context_sharded_tiny_on_four_cpu_devices(self):
    # Its own process: the fake CPU devices must exist before JAX starts.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               # As the suite (conftest.py): compiling, not running, costs.
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    env.pop("JFLASH_TEST_ON_GPU", None)
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "long_context_sharded.py"),
         "--tiny", "--cpu-devices", "4"],
        env=env, capture_output=True, text=True, check=False)
    text = result.stdout + result.stderr[-5000:]
    self.assertEqual(result.returncode, 0, msg=text)
    self.assertIn("devices: 4 x cpu", text)
    first, last = map(float, re.search(
        r"first loss ([\d.]+) -> last loss ([\d.]+)", text).groups())
    self.assertLess(last, first, msg=text)
    self.assertRegex(text, r"tokens/s: [\d,]+")
    self.assertRegex(text, r"memory per device .*: [\d.]+ MiB")


class HelpTest(parameterized.TestCase):

  @parameterized.named_parameters((name, name) for name in EXAMPLE_NAMES)
  def test_help_prints_usage_and_exits(self, name):
    code, text = run_script(name, "--help")
    self.assertEqual(code, 0, msg=text)
    self.assertStartsWith(text, f"usage: {name}.py", msg=text)
    self.assertNotIn("device:", text)  # Printed only once the example runs.

  @parameterized.named_parameters((name, name) for name in EXAMPLE_NAMES)
  def test_every_option_has_help_text(self, name):
    module = runpy.run_path(os.path.join(EXAMPLES, f"{name}.py"))
    parser = module["build_parser"]()
    self.assertIsInstance(parser, argparse.ArgumentParser)
    # argparse keeps its options in the (long-stable) private _actions.
    for action in parser._actions:  # pylint: disable=protected-access
      self.assertTrue(action.help, msg=f"{name}: {action.option_strings}")


if __name__ == "__main__":
  absltest.main()
