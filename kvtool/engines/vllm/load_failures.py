"""What a failed load leaves wrong in vLLM's paged cache, and when it is right again.

A load that fails (a damaged chunk, a store that stops answering) reports its blocks to vLLM,
which rolls the request back to the first of them and recomputes from there
(``kv_load_failure_policy="recompute"``). Until then those blocks hold nothing valid, and so
does everything computed over them:

- the failing request's later chunks, computed in the same step and (under async scheduling,
  where vLLM plans step N+1 before it hears of step N's failure) in the next one;
- another request's, where it reads the same blocks (vLLM's prefix cache shares them).

Nothing computed over a failed block may reach the store under its (right) key. The worker
half withholds those saves (:class:`WithheldSaves`) until the scheduler half, which hears of
the failure through ``update_connector_output``, says the request is recomputed from a point
before the blocks (:func:`after_failure`); the scheduler then plans its chunks, and its
capture, again. A request that vLLM did not roll back goes on from wrong K/V: nothing of it
is stored.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtool.engines.vllm.common import ReqState, log


def mark_failed(reqs: dict[str, ReqState], invalid_block_ids: Iterable[int]) -> None:
    """Scheduler side: flag every request that holds a block whose load failed."""
    invalid = set(invalid_block_ids)
    if not invalid:
        return
    for req in reqs.values():
        if not invalid.isdisjoint(req.block_ids):
            req.load_failed = True


def after_failure(req_id: str, req: ReqState, computed: int, chunk_tokens: int) -> bool:
    """Scheduler side, on the first step planned after ``req``'s load failed: true when vLLM
    recomputes it from ``computed`` (rolled back), and its saves and capture from there on
    are planned again; false when it goes on from K/V computed over the failed blocks, and
    nothing more of it is saved or captured."""
    req.load_failed = False
    if computed >= req.planned:
        log.warning("kvtool: request %s read blocks whose load failed and vLLM did not "
                    "recompute it; none of its prompt is stored", req_id)
        req.save = req.capture = False
        return False
    first = computed // chunk_tokens  # the chunk that holds the first recomputed token
    req.next_chunk = min(req.next_chunk, first)
    req.stored = min(req.stored, first)
    req.from_file = min(req.from_file, computed)  # tokens from here on are computed
    req.captured = req.captured and computed >= len(req.prompt)
    return True


class WithheldSaves:
    """Worker side: the requests whose saves are withheld, and the blocks that make them so."""

    def __init__(self) -> None:
        self._reqs: set[str] = set()
        self._blocks: dict[str, set[int]] = {}  # a failed load's blocks, by request

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __bool__(self) -> bool:
        return bool(self._reqs or self._blocks)

    def load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        self._reqs.add(req_id)
        self._blocks.setdefault(req_id, set()).update(block_ids)

    def recomputed(self, req_ids: Iterable[str]) -> None:
        """The scheduler rolled these requests back before their failed blocks."""
        for req_id in req_ids:
            self._reqs.discard(req_id)
            self._blocks.pop(req_id, None)

    def finished(self, req_ids: Iterable[str]) -> None:
        self.recomputed(req_ids)  # their blocks are freed; request ids are not reused

    def withheld(self, req_id: str, block_ids: Iterable[int]) -> bool:
        """Whether a save of ``req_id`` (holding ``block_ids``) is withheld: its own load
        failed, or it reads another request's failed blocks (then withheld from now on)."""
        if req_id not in self._reqs and self._blocks:
            held = set(block_ids)
            if any(owner != req_id and not held.isdisjoint(bad)
                   for owner, bad in self._blocks.items()):
                self._reqs.add(req_id)
        return req_id in self._reqs
