"""What `jflash.autotune` searches for a backend, as the backend declares it.

A backend with tiles declares a `TuningSpace` in its own folder
(backends/<name>/tuning.py) and registers it (`registry.Backend.tuning`);
the search (jflash/_src/autotune.py) runs on every registered backend that
has one. Like cache.py, this module imports no backend and nothing above
them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jflash._src.spec import CallSpec

Candidate = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TuningSpace:
  """A backend's tile search: candidates, and how they become tiles.

  The search times forward candidates forward-only, then backward
  candidates forward and backward with the winning forward tiles. A
  candidate is a tuple of ints that replaces `forward_fields` (or
  `backward_fields`) of the tiles it starts from.

  Attributes:
    block_sizes_type: the backend's tiles (a frozen dataclass, what
      `flash_attention(block_sizes=...)` takes there); cache entries hold
      its fields.
    forward_fields: the fields a forward candidate sets, in its order.
    backward_fields: the fields a backward candidate sets, in its order.
    forward_candidates: the forward candidates searched by default.
    backward_candidates: the backward candidates searched by default.
    base: (spec) -> the tiles forward candidates start from: the backend's
      heuristic for the call, without the cache.
    check_fits: (tiles, spec) -> None; raises ValueError for tiles this
      device cannot launch for the call (they are skipped, not timed).
  """

  block_sizes_type: type
  forward_fields: tuple[str, ...]
  backward_fields: tuple[str, ...]
  forward_candidates: tuple[Candidate, ...]
  backward_candidates: tuple[Candidate, ...]
  base: Callable[[CallSpec], Any]
  check_fits: Callable[[Any, CallSpec], None]

  def forward_tiles(self, base: Any, candidates: Sequence[Candidate] | None
                    ) -> list[Any]:
    """`base` with each forward candidate (default: the declared ones)."""
    return _replaced(base, self.forward_fields,
                     candidates or self.forward_candidates)

  def backward_tiles(self, best: Any, candidates: Sequence[Candidate] | None
                     ) -> list[Any]:
    """`best` with each backward candidate (default: the declared ones)."""
    return _replaced(best, self.backward_fields,
                     candidates or self.backward_candidates)


def _replaced(tiles, fields, candidates):
  return [dataclasses.replace(tiles, **dict(zip(fields, candidate)))
          for candidate in candidates]
