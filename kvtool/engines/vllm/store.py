"""The on-disk prefix store behind :class:`~kvtool.engines.vllm.connector.KvtoolConnector`.

A store lives in a directory or under an ``s3://bucket/prefix`` URL (:func:`open_store`; the
storage layer: :mod:`~kvtool.engines.vllm.store_backend`, :mod:`~kvtool.engines.vllm.store_s3`),
with the same layout and rules on both.

A prompt is cut into chunks of ``chunk_tokens`` tokens (a multiple of vLLM's block size). Chunk
``i`` is keyed by a hash chain: ``h_0 = H(tag, model fingerprint, chunk_tokens[, weights])``,
``h_{i+1} = H(h_i, token ids of chunk i)``, so a key names the chunk *and every token before it*
for one model. The weights fingerprint (:func:`~kvtool.checkpoint.weights_fingerprint`, when the
server knows it) keeps checkpoints of one layout (a base model and its fine-tunes) apart: they
share the model's directory, never a key. Each chunk is a small .kvz file (written through
:mod:`kvtool.formats`, any codec policy) at ``<root>/<fingerprint[:16]>/<key[:2]>/<key>.kvz``
holding that chunk's K/V and token ids. The longest stored prefix of a prompt is the longest
run of chunk files that exist from its start; two prompts that share a system prompt share
its chunks. A GPU worker writes chunks it encoded on the device
(:meth:`PrefixStore.write_encoded`: the same bytes) and decodes them there
(:meth:`PrefixStore.read_into`; see :mod:`~kvtool.engines.vllm.device_io`).

A chunk file is trusted only after its header says it belongs to this model and holds exactly
the chunk's token ids (verdicts are cached per file inode, size and mtime; on S3 per ETag; see
:mod:`~kvtool.engines.vllm.store_verdicts`). A
shared store is other people's data (the design's store rules):

* nothing is ever deleted on a load error; a damaged file is moved to ``<root>/quarantine/``
  (as ``<fingerprint[:16]>-<key>.<time_ns>.kvz``) only by a store that may write
  (``writable``: roles ``kv_both``, ``kv_producer``); a read-only store (``kv_consumer``) skips
  it, remembering it as bad until the file changes;
* a file of a newer format or codec version is skipped and left alone;
* symlinks (and FIFOs, devices) are never followed or opened, neither as chunk files nor as
  directories below the root (:mod:`~kvtool.engines.vllm.safeio`);
* temp files that a killed writer left behind count in :meth:`PrefixStore.size_bytes` and are
  removed by :meth:`PrefixStore.collect_garbage` and by the next write into their directory
  (on S3 a chunk is one PUT of the whole object: there are none).

Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.cache import KVCache
from kvtool.engines.vllm.chunk_checks import check_file
from kvtool.engines.vllm.common import check_cache, log
from kvtool.engines.vllm.safeio import Stamp, in_memory
from kvtool.engines.vllm.store_backend import (
    Backend,
    chunk_name,
    is_url,
    open_backend,
)
from kvtool.engines.vllm.store_verdicts import ChunkJudge
from kvtool.fileio import TEMP_SUFFIX
from kvtool.identity import identity_dtype, portable_identity
from kvtool.policy import CodecPolicy

HASH_TAG = b"kvtool-prefix-store-v1"


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A chunk file's bytes as read (:meth:`PrefixStore.fetch`) and the stamp of the file."""

    data: bytes
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored (or storable) chunk: its key and token range in the sequence."""

    key: str
    start: int
    stop: int
    path: str

    @property
    def place(self) -> dict[str, Any]:
        """What the chunk's file records of it (the header's ``store_chunk``)."""
        return {"key": self.key, "start": self.start}


def open_store(location: str | os.PathLike, model: dict[str, Any], chunk_tokens: int,
               policy: CodecPolicy, *, storage_options: dict | None = None,
               **kwargs: Any) -> PrefixStore:
    """The prefix store at a directory or an ``s3://bucket/prefix`` URL (``storage_options``:
    the S3 client's options, see :class:`~kvtool.engines.vllm.store_s3.S3Backend`);
    ``kwargs``: those of :class:`PrefixStore`."""
    backend = open_backend(location, storage_options, writable=kwargs.get("writable", True))
    return PrefixStore(location, model, chunk_tokens, policy, backend=backend, **kwargs)


class PrefixStore(ChunkJudge):
    """Chunk files of one model under ``root``; see the module docstring."""

    def __init__(self, root: str | os.PathLike, model: dict[str, Any], chunk_tokens: int,
                 policy: CodecPolicy, *, zstd: int | bool = False, entropy: bool = False,
                 tokenizer_fingerprint: str | None = None, writable: bool = True,
                 backend: Backend | None = None):
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.backend = backend or open_backend(root, writable=writable)
        self.root = self.backend.location if is_url(root) else Path(root)
        # keyed by the dtype-free identity: servers of one model in any dtype share chunks
        # (cast on load); a pre-split identity (dtype in its layout) is brought up to date
        self.model = portable_identity(model)
        self.fingerprint = str(self.model["fingerprint"])
        self.chunk_tokens = int(chunk_tokens)
        # sink=auto: chunks are written as they come, so every scanned token stays exact
        self.policy = policy if policy is None else policy.resolve()
        # a lossless server answers as a cold run would: it loads only chunks stored exactly in
        # its own dtype (not another server's lossy or cast ones)
        dtype = identity_dtype(self.model)
        self.exact_dtype = None if policy is None or policy.is_lossy(dtype) else (dtype or "")
        self.zstd, self.entropy = zstd, entropy
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.model_dir = self.fingerprint[:16]  # this model's directory (key prefix) in the store
        self.dir = self.backend.path(self.model_dir)
        self.writable = writable  # False for kv_consumer: this process never changes the store
        self._warned: set[str] = set()
        self._unreplaceable: set[tuple[str, Any]] = set()  # (lossy file, stamp) refused to us
        self._warned_newer = False
        self._warned_inexact = False
        #: what this server's K/V went through before the store (an fp8 paged cache's
        #: rounding, ``"fp8_e4m3"``): recorded in every chunk it writes
        self.lossy_sources: list[str] = []
        #: chunks this store wrote in place of a file it removed (stored lossy) or quarantined
        self.replaced = 0

    # -- keys -------------------------------------------------------------------------------------
    def chunks(self, token_ids: Sequence[int], limit: int | None = None) -> list[Chunk]:
        """The full chunks of ``token_ids[:limit]``, in order, with their chain keys."""
        ids = np.asarray(token_ids, dtype="<i8").reshape(-1)
        n = len(ids) if limit is None else max(0, min(limit, len(ids)))
        seed = HASH_TAG + b"\0" + self.fingerprint.encode() + b"\0" \
            + str(self.chunk_tokens).encode()
        if self.model.get("weights"):
            seed += b"\0" + str(self.model["weights"]).encode()
        h = hashlib.sha256(seed).digest()
        out = []
        for start in range(0, n - self.chunk_tokens + 1, self.chunk_tokens):
            stop = start + self.chunk_tokens
            h = hashlib.sha256(h + ids[start:stop].tobytes()).digest()
            key = h.hex()
            out.append(Chunk(key, start, stop, self.backend.path(self._name_of(key))))
        return out

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], limit: int | None = None, *,
               found: list[Chunk] | None = None, deadline: float | None = None) -> list[Chunk]:
        """The longest run of valid stored chunks from the start of ``token_ids[:limit]``.

        ``found``: a list the chunks are appended to as they are validated (what a caller
        that stopped waiting can still use); ``deadline``: a ``time.monotonic()`` after which
        no further chunk is looked at (see :class:`~kvtool.engines.vllm.guard.StoreGuard`)."""
        found = [] if found is None else found
        for chunk in self.chunks(token_ids, limit):
            if deadline is not None and time.monotonic() > deadline:
                break
            if not self.is_valid(chunk, token_ids):
                break
            found.append(chunk)
        return list(found)

    def exists(self, chunk: Chunk) -> bool:
        """Whether a regular file (not a symlink) is stored for ``chunk``."""
        return self.backend.exists(self._name(chunk))

    def pin(self, chunk: Chunk) -> contextlib.AbstractContextManager[tuple[str, Stamp]]:
        """``(path to read, stamp)`` of the chunk's file, opened without following a symlink
        anywhere below the root (see :mod:`~kvtool.engines.vllm.safeio`; on S3 downloaded
        whole). ``FileNotFoundError`` when absent, :class:`UnsafeFileError` for a symlink or a
        non-regular file."""
        return self.backend.pin(self._name(chunk))

    def _name_of(self, key: str) -> str:
        return chunk_name(self.model_dir, key)

    def _name(self, chunk: Chunk) -> str:
        """The chunk's object name in the store (relative, "/"-separated)."""
        return self._name_of(chunk.key)

    # -- read / write -----------------------------------------------------------------------------
    def fetch(self, chunk: Chunk) -> Fetched:
        """The chunk's file read whole into memory: all of a load's I/O, which the connector
        bounds with a deadline; decoding it (:meth:`read`) is computation, which it does not.
        ``FileNotFoundError`` when absent."""
        with self.pin(chunk) as (path, stamp), open(path, "rb") as f:
            return Fetched(f.read(), stamp)

    def read(self, chunk: Chunk, tokens: int | None = None,
             fetched: Fetched | None = None) -> KVCache:
        """The chunk's first ``tokens`` (default: all) decoded K/V (torch), every checksum
        verified and checked against this model, from ``fetched`` (default: :meth:`fetch`
        now); a failure of the file is passed to :meth:`reject` and raised."""
        from kvtool.formats import load

        fetched = self.fetch(chunk) if fetched is None else fetched
        want = chunk.stop - chunk.start if tokens is None else tokens
        try:
            with in_memory(fetched.data, chunk.path) as path:
                cache = load(path, tokens=tokens, backend="torch")
            check_cache(cache, self.model, want)
        except OSError:  # the bytes are in memory: this process's (EMFILE, ENOMEM), not the file's
            raise
        except Exception as e:
            self.reject(chunk, e, fetched.stamp)
            raise
        self._mark_hit(chunk, fetched)
        return cache

    def read_into(self, chunk: Chunk, tokens: int, fetched: Fetched | None,
                  consume: Callable[[Any], None]) -> None:
        """:meth:`read` for the CUDA path: the chunk's file opened from ``fetched`` (default:
        :meth:`fetch` now), checked as :meth:`read` checks it
        (:func:`~kvtool.engines.vllm.chunk_checks.check_file`) and handed
        to ``consume`` (:func:`~kvtool.engines.vllm.device_io.load_file`), which decodes its
        first ``tokens`` where they go. A failure of the file — in the checks, or a
        :class:`FormatError` in ``consume`` (a checksum, a code no writer stores) — is passed
        to :meth:`reject` and raised, as by :meth:`read`; others are only raised."""
        from kvtool.errors import FormatError
        from kvtool.formats import open_kvz

        fetched = self.fetch(chunk) if fetched is None else fetched
        checked = False
        try:
            with in_memory(fetched.data, chunk.path) as path, open_kvz(path) as f:
                check_file(f, self.model, tokens)
                checked = True
                consume(f)
        except OSError:  # as in read: not the file's
            raise
        except Exception as e:
            if not checked or isinstance(e, FormatError):
                self.reject(chunk, e, fetched.stamp)
            raise
        self._mark_hit(chunk, fetched)

    def _mark_hit(self, chunk: Chunk, fetched: Fetched) -> None:
        """The last hit, for `kvtool store prune` (LRU); see the backends."""
        name = self._name(chunk)
        self.backend.mark_hit(name, self.backend.path(name), fetched.stamp)

    def chunk_policy(self, chunk: Chunk) -> CodecPolicy:
        """The policy ``chunk`` is written with: no recent window (a chunk is never the end of
        anything), sink tokens in a prompt's first chunk only."""
        return dataclasses.replace(self.policy, recent_tokens=0,
                                   sink_tokens=self.policy.sink_tokens if chunk.start == 0
                                   else 0)

    def write(self, chunk: Chunk, keys: list[Any], values: list[Any],
              token_ids: Sequence[int], *, lossy_sources: Sequence[str] = ()) -> int:
        """Encode and write one chunk atomically; its file size, or 0 where one is kept.
        Existing chunks are kept (but for :meth:`_free_place`); a symlink in the chunk's
        place is replaced, never written through. ``lossy_sources``: the lossy steps the K/V
        went through (a pinned file's), recorded in the chunk."""
        from kvtool.formats import save

        self._check_writable()
        cache = KVCache(keys, values, token_ids=np.asarray(token_ids[chunk.start:chunk.stop]),
                        model=self.model, tokenizer_fingerprint=self.tokenizer_fingerprint,
                        lossy_sources=[*self.lossy_sources, *lossy_sources])
        policy = self.chunk_policy(chunk)
        return self._write_new(chunk, token_ids, lossy_sources, lambda path: int(
            save(cache, path, policy, zstd=self.zstd, entropy=self.entropy,
                 store_chunk=chunk.place)["file_bytes"]))

    def write_encoded(self, chunk: Chunk, encoded: Any, token_ids: Sequence[int]) -> int:
        """:meth:`write` of a chunk encoded already (an
        :class:`~kvtool.engines.vllm.device_io.EncodedChunk`: ``encode_chunk`` with
        :meth:`chunk_policy`, then ``to_host``), once its host copies are done: the same
        bytes :meth:`write` writes for the same codes."""
        from kvtool.engines.vllm.device_io import ReplayPolicy
        from kvtool.formats.writer import write_kvz

        self._check_writable()
        encoded.wait()
        replay = ReplayPolicy(encoded, self.chunk_policy(chunk))
        ids = np.asarray(token_ids[chunk.start:chunk.stop], dtype=np.int64)
        return self._write_new(chunk, token_ids, (), lambda path: int(write_kvz(
            path, replay.meta_layers(), num_layers=replay.num_layers, policy=replay,
            model=self.model, tokenizer_fingerprint=self.tokenizer_fingerprint, token_ids=ids,
            zstd=self.zstd, entropy=self.entropy, store_chunk=chunk.place,
            lossy_sources=self.lossy_sources)["file_bytes"]))

    def _write_new(self, chunk: Chunk, token_ids: Sequence[int], lossy_sources: Sequence[str],
                   encode: Callable[[str], int]) -> int:
        """Publish ``encode(path)``'s file under the chunk's name unless a file is there
        already; the file's size, or 0 if one was kept. Local: a temp file in the pinned
        directory linked to the chunk's name (replacing a symlink, never writing through it);
        S3: one conditional PUT of the whole object. A file found there is judged (and
        replaced if stored lossy or damaged, :meth:`_free_place`) only then: a new chunk costs no
        read."""
        name = self._name(chunk)
        size = self.backend.write_new(name, encode)
        if size:
            return size
        free, judged = self._free_place(chunk, token_ids, lossy_sources)
        if not free:
            return 0
        size = (self.backend.write_new(name, encode) if judged is None
                else self._replace_lossy(chunk, judged, encode))
        self.replaced += size > 0
        return size

    def _check_writable(self) -> None:
        if not self.writable:
            raise PermissionError(f"the store at {self.root} is read-only here (kv_consumer)")

    # -- housekeeping -----------------------------------------------------------------------------
    def size_bytes(self) -> int:
        """Bytes of this model's chunk files, plus temp files (writes in progress, and crash
        leftovers until :meth:`collect_garbage` or the next write in their directory)."""
        return sum(e.size for e in self.backend.walk(self.model_dir)
                   if e.regular and e.name.endswith((".kvz", TEMP_SUFFIX)))

    def collect_garbage(self) -> tuple[int, int]:
        """Remove the temp files that killed writers left in this model's directories;
        (files, bytes) removed. Only for a store that may write."""
        if not self.writable:
            return 0, 0
        files, freed = self.backend.collect_garbage(self.model_dir)
        if files:
            log.info("kvtool store: removed %d stale temp files (%d bytes) under %s",
                     files, freed, self.dir)
        return files, freed
