"""caddtree: lossless speculative decoding with cost-aware diffusion draft trees.

Public API (see README.md):

* draft trees - :class:`DraftTree`, :func:`build_chain`, :func:`build_ddtree`, :func:`build_caddtree`
* cost models - :class:`CostModel`, :class:`ConvexCostModel`, :class:`ConstantCostModel`,
  :func:`load_cost_model`
"""

from .cost import ConstantCostModel, ConvexCostModel, CostModel, FitQuality, load_cost_model
from .errors import CaddtreeError, CheckpointError, CostModelError, InvalidInputError
from .tree import (
    DraftTree,
    TopK,
    build_caddtree,
    build_chain,
    build_ddtree,
    surrogate_throughput,
    topk_log_probs,
)

__version__ = "0.1.0"

__all__ = [
    "CaddtreeError",
    "CheckpointError",
    "ConstantCostModel",
    "ConvexCostModel",
    "CostModel",
    "CostModelError",
    "DraftTree",
    "FitQuality",
    "InvalidInputError",
    "TopK",
    "build_caddtree",
    "build_chain",
    "build_ddtree",
    "load_cost_model",
    "surrogate_throughput",
    "topk_log_probs",
]
