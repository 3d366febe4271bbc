"""Keeps JAX's Pallas Triton deprecation warning out of users' logs.

JAX 0.11 deprecated the Pallas Triton backend and warns (DeprecationWarning)
each time a Triton kernel is lowered, i.e. at every compilation of every
jitted function that calls jflash. The warning is addressed to kernel authors
(us), not to our users, and the plan for a JAX without the backend lives in
docs/DESIGN.md. jflash therefore installs one narrow filter, matching this
message only, when it is imported. Set JFLASH_SHOW_TRITON_DEPRECATION=1 in the
environment before importing jflash to keep the warning.
"""

from __future__ import annotations

import os
import warnings

SHOW_ENV_VAR = "JFLASH_SHOW_TRITON_DEPRECATION"
MESSAGE_PATTERN = r"The Pallas Triton backend is deprecated"


def silence_triton_deprecation() -> bool:
  """Installs the filter unless the user opted out; returns whether it did."""
  if os.environ.get(SHOW_ENV_VAR, "").strip() not in ("", "0"):
    return False
  warnings.filterwarnings(
      "ignore", message=MESSAGE_PATTERN, category=DeprecationWarning)
  return True
