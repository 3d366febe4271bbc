"""What `jflash.autotune` searches for the Triton kernels (`BlockSizes`).

Candidates start from the heuristic's tiles for the call
(`config.default_tiles`); those that need more shared memory than the
device has (`config.check_fits`) are skipped.
"""

from jflash._src.backends.triton import config
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.tuning.space import TuningSpace

# (block_q, block_k, num_warps, num_stages) of the forward kernel.
FORWARD_CANDIDATES = (
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
    (128, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2), (32, 32, 4, 1),
)
# (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, warps, stages).
BACKWARD_CANDIDATES = (
    (64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2),
    (32, 128, 128, 32, 8, 2), (64, 128, 128, 64, 8, 2), (32, 32, 32, 32, 4, 2),
    (16, 16, 16, 16, 4, 1),
)

SPACE = TuningSpace(
    block_sizes_type=BlockSizes,
    forward_fields=("block_q", "block_k", "num_warps", "num_stages"),
    backward_fields=("block_q_dkv", "block_k_dkv", "block_q_dq",
                     "block_k_dq", "num_warps_bwd", "num_stages_bwd"),
    forward_candidates=FORWARD_CANDIDATES,
    backward_candidates=BACKWARD_CANDIDATES,
    base=config.default_tiles,
    check_fits=config.check_fits,
)
