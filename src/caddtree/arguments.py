"""Loading the model pair a command names: what ``caddtree generate``, ``caddtree profile`` and
``caddtree serve`` share (the options, :func:`add_pair_arguments` and :func:`add_method_arguments`,
the checks before loading, :func:`check_pair_arguments`, and the loading).

:func:`load_pair` takes the built-in pair when neither model is given
(:func:`caddtree.util.defaults.resolve_model_pair`), loads it as a
:class:`~caddtree.api.SpeculativeGenerator`, and for ``method="caddtree"`` without a cost model
obtains the one profiled once for this machine and cached
(:meth:`~caddtree.api.SpeculativeGenerator.cached_cost_model`): no silent fallback to another
method. Run the cheap argument checks first: the first use of the built-in target converts it
(tens of seconds), and loading any model takes a while.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from .util.checks import DEFAULT_DDTREE_BUDGET, DRAFTLESS_METHODS, METHODS, RUNTIMES

if TYPE_CHECKING:  # pragma: no cover
    from .api import SpeculativeGenerator
    from .core.cost import CostModel

__all__ = [
    "add_draft_dtype_argument",
    "add_method_arguments",
    "add_pair_arguments",
    "add_runtime_arguments",
    "add_target_argument",
    "check_draft_dtype",
    "check_pair_arguments",
    "load_pair",
    "load_pair_of",
]


def add_target_argument(parser: Any) -> None:
    """``--target`` (on an ``argparse`` parser): the target model, ``None`` for the built-in one."""
    parser.add_argument(
        "--target",
        help="target model: a local directory, a hub id or a .gguf file (Llama family or Qwen3; "
        "its Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights are computed as they are; "
        "default: built-in SmolLM2, "
        "its Q4_1 file)",
    )


def add_pair_arguments(parser: Any) -> None:
    """The options that name the model pair, as :func:`load_pair` takes them: ``--target``,
    ``--draft``, ``--dtype``, ``--device``, ``--context-window`` and ``--no-weight-packing`` (on an
    ``argparse`` parser)."""
    add_target_argument(parser)
    parser.add_argument("--draft", help="DFlash drafter: a local directory or hub id")
    parser.add_argument(
        "--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64"
    )
    add_draft_dtype_argument(parser)
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    parser.add_argument(
        "--context-window",
        type=int,
        metavar="N",
        help="the most tokens prompt and output may hold together (default: the target's "
        "max_position_embeddings); past the trained window, positions are extrapolated",
    )
    add_runtime_arguments(parser)


def add_draft_dtype_argument(parser: Any) -> None:
    """``--draft-dtype`` (``args.draft_dtype``), as :func:`load_pair` takes it."""
    parser.add_argument(
        "--draft-dtype",
        default="same",
        help="the drafter's dtype: same (as --dtype), auto (bfloat16 beside a float32 target on "
        "a CPU with AVX512-BF16, else the same), or a dtype; the output is the target's either way",
    )


def check_draft_dtype(value: str) -> None:
    """A ``--draft-dtype`` that names no dtype fails here, before any model loads."""
    import torch

    from .util.devices import resolve_draft_dtype

    resolve_draft_dtype(value, torch.float32, torch.device("cpu"))


def add_runtime_arguments(parser: Any) -> None:
    """``--runtime`` and ``--no-weight-packing`` (``args.runtime``, ``args.pack_weights``), as
    :func:`load_pair` takes them."""
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="auto",
        help="the target's forward: 'lean' is caddtree's own (Llama family and Qwen3; fused, "
        "packed weights and a static KV cache), 'compiled' the same compiled by torch.compile "
        "(the first run on a machine compiles for about a minute, later runs load it from the "
        "cache), 'transformers' the model's own, 'auto' (the default) the lean one on the CPU "
        "wherever it runs the model, compiled for bfloat16 where a C++ compiler is present (on a "
        "GPU ask for 'lean' or 'compiled' by name: not yet tested there)",
    )
    parser.add_argument(
        "--no-weight-packing",
        dest="pack_weights",
        action="store_false",
        help="on the CPU, leave the linear layers' weights as loaded instead of laying them out "
        "once for oneDNN (slower; saves one copy of those weights in memory)",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="run a GGUF target's quantized weights (the built-in one's Q4_1) de-quantized to "
        "bfloat16 instead of computing on their blocks (slower; for comparison)",
    )


def add_method_arguments(parser: Any, *, per_request: bool = False) -> None:
    """The options that choose the decoding method, as :meth:`SpeculativeGenerator.generate
    <caddtree.api.SpeculativeGenerator.generate>` takes it: ``--method``, ``--budget`` (DDTree's),
    ``--max-budget`` and ``--cost-model`` (CaDDTree's). ``per_request``: they are a server's
    defaults for the requests that give none (``caddtree serve``), not one run's settings."""
    if per_request:
        method_help = (
            "decoding method of a request that names none (a request may pick another with its "
            "'method' field; default caddtree)"
        )
        budget_help = (
            f"node budget of a ddtree request that gives none (default {DEFAULT_DDTREE_BUDGET})"
        )
        cost_help = (
            "of a caddtree request that names none (a request may name another with its "
            "'cost_model' field)"
        )
    else:
        method_help = "decoding method (default caddtree)"
        budget_help = f"node budget for --method ddtree (default {DEFAULT_DDTREE_BUDGET})"
        cost_help = "for --method caddtree"
    parser.add_argument("--method", choices=METHODS, default="caddtree", help=method_help)
    parser.add_argument("--budget", type=int, help=budget_help)
    parser.add_argument(
        "--max-budget", type=int, default=1024, help="largest CaDDTree tree (default 1024)"
    )
    parser.add_argument(
        "--cost-model",
        help=f"cost-model file (JSON or published .pt) {cost_help}; default: profile this "
        "machine once and cache the result",
    )
    lookup_help = (
        "copies from the context join the trees of ddtree and caddtree (prompt-lookup decoding "
        "alone: --method lookup)"
    )
    if per_request:
        lookup_help += "; for requests that give no 'lookup' field (default: --no-lookup)"
    else:  # one request: measured faster with copies (docs/results/lookup-*)
        lookup_help += "; default: on for ddtree and caddtree"
    parser.add_argument(
        "--lookup",
        action=argparse.BooleanOptionalAction,
        default=False if per_request else None,
        help=lookup_help,
    )


def check_pair_arguments(args: argparse.Namespace) -> None:
    """The checks of :func:`add_pair_arguments` and :func:`add_method_arguments`'s options that need
    no model, to run before the slow loading: a target of one's own needs its drafter (but for
    ``--method ar``), ``--dtype`` must name a dtype, and the ``--cost-model`` file is read now
    (``args.cost_model`` becomes the model)."""
    import torch

    from .core.cost import load_cost_model
    from .util.checks import check_int
    from .util.devices import resolve_dtype
    from .util.errors import InvalidInputError

    if args.target is not None and args.method not in DRAFTLESS_METHODS and args.draft is None:
        raise InvalidInputError(
            f"--method {args.method} needs --draft (a DFlash checkpoint); or use --method ar"
        )
    resolve_dtype(args.dtype, torch.device("cpu"))
    check_draft_dtype(getattr(args, "draft_dtype", "same"))
    if getattr(args, "context_window", None) is not None:
        check_int("--context-window", args.context_window, minimum=2)
    if args.cost_model is not None:
        args.cost_model = load_cost_model(args.cost_model)


def load_pair_of(args: argparse.Namespace, *, with_drafter: bool = True) -> SpeculativeGenerator:
    """:func:`load_pair` of the options :func:`add_pair_arguments` and
    :func:`add_method_arguments` declare (after :func:`check_pair_arguments`)."""
    return load_pair(
        args.target,
        args.draft,
        dtype=args.dtype,
        device=args.device,
        cost_model=args.cost_model,
        method=args.method,
        with_drafter=with_drafter,
        context_window=getattr(args, "context_window", None),
        pack_weights=getattr(args, "pack_weights", True),
        runtime=getattr(args, "runtime", "auto"),
        dequantize=getattr(args, "dequantize", False),
        draft_dtype=getattr(args, "draft_dtype", "same"),
    )


def load_pair(
    target: str | os.PathLike[str] | None,
    draft: str | os.PathLike[str] | None,
    *,
    dtype: Any = "auto",
    device: Any = None,
    cost_model: CostModel | str | os.PathLike[str] | None = None,
    method: str | None = None,
    with_drafter: bool = True,
    context_window: int | None = None,
    pack_weights: bool = True,
    runtime: str = "auto",
    dequantize: bool = False,
    draft_dtype: Any = "same",
) -> SpeculativeGenerator:
    """The generator of ``target`` and ``draft`` (both ``None``: the built-in pair, in bfloat16 for
    ``dtype="auto"``), without its drafter unless ``with_drafter``. For ``method="caddtree"`` its
    cost model is ``cost_model``, else the cached one for this machine (profiled on first use).
    ``context_window``: see :meth:`~caddtree.api.SpeculativeGenerator.set_context_window`;
    ``pack_weights``, ``runtime``, ``dequantize``, ``draft_dtype``: see
    :meth:`~caddtree.api.SpeculativeGenerator.from_pretrained`.
    ``generator.source`` names the models loaded."""
    from .api import SpeculativeGenerator
    from .util.defaults import resolve_model_pair

    target, draft, dtype = resolve_model_pair(target, draft, dtype)
    gen = SpeculativeGenerator.from_pretrained(
        target,
        draft if with_drafter else None,
        dtype=dtype,
        device=device,
        cost_model=cost_model,
        context_window=context_window,
        pack_weights=pack_weights,
        runtime=runtime,
        dequantize=dequantize,
        draft_dtype=draft_dtype,
    )
    if method == "caddtree" and gen.cost_model is None:
        # no silent fallback: profile this machine once (cached), and say so
        gen.cost_model = gen.cached_cost_model()
    return gen
