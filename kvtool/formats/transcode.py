"""Re-encode a .kvz file with another codec policy (``kvtool compress`` / ``decompress``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from kvtool.codecs import Codec
from kvtool.formats.reader import open_kvz
from kvtool.formats.writer import write_kvz
from kvtool.policy import CodecPolicy


def transcode(src: str | os.PathLike, dst: str | os.PathLike,
              policy: CodecPolicy | str | dict | Codec, zstd: int | bool = False,
              progress: bool = False, *, dtype: str | None = None,
              verify: bool = True, entropy: bool = False) -> dict[str, Any]:
    """Decode every layer of ``src`` and write it to ``dst`` encoded with ``policy``.

    ``policy`` may also be a codec (id, spec or config) used for keys and values alike;
    ``dtype`` converts the decoded arrays first (e.g. ``"float32"`` for ``decompress``);
    ``entropy`` rANS-codes the tensors (as :func:`~kvtool.formats.save`).
    Model identity, tokenizer fingerprint, token ids and layer_info are carried over, and so
    is every lossy step the K/V went through (:meth:`~kvtool.formats.KvzFile.lossy_sources`):
    a lossy file decoded to ``raw`` says it is not exact.
    ``src`` and ``dst`` may be the same path (the replacement is atomic).
    """
    if not isinstance(policy, CodecPolicy):
        policy = CodecPolicy.from_options(codec=policy)
    with open_kvz(src, verify=verify) as f:
        if policy.auto_sinks:  # counted in a first pass, a layer at a time
            policy = policy.resolve(f.layer(i, dtype) for i in range(f.num_layers))
        layers = (f.layer(i, dtype) for i in range(f.num_layers))
        return write_kvz(dst, layers, num_layers=f.num_layers, policy=policy, model=f.model,
                         tokenizer_fingerprint=f.tokenizer_fingerprint, token_ids=f.token_ids,
                         layer_info=f.layer_info, zstd=zstd, entropy=entropy,
                         progress=progress, lossy_sources=f.lossy_sources(dtype))


def refuse_requantizing(src: str | os.PathLike, policy: CodecPolicy, doing: str,
                        sources: Iterable[str] | None = None) -> None:
    """Refuse to encode ``src``'s decoded values with a lossy ``policy`` when ``src`` was
    quantized already (by its codecs, or before it was decoded to raw): the second
    quantization's error adds to the first, unseen (the commands that do it take ``--force``).
    ``doing`` names what would, as in "compressing it again"; ``sources``: ``src``'s lossy
    sources (:meth:`~kvtool.formats.KvzFile.lossy_sources`), where it is not a .kvz file.
    A cast alone (``raw`` of any dtype, in ``src`` or in ``policy``) is no quantization."""
    from kvtool.cache import is_cast
    from kvtool.errors import KvtoolError

    if sources is None:
        with open_kvz(src, verify=False) as f:
            sources = f.lossy_sources()
    lossy = sorted(c for c in sources if not is_cast(c))
    if lossy and any(c.codec_id != "raw" for c in policy.codecs()):
        raise KvtoolError(f"{src} is already lossy ({', '.join(lossy)}): {doing} quantizes "
                          "decoded values a second time; use the raw capture instead, or "
                          "pass --force")
