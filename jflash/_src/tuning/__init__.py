"""Tuned tiles, below the backends: the cache (cache.py) and what a
backend's search covers (space.py). The search itself, which calls the
public function, is jflash/_src/autotune.py."""
