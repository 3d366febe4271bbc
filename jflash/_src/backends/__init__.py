"""The registered backends, in priority order (registry.py).

To add a backend: see "How to add a backend" in docs/DESIGN.md.
"""

from jflash._src import registry
from jflash._src.backends import cudnn
from jflash._src.backends import xla
from jflash._src.backends.mosaic import backend as mosaic
from jflash._src.backends.triton import backend as triton
from jflash._src.backends.triton import decode_backend

registry.register(decode_backend.BACKEND)
registry.register(mosaic.BACKEND)
registry.register(triton.BACKEND)
registry.register(xla.BACKEND)
registry.register(cudnn.BACKEND)
