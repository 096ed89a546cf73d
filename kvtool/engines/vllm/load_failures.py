"""What a failed load leaves wrong in vLLM's paged cache, and who may read it.

A load that fails (a damaged chunk, a store that stops answering) reports its blocks to vLLM,
which rolls the request back to the first of them and recomputes from there
(``kv_load_failure_policy="recompute"``). Until they are written again those blocks hold
nothing valid, and neither does anything computed over them:

- the failing request's later blocks, computed in the same step and (under async scheduling,
  where vLLM plans step N+1 before it hears of step N's failure) in the next one;
- another request's, where it reads them: vLLM keeps the failed blocks in its prefix cache.

Nothing computed over a failed block may reach the store under its (right) key, nor a capture.
The scheduler half hears of a failure through ``update_connector_output``
(:meth:`PoisonedBlocks.heard`) and from then on tracks the blocks it left wrong: a block is
clean again once a request writes it from its first token, and a request that reads a wrong
block (its computed tokens reach into one) is *tainted*: nothing more of it is saved, and the
blocks it computes are wrong too. A request that vLLM rolled back to its first failed block is
not: its chunks from there on, and its capture, are planned again (:func:`after_failure`).

The worker half covers the steps planned before the scheduler heard: it withholds the saves of
a request whose load failed, or that holds one of the failed blocks, until a step's metadata
says the scheduler has heard of that failure (:class:`WithheldSaves`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtool.engines.vllm.common import ReqState, log

#: steps a finished or preempted request's blocks are remembered for failure reports still
#: on their way (async scheduling has two steps in flight)
GONE_STEPS = 4


class PoisonedBlocks:
    """Scheduler side: the blocks that hold K/V computed from a failed load."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: set[int] = set()
        self.steps = 0  # steps planned: each step's metadata carries its number
        self._gone: list[tuple[int, list[int], int]] = []  # (step, blocks, planned)

    def heard(self, reqs: dict[str, ReqState], invalid_block_ids: Iterable[int],
              steps: Iterable[int] = ()) -> None:
        """Failed loads of the steps numbered ``steps`` (none: unknown, any in flight): the
        blocks are wrong, and so are those computed over them: every request holding one is
        flagged (``load_failed``), and its blocks from there to what it was planned to
        compute are wrong too; so are those of a request that held one then and has finished
        or been preempted since (vLLM's prefix cache keeps its blocks)."""
        invalid = set(invalid_block_ids)
        if not invalid:
            return
        self.blocks |= invalid
        for req in reqs.values():
            first = _first_in(req.block_ids, invalid)
            if first is not None:
                req.load_failed = True
                self._spread(req.block_ids, first, req.planned)
        since = min(steps, default=self.steps - GONE_STEPS)
        for gone, blocks, planned in self._gone:
            first = _first_in(blocks, invalid)
            if gone >= since and first is not None:
                self._spread(blocks, first, planned)

    def gone(self, req: ReqState) -> None:
        """``req`` finished or was preempted after the last step planned: its blocks go back
        to vLLM, but a failure of a step in flight may name them."""
        if req.block_ids:
            self._gone.append((self.steps, list(req.block_ids), req.planned))

    def written(self, req: ReqState, start: int, stop: int) -> None:
        """``req`` writes tokens ``[start, stop)`` this step: the blocks it completes are clean
        again (their first tokens it wrote itself, or read clean), unless ``req`` computes
        over wrong K/V. A block it leaves part-written keeps what it was: vLLM's prefix cache
        may hold it whole."""
        blocks = req.block_ids[start // self.block_size:stop // self.block_size]
        if req.tainted:
            self.blocks.update(blocks)
        else:
            self.blocks.difference_update(blocks)

    def read(self, req_id: str, req: ReqState, computed: int, after: int) -> None:
        """Taint ``req`` if the whole blocks of its first ``computed`` tokens include a wrong
        one (a block it is part-way through writing is its own)."""
        first = _first_in(req.block_ids[:computed // self.block_size], self.blocks)
        if first is not None:
            taint(req_id, req)
            self._spread(req.block_ids, first, max(after, req.planned))

    def step(self, steps: Sequence[tuple[str, ReqState, int, int, int]],
             chunk_tokens: int) -> None:
        """Before a step's saves are planned. ``steps``: each scheduled request's id, state,
        first token written this step (a load's included), tokens computed before it, and
        after it. A request whose load failed is planned again or tainted
        (:func:`after_failure`), then its writes count; one that reads a wrong block is
        tainted."""
        self.steps += 1
        self._gone = [g for g in self._gone if g[0] > self.steps - GONE_STEPS]
        for req_id, req, _, computed, _ in steps:
            if req.load_failed:
                after_failure(req_id, req, computed, chunk_tokens)
        for _, req, start, _, after in steps:
            if self.blocks or req.tainted:
                self.written(req, start, after)
        for req_id, req, _, computed, after in steps:
            if self.blocks and not req.tainted:
                self.read(req_id, req, computed, after)
            req.planned = after

    def _spread(self, blocks: list[int], first: int, stop: int) -> None:
        self.blocks.update(blocks[first:max(first + 1, -(-stop // self.block_size))])


def _first_in(blocks: list[int], among: set[int]) -> int | None:
    """The index of the first of ``blocks`` in ``among``, or None."""
    return next((i for i, b in enumerate(blocks) if b in among), None)


def taint(req_id: str, req: ReqState) -> None:
    """``req`` goes on from K/V computed over a failed load: nothing more of it is stored."""
    if not req.tainted and (req.save or req.capture):
        log.warning("kvtool: request %s reads K/V computed from a failed load that vLLM did not "
                    "recompute for it; none of its prompt is stored", req_id)
    req.tainted = True
    req.save = req.capture = False


def after_failure(req_id: str, req: ReqState, computed: int, chunk_tokens: int) -> None:
    """On the first step planned after ``req`` held a failed block: if vLLM rolled it back,
    its chunks from ``computed`` on and its capture are planned again (whether what it keeps
    is clean is :meth:`PoisonedBlocks.read`'s to say); if not, it goes on from wrong K/V and
    is tainted."""
    req.load_failed = False
    if computed >= req.planned:
        taint(req_id, req)
        return
    first = computed // chunk_tokens  # the chunk that holds the first recomputed token
    req.next_chunk = min(req.next_chunk, first)
    req.stored = min(req.stored, first)
    req.from_file = min(req.from_file, computed)  # tokens from here on are computed
    req.captured = req.captured and computed >= len(req.prompt)


class WithheldSaves:
    """Worker side: saves withheld until the scheduler has heard of the failure behind them.

    Each entry is one step's failed blocks and the requests withheld for them: the failing
    ones, and any whose save holds one of the blocks. It is dropped once a step's metadata
    lists the blocks among those the scheduler heard of (``heard_failed``): saves planned from
    then on are planned knowing of it."""

    def __init__(self) -> None:
        self._entries: list[tuple[set[int], set[str]]] = []
        self._step: tuple[set[int], set[str]] = (set(), set())

    def __bool__(self) -> bool:
        return bool(self._entries or self._step[0])

    def load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        self._step[0].update(block_ids)
        self._step[1].add(req_id)

    def reported(self) -> None:
        """This step's failed blocks went to vLLM (``get_block_ids_with_load_errors``)."""
        if self._step[0]:
            self._entries.append(self._step)
        self._step = (set(), set())

    def heard(self, block_ids: Iterable[int]) -> None:
        """The scheduler heard of these failed blocks before it planned this step."""
        heard = set(block_ids)
        if heard:
            self._entries = [e for e in self._entries if not e[0] <= heard]

    def withheld(self, req_id: str, block_ids: Sequence[int]) -> bool:
        withheld = False
        for blocks, reqs in (*self._entries, self._step):
            if req_id in reqs or not blocks.isdisjoint(block_ids):
                reqs.add(req_id)
                withheld = True
        return withheld
