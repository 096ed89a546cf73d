"""The on-disk prefix store behind :class:`~kvtool.engines.vllm.connector.KvtoolConnector`.

A prompt is cut into chunks of ``chunk_tokens`` tokens (a multiple of vLLM's block size). Chunk
``i`` is keyed by a hash chain: ``h_0 = H(tag, model fingerprint, chunk_tokens)``,
``h_{i+1} = H(h_i, token ids of chunk i)``, so a key names the chunk *and every token before it*
for one model. Each chunk is a small .kvz file (written through :mod:`kvtool.formats`, any
codec policy) at ``<root>/<fingerprint[:16]>/<key[:2]>/<key>.kvz`` holding that chunk's K/V
and token ids. The longest stored prefix of a prompt is the longest run of chunk files that
exist from its start; two prompts that share a system prompt share its chunks.

A chunk file is trusted only after its header says it belongs to this model and holds exactly
the chunk's token ids (results are cached per file size and mtime). Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.cache import KVCache
from kvtool.engines.vllm.common import count, log
from kvtool.policy import CodecPolicy

HASH_TAG = b"kvtool-prefix-store-v1"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored (or storable) chunk: its key and token range in the sequence."""

    key: str
    start: int
    stop: int
    path: str


class PrefixStore:
    """Chunk files of one model under ``root``; see the module docstring."""

    def __init__(self, root: str | os.PathLike, model: dict[str, Any], chunk_tokens: int,
                 policy: CodecPolicy, *, zstd: int | bool = False,
                 tokenizer_fingerprint: str | None = None):
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.root = Path(root)
        self.model = dict(model)
        self.fingerprint = str(model["fingerprint"])
        self.chunk_tokens = int(chunk_tokens)
        self.policy = policy
        self.zstd = zstd
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.dir = self.root / self.fingerprint[:16]
        self._valid: dict[str, tuple[tuple[int, int], bool]] = {}

    # -- keys -------------------------------------------------------------------------------------
    def chunks(self, token_ids: Sequence[int], limit: int | None = None) -> list[Chunk]:
        """The full chunks of ``token_ids[:limit]``, in order, with their chain keys."""
        ids = np.asarray(token_ids, dtype="<i8").reshape(-1)
        n = len(ids) if limit is None else max(0, min(limit, len(ids)))
        h = hashlib.sha256(HASH_TAG + b"\0" + self.fingerprint.encode() + b"\0"
                           + str(self.chunk_tokens).encode()).digest()
        out = []
        for start in range(0, n - self.chunk_tokens + 1, self.chunk_tokens):
            stop = start + self.chunk_tokens
            h = hashlib.sha256(h + ids[start:stop].tobytes()).digest()
            key = h.hex()
            out.append(Chunk(key, start, stop, str(self.dir / key[:2] / f"{key}.kvz")))
        return out

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], limit: int | None = None) -> list[Chunk]:
        """The longest run of valid stored chunks from the start of ``token_ids[:limit]``."""
        found = []
        for chunk in self.chunks(token_ids, limit):
            if not self.is_valid(chunk, token_ids):
                break
            found.append(chunk)
        return found

    def exists(self, chunk: Chunk) -> bool:
        return os.path.exists(chunk.path)

    def is_valid(self, chunk: Chunk, token_ids: Sequence[int]) -> bool:
        """Whether ``chunk.path`` exists and its header matches this model and chunk."""
        try:
            st = os.stat(chunk.path)
        except OSError:
            return False
        stamp = (st.st_size, st.st_mtime_ns)
        cached = self._valid.get(chunk.path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        ok = self._check_header(chunk, token_ids)
        self._valid[chunk.path] = (stamp, ok)
        return ok

    def _check_header(self, chunk: Chunk, token_ids: Sequence[int]) -> bool:
        from kvtool.errors import KvtoolError
        from kvtool.formats import open_kvz

        try:
            with open_kvz(chunk.path) as f:
                problem = None
                if f.model.get("fingerprint") != self.fingerprint:
                    problem = "belongs to another model"
                elif f.num_tokens != chunk.stop - chunk.start:
                    problem = f"holds {f.num_tokens} tokens, not {chunk.stop - chunk.start}"
                else:
                    ids = f.token_ids
                    want = np.asarray(token_ids[chunk.start:chunk.stop], dtype=np.int64)
                    if ids is None or not np.array_equal(ids, want):
                        problem = "holds other token ids"
        except (KvtoolError, OSError, ValueError) as e:
            problem = f"is unreadable ({e})"
        if problem:
            count("invalid_files")
            log.warning("kvtool store: ignoring %s: it %s; the prefix will be recomputed",
                        chunk.path, problem)
            return False
        return True

    def forget(self, chunk: Chunk) -> None:
        """Drop a chunk found damaged while loading (removed, so it is written anew)."""
        self._valid.pop(chunk.path, None)
        try:
            os.unlink(chunk.path)
        except OSError:
            pass

    # -- read / write -----------------------------------------------------------------------------
    def read(self, chunk: Chunk) -> KVCache:
        """The chunk's decoded K/V (torch), every checksum verified."""
        from kvtool.formats import load

        return load(chunk.path, backend="torch")

    def write(self, chunk: Chunk, keys: list[Any], values: list[Any],
              token_ids: Sequence[int]) -> int:
        """Encode and write one chunk atomically; its file size. Existing chunks are kept."""
        from kvtool.formats import save

        if os.path.exists(chunk.path):
            return 0
        policy = dataclasses.replace(self.policy, recent_tokens=0,
                                     sink_tokens=self.policy.sink_tokens if chunk.start == 0
                                     else 0)
        cache = KVCache(keys, values, token_ids=np.asarray(token_ids[chunk.start:chunk.stop]),
                        model=self.model, tokenizer_fingerprint=self.tokenizer_fingerprint)
        os.makedirs(os.path.dirname(chunk.path), exist_ok=True)
        report = save(cache, chunk.path, policy, zstd=self.zstd)
        return int(report["file_bytes"])

    def size_bytes(self) -> int:
        """Bytes of every chunk file of this model."""
        return sum(p.stat().st_size for p in self.dir.rglob("*.kvz")) if self.dir.exists() else 0
