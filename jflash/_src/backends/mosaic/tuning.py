"""What `jflash.autotune` searches for the Mosaic GPU kernels
(`MosaicBlockSizes`, on a Hopper GPU).

Candidates start from the tiles by head dim (`config.default_tiles`);
those that exceed shared memory at the head dim (`config.check_fits`) are
skipped.
"""

from jflash._src.backends.mosaic import config
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.tuning.space import TuningSpace

# (block_q, block_kv, num_stages) of the forward kernel.
FORWARD_CANDIDATES = (
    (64, 128, 2), (64, 64, 2), (64, 64, 3), (64, 256, 2), (128, 64, 2),
)
# (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv, backward_stages).
BACKWARD_CANDIDATES = (
    (64, 64, 64, 64, 3), (64, 64, 64, 64, 2), (64, 128, 128, 64, 2),
    (64, 64, 64, 128, 2), (128, 64, 64, 64, 2),
)

SPACE = TuningSpace(
    block_sizes_type=MosaicBlockSizes,
    forward_fields=("block_q", "block_kv", "num_stages"),
    backward_fields=("block_q_dq", "block_kv_dq", "block_q_dkv",
                     "block_kv_dkv", "backward_stages"),
    forward_candidates=FORWARD_CANDIDATES,
    backward_candidates=BACKWARD_CANDIDATES,
    base=config.default_tiles,
    check_fits=config.check_fits,
)
