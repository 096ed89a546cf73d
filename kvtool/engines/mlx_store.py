"""``kvtool serve --engine mlx --store DIR``: mlx-lm's LRU prompt cache, persisted.

Every entry the server's ``LRUPromptCache`` keeps is also a file ``DIR/<32 hex>.safetensors``
(mlx-lm's ``save_prompt_cache``: the layers' ``state``, so codes for ``KvtoolMLXCache``
layers, and a sliding-window layer's ``RotatingKVCache`` ring with its four integers), and a
restarted server loads the files of its own model, checkpoint, dtype and policy back, each
ring checked against the model's window (:func:`~kvtool.engines.mlx_cache.ring_problem`). A
file carries, in its metadata:

* ``kvtool_serve``: JSON of the entry (store version, model fingerprint and weights, dtype,
  policy, mlx-lm's model key, the token ids, the cache type). Its sha256 names the file, so a
  file whose entry changed (a flipped token id) no longer matches its name;
* ``kvtool_serve_sum``: sha256 over every stored array (name, dtype, shape, bytes), so a
  flipped byte of K/V is caught before it is served.

A file that fails either check, or cannot be read as one, is moved to ``DIR/quarantine/``; a
file of another model, dtype or policy is left alone (a server of that model may use it). One
server owns a store at a time (``DIR/.lock``): its evictions delete the files of what it drops.
Symbolic links, FIFOs and other non-regular entries are never read, and a save replaces a link
rather than writing through it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from kvtool.errors import KvtoolError

STORE_KEY = "kvtool_serve"  # the user-metadata entry of a stored prompt cache
SUM_KEY = "kvtool_serve_sum"  # sha256 of its arrays
STORE_VERSION = 1
STORE_DIR_MODE = 0o700  # a new store: its files hold every cached conversation's token ids
QUARANTINE = "quarantine"
LOCK_FILE = ".lock"
SUFFIX = ".safetensors"
MAX_FILE_WARNINGS = 20  # per start: then a count
#: held while a file is written: a shutdown waits for it (no temp file or lost entry left)
SAVING = threading.Lock()
log = logging.getLogger("kvtool.mlx_serve")


def foreign_entries(store: str) -> list[str]:
    """The entries of an existing ``store`` directory that a prompt-cache store does not hold
    (a mistyped path: a model directory, the user's home): hidden names, ``lost+found``,
    ``quarantine`` and ``*.safetensors`` files are the store's."""
    try:
        names = os.listdir(store)
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".") and n not in (QUARANTINE, "lost+found")
                  and not (n.endswith(SUFFIX) and len(n) == 32 + len(SUFFIX)))


def lock_store(store: str) -> Any:
    """Create ``store`` and take its lock for this process (held until it exits); a
    :class:`KvtoolError` when that fails or another server holds it."""
    import fcntl

    try:
        os.makedirs(store, STORE_DIR_MODE, exist_ok=True)
        fd = os.open(os.path.join(store, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NONBLOCK
                     | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        why = f"{LOCK_FILE} is a symbolic link" if e.errno == errno.ELOOP else e.strerror or e
        raise KvtoolError(f"--store {store}: cannot create the store or its {LOCK_FILE} "
                          f"({why})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KvtoolError(f"--store {store}: its {LOCK_FILE} is not a regular file")
    handle = os.fdopen(fd, "r+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        handle.seek(0)
        owner = handle.read().strip()[:20]
        handle.close()
        if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):  # (NFS without locks: ENOLCK)
            raise KvtoolError(f"--store {store}: cannot lock it ({e.strerror or e})") from None
        raise KvtoolError(f"--store {store}: another kvtool serve --engine mlx (pid "
                          f"{owner or '?'}) uses this store; one server owns a store at a "
                          "time") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def arrays_sum(arrays: dict[str, Any], classes: list[str]) -> str:
    """sha256 over the layers' class names and mx ``arrays`` by name: each name, dtype, shape
    and bytes (what mlx-lm's ``load_prompt_cache`` rebuilds the layers from)."""
    import mlx.core as mx
    import numpy as np

    h = hashlib.sha256(b"kvtool-mlx-store-1\n")
    h.update(json.dumps(classes).encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}\0{a.dtype}\0{list(a.shape)}\0".encode())
        h.update(np.array(mx.view(mx.contiguous(a).reshape(-1), mx.uint8)).tobytes())
    return h.hexdigest()


RING_CLASS = "RotatingKVCache"  # a sliding-window layer: state (keys, values, offset, keep,
RING_SCALARS = (2, 3, 4, 5)  # max_size, ring index), the four integers after the arrays


def state_arrays(layers: list[Any]) -> dict[str, Any]:
    """The layers' states by name as ``save_prompt_cache`` writes them: arrays, and a ring's
    integers as 0-d arrays (a KvtoolError for any other value: it could not be checked)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = {}
    for name, a in tree_flatten([c.state for c in layers]):
        if isinstance(a, bool) or not isinstance(a, (mx.array, int)):
            raise KvtoolError("a layer's state holds more than arrays and integers")
        out[name] = a if isinstance(a, mx.array) else mx.array(a)
    return out


def ring_scalars(arrays: dict[str, Any], classes: list[str],
                 flat: dict[str, str]) -> dict[str, int]:
    """The integers of the file's ring layers by name; :class:`Damaged` unless they, and only
    they, are listed as mlx-lm's scalars and each is a 0-d integer array."""
    import mlx.core as mx

    want = {f"{i}.{j}" for i, c in enumerate(classes) if c == RING_CLASS for j in RING_SCALARS}
    listed: dict[str, str] = {}
    j = 1
    while f"2.{j}.0" in flat:  # mlx-lm's [metadata, classes, ["", (name, type), ...]]
        listed[flat[f"2.{j}.0"]] = flat.get(f"2.{j}.1", "")
        j += 1
    if set(listed) != want or set(listed.values()) - {"scalar"}:
        raise Damaged("its scalars are not a sliding-window layer's four integers")
    out = {}
    for name in want:
        a = arrays.get(name)
        if a is None or a.ndim != 0 or a.dtype not in (mx.int32, mx.int64):
            raise Damaged(f"state {name} is not an integer")
        out[name] = int(a.item())
    return out


def files_stamp(location: Any) -> str | None:
    """sha256 over the names, sizes and modification times of the files under ``location`` (a
    LoRA adapter's directory or file): an adapter trained again at the same path gives its
    prompts other K/V. None for no adapter; a path that cannot be read stamps as itself."""
    if location is None:
        return None
    root = Path(str(location))
    h = hashlib.sha256(str(root).encode())
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    for path in files:
        with contextlib.suppress(OSError):
            st = path.stat()
            h.update(f"\0{path.relative_to(root) if path != root else ''}\0{st.st_size}\0"
                     f"{st.st_mtime_ns}".encode())
    return h.hexdigest()


def entry_name(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32] + SUFFIX


class Damaged(Exception):
    """A stored file that cannot be what a server wrote: quarantined."""


class Stale(Exception):
    """A stored file of this server's model whose K/V no longer fit it: removed."""


def _checked_entry(data: Any, path: Path, cache_types: Any) -> dict[str, Any]:
    """``data`` (the parsed ``kvtool_serve`` entry) as a server writes it, else :class:`Damaged`:
    token ids, a model key of paths (model, adapter, draft model; None where absent) and one of
    the LRU's ``cache_types`` (anything else failed the server's start, never quarantined)."""
    if not isinstance(data, dict):
        raise Damaged("its entry is not a JSON object")
    tokens, key = data.get("tokens"), data.get("model_key")
    if not (isinstance(tokens, list) and tokens and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)):
        raise Damaged("its token ids are not a list of token ids")
    if not (isinstance(key, list) and 1 <= len(key) <= 3 and isinstance(key[0], str)
            and all(k is None or isinstance(k, str) for k in key)):
        raise Damaged("its model key is not a model path, adapter and draft model")
    if data.get("cache_type") not in cache_types:
        raise Damaged(f"its cache type is not one of {', '.join(cache_types)}")
    if entry_name(data) != path.name:
        raise Damaged("its name does not match its entry (a changed token id, model or policy)")
    return data


def prompt_cache_class(policy: Any, identity: dict[str, Any], store: str | None) -> type:
    """mlx-lm's ``LRUPromptCache`` that logs what it keeps and, with ``store``, persists it."""
    from mlx_lm.models.cache import LRUPromptCache

    ours = (STORE_VERSION, identity["fingerprint"], identity.get("weights"), identity["dtype"],
            policy.to_json())
    stamps: dict[Any, str | None] = {}  # adapter or draft path -> files_stamp, once

    def key_stamp(model_key: Any, item: int) -> str | None:
        """The stamp of a model key's LoRA adapter (``item`` 1) or draft model (2), taken the
        first time this server sees it: mlx-lm loads each once, and every request saves."""
        location = tuple(model_key)[item] if len(tuple(model_key)) > item else None
        if location not in stamps:
            stamps[location] = files_stamp(location)
        return stamps[location]

    class KvtoolPromptCache(LRUPromptCache):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._files: dict[tuple[Any, tuple[int, ...]], str] = {}
            self._file_warnings = 0  # bad files warned of at this start (see _warn_file)
            if store:
                os.makedirs(store, STORE_DIR_MODE, exist_ok=True)
                self._load_store()

        def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any],
                         **kwargs: Any) -> None:
            super().insert_cache(model, tokens, prompt_cache, **kwargs)
            kinds = sorted({type(c).__name__ for c in prompt_cache})
            log.info("kvtool: kept %d tokens in %s layers (%.2f MiB resident)", len(tokens),
                     "/".join(kinds), sum(c.nbytes for c in prompt_cache) / 2**20)
            if store:
                try:
                    self._save(model, tokens, prompt_cache, kwargs.get("cache_type", "assistant"))
                finally:
                    self._forget_evicted()

        def trim_to(self, *args: Any, **kwargs: Any) -> None:
            """mlx-lm's server trims by bytes (``--prompt-cache-bytes``) while it generates:
            the stored files of what it drops go too, or a restart would load them again."""
            super().trim_to(*args, **kwargs)
            if store:
                self._forget_evicted()

        # -- the store ---------------------------------------------------------------------------
        def _live(self) -> set[tuple[Any, tuple[int, ...]]]:
            return {(m, tuple(t)) for lru in self._lru._lrus.values() for m, t in lru}

        def _save(self, model: Any, tokens: list[int], layers: list[Any],
                  cache_type: str) -> None:
            from mlx_lm.models.cache import save_prompt_cache

            from kvtool.fileio import atomic_write

            if tuple(model)[:1] != (identity["path"],):
                return  # another model a request named: the file would carry our identity
            main = layers[:identity.get("num_layers") or len(layers)]
            if min(tokens, default=0) < 0 or {int(getattr(c, "offset", -1)) for c in main} \
                    != {len(tokens)}:  # an image's patches (mlx-lm keys them as negative
                # ids), or a draft model's last token that mlx-lm never fed to the main model
                log.debug("kvtool: not storing a prompt cache whose layers do not hold its "
                          "%d token ids", len(tokens))
                return
            data = {"version": STORE_VERSION, "fingerprint": identity["fingerprint"],
                    "weights": identity.get("weights"), "dtype": identity["dtype"],
                    "policy": policy.to_json(),
                    "model_key": list(model), "tokens": [int(t) for t in tokens],
                    "cache_type": cache_type, "sum": 1}  # "sum": its checksum is required
            for item, field in ((1, "adapter"), (2, "draft")):
                stamp = key_stamp(model, item)
                if stamp is not None:
                    data[field] = stamp
            path = os.path.join(store, entry_name(data))
            if self._files.get((model, tuple(tokens))) == path and os.path.isfile(path):
                return  # stored already: the same tokens' K/V, not rewritten on every request
            try:
                arrays = state_arrays(layers)
                meta = {STORE_KEY: json.dumps(data, sort_keys=True),
                        SUM_KEY: arrays_sum(arrays, [type(c).__name__ for c in layers])}

                def write(f: Any) -> int:
                    save_prompt_cache(f, layers, meta)
                    return f.tell()

                with SAVING:
                    atomic_write(path, write, follow_symlinks=False)
            except Exception as e:  # the answer went out already: the store misses an entry
                log.warning("kvtool: could not store a prompt cache in %s: %s: %s", store,
                            type(e).__name__, e)
                return
            self._files[(model, tuple(tokens))] = path

        def _forget_evicted(self, delete: bool = True) -> None:
            live = self._live()
            for key in [k for k in self._files if k not in live]:
                path = self._files.pop(key)
                if delete:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

        def _read(self, path: Path) -> tuple[list[Any], dict[str, Any]] | None:
            """The layers and entry of a stored file of this server's model, dtype and policy;
            None for another's (or one whose LoRA adapter is not here); :class:`Damaged` for
            one no server wrote, :class:`Stale` for one whose LoRA adapter changed."""
            import mlx.core as mx
            from mlx.utils import tree_unflatten
            from mlx_lm.models import cache as mlx_cache

            try:
                arrays, flat = mx.load(str(path), return_metadata=True)
            except Exception as e:
                raise Damaged(f"unreadable: {str(e)[:120]}") from None
            entry = flat.get(f"0.{STORE_KEY}")  # mlx-lm flattens [metadata, classes, scalars]
            if entry is None:
                raise Damaged("not a stored prompt cache")
            try:
                data = _checked_entry(json.loads(entry), path, self._lru._ordering)
            except ValueError:
                raise Damaged("its entry is not JSON") from None
            if (data.get("version"), data.get("fingerprint"), data.get("weights"),
                    data.get("dtype"), data.get("policy")) != ours:
                return None  # another model (or checkpoint), dtype or policy: not ours
            key = data["model_key"]
            for item, field, what in ((1, "adapter", "LoRA adapter"), (2, "draft", "draft model")):
                location = key[item] if len(key) > item else None
                if location is not None and not os.path.exists(location):
                    return None  # its adapter (or draft) is not here (a server started in
                    # another working directory, a relative path; or gone): never deleted
                if data.get(field) != key_stamp(key, item):
                    raise Stale(f"its {what} changed")
            stored_sum = flat.get(f"0.{SUM_KEY}")
            if data.get("sum") and stored_sum is None:
                raise Damaged("its checksum is missing")
            classes = [flat[f"1.{i}"] for i in range(len(flat)) if f"1.{i}" in flat]
            if stored_sum is not None and stored_sum != arrays_sum(arrays, classes):
                raise Damaged("its arrays do not match their checksum")  # (older: no sum)
            try:
                # what load_prompt_cache does, from the arrays read once (a server's files
                # hold arrays only: its saves refuse other state)
                states = tree_unflatten(list({**arrays, **ring_scalars(arrays, classes, flat)}
                                             .items()))
                layers = [getattr(mlx_cache, c).from_state(state)
                          for c, state in zip(classes, states, strict=True)]
                want = identity.get("num_layers")
                drafts = len(key) > 2 and key[2] is not None  # a draft model's layers follow
                main = layers[:want] if want is not None else layers
                offsets = {int(getattr(c, "offset", -1)) for c in main}
                if offsets != {len(data["tokens"])} or (want is not None and (
                        len(layers) < want or (len(layers) > want and not drafts))):
                    raise Damaged(f"{len(layers)} layers holding {sorted(offsets)[:3]} tokens, "
                                  f"for {len(data['tokens'])} token ids")
                self._check_layers(layers, len(main), len(data["tokens"]))
                # evaluated here: a lazy array of this thread's stream cannot be evaluated in
                # the server's generation thread
                mx.eval([c.state for c in layers])
            except Damaged:
                raise
            except Exception as e:  # layers mlx-lm rebuilt from what no server wrote
                raise Damaged(f"unreadable: {type(e).__name__}: {str(e)[:120]}") from None
            return layers, data

        def _check_layers(self, layers: list[Any], main: int, tokens: int) -> None:
            """Each of the model's ``main`` layers a ring exactly where the model's window is
            (``identity["windows"]``), else a KvtoolMLXCache, of its KV heads, head_dim and
            dtype (``identity["kv_shape"]``); every ring, a draft model's too, a sound one."""
            from kvtool.engines.mlx_cache import KvtoolMLXCache, ring_problem

            windows, shape = identity.get("windows"), identity.get("kv_shape")
            kv = (*shape, identity["dtype"]) if shape else None
            for i, layer in enumerate(layers):
                ring = type(layer).__name__ == RING_CLASS
                window = windows[i] if windows is not None and i < main else None
                if windows is not None and i < main and ring != (window is not None):
                    raise Damaged(f"layer {i}: {'a sliding-window' if ring else 'a full'} "
                                  f"attention layer where the model's has "
                                  f"{'full attention' if ring else 'a sliding window'}")
                problem = ring and (ring_problem(layer, window, tokens, kv) if i < main
                                    else ring_problem(layer, None, layer.offset))
                if problem:
                    raise Damaged(f"layer {i}: a sliding-window layer with {problem}")
                if ring or i >= main or windows is None:
                    continue
                if not isinstance(layer, KvtoolMLXCache):  # all this server writes there
                    raise Damaged(f"layer {i}: a {type(layer).__name__}, not a KvtoolMLXCache")
                problem = kv is not None and layer.layout_problem(kv)
                if problem:
                    raise Damaged(f"layer {i}: {problem}")

        def _quarantine(self, path: Path, why: str) -> None:
            folder = os.path.join(store, QUARANTINE)
            try:
                if os.path.islink(folder):  # never moved out of the store through a link
                    raise OSError(f"{folder} is a symbolic link")
                os.makedirs(folder, exist_ok=True)
                os.replace(path, os.path.join(store, QUARANTINE, path.name))
                self._warn_file("kvtool: %s: %s; moved to %s/", path, why, QUARANTINE)
            except OSError as e:
                self._warn_file("kvtool: %s: %s; kept (cannot quarantine it: %s)", path, why, e)

        def _warn_file(self, message: str, *args: Any) -> None:
            """One start's warnings of bad files: the first :data:`MAX_FILE_WARNINGS`, then
            a count (a store of thousands of junk files logs a screenful, not thousands)."""
            self._file_warnings += 1
            if self._file_warnings <= MAX_FILE_WARNINGS:
                log.warning(message, *args)

        def _load_store(self) -> None:
            from kvtool.fileio import remove_stale_temps

            with contextlib.suppress(OSError):
                remove_stale_temps(store)  # a killed server's writes
            found = []
            for path in Path(store).glob("*" + SUFFIX):
                try:
                    st = os.lstat(path)
                except OSError:
                    continue  # gone since the listing
                if not stat.S_ISREG(st.st_mode):  # a link, FIFO or directory: never opened
                    self._warn_file("kvtool: skipping %s (not a regular file)", path)
                    continue
                found.append((st.st_mtime, str(path)))
            loaded = other = damaged = 0
            for _, name in sorted(found):  # oldest first: a newer copy of an entry wins
                path = Path(name)
                try:
                    entry = self._read(path)
                except Damaged as e:
                    self._quarantine(path, str(e))
                    damaged += 1
                    continue
                except Stale as e:
                    log.info("kvtool: removing %s (%s)", path, e)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                if entry is None:
                    other += 1
                    continue
                layers, data = entry
                key = (identity["path"], *data["model_key"][1:])
                tokens = tuple(data["tokens"])
                older = self._files.get((key, tokens))
                if older is not None:  # the same entry twice (another model path): one stays
                    with contextlib.suppress(OSError):
                        os.unlink(older)
                    loaded -= 1
                super().insert_cache(key, data["tokens"], layers, cache_type=data["cache_type"])
                self._files[(key, tokens)] = str(path)
                loaded += 1
            # what did not fit stays on disk (a restart with a larger cache loads it); this
            # server did not write it
            self._forget_evicted(delete=False)
            unsaid = self._file_warnings - MAX_FILE_WARNINGS
            if unsaid > 0:
                log.warning("kvtool: ... and %d more files skipped or quarantined", unsaid)
            log.info("kvtool: prompt-cache store %s: %d cached prompts loaded, %d files of "
                     "another model, dtype or policy left alone, %d damaged", store, loaded,
                     other, damaged)

    return KvtoolPromptCache
