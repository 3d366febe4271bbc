"""The examples run, so they cannot rot."""

import contextlib
import io
import os
import re
import runpy
import subprocess
import sys

from absl.testing import absltest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


class ExamplesTest(absltest.TestCase):

  def test_quickstart(self):
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
      runpy.run_path(os.path.join(EXAMPLES, "quickstart.py"),
                     run_name="__main__")
    text = output.getvalue()
    self.assertIn("max |jflash - jax.nn|", text)
    # Every reported error is small relative to the values it compares.
    for line in text.splitlines():
      if "= " in line and "max |jflash" in line:
        error = float(line.split("= ")[1].split()[0])
        self.assertLess(error, 5e-2, msg=line)

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


if __name__ == "__main__":
  absltest.main()
