"""The checks a prefix-store chunk file passes before it is trusted: it belongs to this model
and holds exactly its chunk's token ids after its prefix (:func:`check_header`), it can serve
a prefix (:func:`check_file`), and whether its K/V are exact (:func:`exact_dtype`). See
:mod:`~kvtool.engines.vllm.store` for the rules they serve."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.engines.vllm.common import check_cache, refuse_unservable
from kvtool.engines.vllm.store_admin import misplaced
from kvtool.identity import identity_dtype, same_model

if TYPE_CHECKING:
    from kvtool.engines.vllm.store import Chunk


def check_header(path: str, model: dict[str, Any], chunk: Chunk, token_ids: Sequence[int]
                 ) -> str | None:
    """Raise unless the (pinned) file at ``path`` can serve ``chunk`` of the prompt
    ``token_ids`` to ``model``; else the dtype its K/V are exact in (:func:`exact_dtype`)."""
    from kvtool.formats import open_kvz

    with open_kvz(path) as f:
        if not same_model(f.model, model):
            raise ValueError("it belongs to another model")
        if f.num_tokens != chunk.stop - chunk.start:
            raise ValueError(f"it holds {f.num_tokens} tokens, not {chunk.stop - chunk.start}")
        ids = f.token_ids
        want = np.asarray(token_ids[chunk.start:chunk.stop], dtype=np.int64)
        if ids is None or not np.array_equal(ids, want):
            raise ValueError("it holds other token ids")
        problem = misplaced(f.store_chunk, chunk.key, chunk.start)
        if problem:  # same ids after another prefix: other K/V
            raise ValueError(problem)
        refuse_unservable(f)  # its partial windows would land in the wrong slots
        return exact_dtype(f)


def check_file(f: Any, model: dict[str, Any], tokens: int, sliding_ok: bool = False) -> None:
    """Raise ValueError unless an open .kvz file (:class:`~kvtool.formats.KvzFile`) can serve
    its first ``tokens`` to ``model``: what ``load(tokens=...)`` and then
    :func:`~kvtool.engines.vllm.common.check_cache` refuse, without decoding anything
    (``sliding_ok``: a served file's sliding-window layers holding every token)."""
    if not 0 <= tokens <= f.num_tokens:
        raise ValueError(f"prefix of {tokens} tokens from a file of {f.num_tokens}")
    check_cache(SimpleNamespace(model=f.model, num_layers=f.num_layers, num_tokens=tokens,
                                token_ids=f.token_ids, layer_info=f.layer_info,
                                header=f.header), model, tokens, sliding_ok)


def exact_dtype(f: Any) -> str | None:
    """The dtype an open .kvz file's K/V are exactly as computed in: the model's (else the
    file's) when nothing lossy came before or in it
    (:meth:`~kvtool.formats.KvzFile.lossy_sources`) and every ``raw`` segment is stored at its
    role's width; None otherwise. (A widened segment may hold an fp8 server's rounded K/V:
    chunks written before ``lossy_sources`` said so.)"""
    from kvtool.formats import constants as C

    if f.lossy_sources():
        return None
    for layer in f.header[C.H_LAYERS]:
        for role in C.ROLES:
            if any(seg["codec"].get("dtype") not in (None, layer[role]["dtype"])
                   for seg in layer[role]["segments"]):
                return None
    return identity_dtype(f.model) or f.header[C.H_DTYPE]


def refusal_reason(error: BaseException, path: str) -> str:
    """Why a chunk was refused, in words (a ValueError is a content mismatch)."""
    from kvtool.errors import KvtoolError

    text = str(error).replace(f"{path}: ", "")
    return text if not isinstance(error, KvtoolError) else f"it is damaged ({text})"
