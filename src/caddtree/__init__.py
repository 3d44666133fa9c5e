"""caddtree: lossless speculative decoding with cost-aware diffusion draft trees.

Public API (see README.md):

* draft trees - :class:`DraftTree`, :func:`build_chain`, :func:`build_ddtree`, :func:`build_caddtree`
* cost models - :class:`CostModel`, :class:`ConvexCostModel`, :class:`ConstantCostModel`,
  :func:`load_cost_model`
* transformers - ``model.generate(..., custom_generate=caddtree.hf.generate)`` (:mod:`caddtree.hf`)
* generation - :class:`SpeculativeGenerator` (``from_pretrained`` then ``generate``) and the
  DFlash drafter :class:`DFlashDraftModel`; these load torch and transformers on first use.
"""

from .core.cost import ConstantCostModel, ConvexCostModel, CostModel, load_cost_model
from .core.cost_fit import FitQuality
from .core.tree import (
    DraftTree,
    TopK,
    build_caddtree,
    build_chain,
    build_ddtree,
    surrogate_throughput,
    topk_log_probs,
)
from .util.checks import METHODS
from .util.errors import (
    CaddtreeError,
    CheckpointError,
    CostModelError,
    InvalidInputError,
    MissingDependencyError,
)
from .util.lazy import lazy_exports

__version__ = "0.1.0"

# Keep `import caddtree` light: the tree and cost layers need only numpy; the generator and the
# drafter load torch and transformers when first used.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "SpeculativeGenerator": "api",
        "GenerationResult": "engine.stats",
        "DFlashDraftModel": "models",
    },
    # submodules reachable as attributes without importing them first (``caddtree.hf.generate``)
    submodules=("hf",),
)

__all__ = [
    "CaddtreeError",
    "CheckpointError",
    "ConstantCostModel",
    "ConvexCostModel",
    "CostModel",
    "CostModelError",
    "DFlashDraftModel",
    "DraftTree",
    "FitQuality",
    "GenerationResult",
    "InvalidInputError",
    "METHODS",
    "MissingDependencyError",
    "SpeculativeGenerator",
    "TopK",
    "build_caddtree",
    "build_chain",
    "build_ddtree",
    "load_cost_model",
    "surrogate_throughput",
    "topk_log_probs",
]
