"""The one-shot GPU run of docs/training.md ("One shot on a GPU"): new target-written data and
the shipped drafter trained further on it, on a machine lent for minutes.

    python scripts/gpu_drafter_run.py prepare        # here: pieces of the target, the commands
    python3 scripts/gpu_drafter_run.py stash         # there: keep the piece this command carries
    python3 scripts/gpu_drafter_run.py run           # there: the last piece, then every phase
    python scripts/gpu_drafter_run.py collect DIR    # here: the data that came back, checked

``prepare`` cuts the target's GGUF into pieces that fit next to the working tree in one command
(``runs/gpu-run/pieces/``), writes their SHA-256 manifest and a copy of the pure-Python ``gguf``
package (``runs/gpu-run/kit/``), and prints the commands to send, each with what it carries.
``stash`` and ``run`` need nothing but Python with torch and transformers there: this script puts
``src/`` and the carried ``gguf`` on the import path itself. The phases and their deadlines are
in :mod:`caddtree.train.oneshot`. ``collect`` joins the data files that came back into one
and drops every sample whose prompt overlaps a benchmark prompt (the GPU machine has no benchmark
packages to check against).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT_ROOT = Path("runs/gpu-run")  # relative to the repository; ignored by git, so it can be carried
DATA = Path("training-data/smollm2-135m-instruct")
DRAFTER = Path("src/caddtree/assets/smollm2-135m-dflash")
SEND_LIMIT = 64 << 20  # what one command may send, code included
TUNING = (  # RunSettings fields the command line may set
    ("query_batch", int),
    ("query_tokens", int),
    ("max_queries", int),
    ("response_batch", int),
    ("response_tokens", int),
    ("eval_tokens", int),
    ("feature_chunk", int),
    ("feature_batch_tokens", int),
    ("samples_per_step", int),
    ("anchors_per_sample", int),
    ("learning_rate", float),
    ("warmup_steps", int),
    ("save_every", int),
)


def set_import_path(root: Path, kit: bool) -> None:
    """``src/`` first on the import path, and before it (``kit``: on the GPU machine) the
    carried ``gguf`` package."""
    paths = ([root / "kit" / "site"] if kit else []) + [REPO / "src"]
    for path in paths:
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = args.root if args.root.is_absolute() else REPO / args.root
    set_import_path(root, kit=args.step in (stash_step, run_step))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    return args.step(args, root)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=KIT_ROOT, help="the kit and pieces' folder")
    ap.add_argument("--work", type=Path, default=None, help="folder kept between commands there")
    steps = ap.add_subparsers(required=True)
    prep = steps.add_parser("prepare", help="here: the pieces, the manifest, the commands")
    prep.add_argument("--gguf", type=Path, default=None, help="default: the built-in target's")
    prep.add_argument("--piece-mib", type=float, default=None, help="default: what fits")
    prep.add_argument("--margin-mib", type=float, default=2.0)
    prep.set_defaults(step=prepare)
    stash = steps.add_parser("stash", help="there: keep the piece this command carries")
    stash.set_defaults(step=stash_step)
    run = steps.add_parser("run", help="there: the last piece, then every phase")
    add_run_options(run)
    run.set_defaults(step=run_step)
    collect = steps.add_parser("collect", help="here: join the returned data, overlap dropped")
    collect.add_argument("returned", type=Path, help="the folder the files came back to")
    collect.add_argument("--output", type=Path, default=KIT_ROOT / "returned-data.safetensors")
    collect.set_defaults(step=collect_step)
    return ap


def add_run_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="default: $OUT")
    run.add_argument("--drafter", type=Path, default=REPO / DRAFTER)
    run.add_argument("--committed", default=str(REPO / DATA), help="'' for none")
    run.add_argument("--eval-prompts", type=Path, default=REPO / DATA / "unseen40.jsonl")
    run.add_argument("--device", default=None, help="default: cuda where torch sees one")
    run.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    run.add_argument("--total-s", type=float, default=540.0, help="the whole run's deadline")
    run.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help="a phase's budget (assemble, queries, responses, features, evaluate, pack)",
    )
    run.add_argument("--generator", choices=("engine", "hf"), default="engine")
    run.add_argument("--seed", type=int, default=1)
    for name, kind in TUNING:
        run.add_argument("--" + name.replace("_", "-"), type=kind, default=None)


# ---- prepare (here) ------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, root: Path) -> int:
    from caddtree.train.pieces import split_file, travelling_bytes

    gguf_file = args.gguf
    if gguf_file is None:
        from caddtree.util.defaults import smollm2_gguf_path

        gguf_file = smollm2_gguf_path()
    kit = root / "kit"
    copy_gguf_package(kit / "site")
    if args.piece_mib is not None:
        piece = int(args.piece_mib * (1 << 20))
    else:
        sent = travelling_bytes(REPO, [kit])
        piece = SEND_LIMIT - sent - int(args.margin_mib * (1 << 20))
        if piece < 1 << 20:
            raise SystemExit(
                f"the working tree and the kit take {sent / 2**20:.1f} MiB of the "
                f"{SEND_LIMIT >> 20} MiB a command may send: no room for a piece of the target. "
                "Make the tracked tree smaller, or pass --piece-mib."
            )
    manifest = split_file(Path(gguf_file), root / "pieces", kit / "manifest.json", piece)
    commands = device_commands(root, [p["name"] for p in manifest.pieces])
    (kit / "commands.json").write_text(json.dumps(commands, indent=1) + "\n")
    print(
        f"{manifest.name}: {manifest.size / 2**20:.1f} MiB in {len(manifest.pieces)} pieces of "
        f"{manifest.pieces[0]['size'] / 2**20:.1f} MiB at most (sha256 {manifest.sha256[:16]}...)"
    )
    print("send these, one after the other, within 30 s of each other:")
    for n, command in enumerate(commands, 1):
        print(f"{n}. {json.dumps(command)}")
    return 0


def copy_gguf_package(site: Path) -> None:
    """A copy of the installed pure-Python ``gguf`` package (transformers reads GGUF files with
    it), without its compiled caches."""
    import importlib.util

    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the gguf package is not installed here: pip install gguf")
    source = Path(next(iter(spec.submodule_search_locations)))
    if site / "gguf" == source:
        return
    shutil.rmtree(site / "gguf", ignore_errors=True)
    shutil.copytree(source, site / "gguf", ignore=shutil.ignore_patterns("__pycache__"))


def device_commands(root: Path, pieces: list[str]) -> list[dict]:
    """The ``run`` calls of the device tool: one ``stash`` per piece but the last, then ``run``
    with the last piece; each carries the kit and its piece."""
    rel = root.relative_to(REPO) if root.is_relative_to(REPO) else root
    kit = str(rel / "kit")
    calls = [
        {
            "command": "python3 scripts/gpu_drafter_run.py stash",
            "carry": [kit, str(rel / "pieces" / name)],
            "timeout_s": 120,
        }
        for name in pieces[:-1]
    ]
    calls.append(
        {
            "command": "PYTHONUNBUFFERED=1 python3 scripts/gpu_drafter_run.py run",
            "carry": [kit, str(rel / "pieces" / pieces[-1])],
            "timeout_s": 600,
        }
    )
    return calls


# ---- stash and run (there) -----------------------------------------------------------------------


def work_dir(args: argparse.Namespace) -> Path:
    """Where the pieces and the converted target stay between commands on the GPU machine."""
    default = os.environ.get("CADDTREE_GPU_RUN_WORK", "/tmp/caddtree-gpu-run")
    return args.work or Path(default)


def stash_step(args: argparse.Namespace, root: Path) -> int:
    from caddtree.train.pieces import read_manifest, stash_pieces

    manifest = read_manifest(root / "kit" / "manifest.json")
    status = stash_pieces(manifest, root / "pieces", work_dir(args) / "pieces")
    print(json.dumps(status))
    return 1 if status["damaged"] else 0


def run_step(args: argparse.Namespace, root: Path) -> int:
    if args.out is None:
        raise SystemExit("no output folder: set $OUT or pass --out")
    work = work_dir(args)
    os.environ.setdefault("CADDTREE_CACHE", str(work / "cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from caddtree.train.oneshot import RunSettings, run_oneshot

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = RunSettings(
        kit=root / "kit",
        carried=root / "pieces",
        work=work,
        out=Path(args.out),
        drafter=args.drafter,
        committed=Path(args.committed) if args.committed else None,
        eval_prompts=args.eval_prompts,
        device=device,
        dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        seed=args.seed,
        total_s=args.total_s,
        generator=args.generator,
    )
    for item in args.budget:
        name, _, seconds = item.partition("=")
        settings.budgets[name] = float(seconds)
    for name, _ in TUNING:
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    report = run_oneshot(settings)
    print(json.dumps(summary(report), indent=1))
    failed = [n for n, p in report["phases"].items() if p.get("status") == "failed"]
    return 1 if failed else 0


def collect_step(args: argparse.Namespace, root: Path) -> int:
    """The returned data shards as one file, without samples that overlap a benchmark."""
    from transformers import AutoTokenizer

    from caddtree.train.data import TrainingData
    from caddtree.train.magpie import user_messages
    from caddtree.train.prompts import OverlapIndex
    from caddtree.util.defaults import default_target_dir

    shards = sorted(Path(args.returned).glob("data-*.safetensors"))
    if not shards:
        raise SystemExit(f"no data-NN.safetensors in {args.returned}")
    parts = [TrainingData.load(path) for path in shards]
    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    index = OverlapIndex.from_benchmarks()
    keep_seqs, keep_lengths, dropped = [], [], 0
    for part in parts:
        for seq, p in zip(part.sequences, part.prompt_lengths):
            if any(index.overlaps(t) for t in user_messages(tokenizer, seq[:p].tolist())):
                dropped += 1
                continue
            keep_seqs.append(seq)
            keep_lengths.append(p)
    meta = dict(parts[0].meta, benchmark_overlap_checked=True, benchmark_overlap_dropped=dropped)
    output = args.output if args.output.is_absolute() else REPO / args.output
    TrainingData(keep_seqs, keep_lengths, meta).save(output)
    print(f"{len(keep_seqs)} samples to {output}; {dropped} dropped as overlapping a benchmark")
    return 0


def summary(report: dict) -> dict:
    """Each phase's outcome and time, tau, and the files that come back."""
    phases = {
        name: {k: v for k, v in phase.items() if k in ("status", "seconds", "error", "why")}
        for name, phase in report["phases"].items()
    }
    evaluation = report["phases"].get("evaluate", {})
    tau = {k: v for k, v in evaluation.items() if isinstance(v, dict)}
    files = [f"{f['file']} ({f['bytes']} bytes)" for f in report.get("files", [])]
    return {"phases": phases, "tau": tau, "files": files, "seconds": report.get("seconds")}


if __name__ == "__main__":
    sys.exit(main())
