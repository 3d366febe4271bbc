"""The examples run, so they cannot rot."""

import contextlib
import io
import os
import runpy

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


if __name__ == "__main__":
  absltest.main()
