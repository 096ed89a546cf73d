"""Store calls with a deadline, so that a slow or dead store never holds vLLM's engine.

The connector's scheduler half looks prompts up in the store on the scheduler's path, and its
worker half reads chunks before the forward pass: a frozen S3 endpoint or a hung network
filesystem would stall every request. :class:`StoreGuard` runs those calls on a few threads of
its own and waits at most ``timeout`` seconds for each:

* a lookup that misses its deadline counts as a miss, or as the shorter prefix it had
  validated by then (:meth:`StoreGuard.lookup`); a chunk read that misses it fails its load,
  so vLLM recomputes from there (:meth:`StoreGuard.call`);
* a timeout, or an error that says the endpoint is down, *opens* the guard for ``backoff``
  seconds: calls in that time fail at once (:class:`StoreUnavailable`) instead of each paying
  the deadline. The next call after it is a probe: when it succeeds, the store is back (said
  in the log) and the backoff resets; when it fails, the backoff doubles, up to
  :data:`MAX_BACKOFF`;
* a call abandoned at its deadline keeps its thread until the store's own timeouts end it
  (S3: connect/read timeouts and a bounded retry budget); while every thread is taken,
  calls fail at once rather than queue behind them.

Every failure is counted by kind (``lookup_timeout``, ``load_timeout``, ``unavailable``, the
``kvtool_store_failures_total{kind}`` metric) and logged once per outage. Nothing here
imports vLLM.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvtool.engines.vllm.common import count, log

T = TypeVar("T")
DEFAULT_TIMEOUT = 1.0  # seconds: a lookup, or one chunk's read, past this is a miss
DEFAULT_BACKOFF = 2.0  # seconds the store is skipped after a failure (doubling while it lasts)
MAX_BACKOFF = 30.0
THREADS = 4
# errnos that say the store itself is unreachable (not a damaged or missing file)
DOWN_ERRNOS = frozenset({errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET,
                         errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ESTALE})


class StoreUnavailable(OSError):
    """The store did not answer in time, or is skipped while it recovers."""


class StoreGuard:
    """Deadlines and a circuit breaker around one store's calls (see the module docstring)."""

    def __init__(self, where: str, timeout: float = DEFAULT_TIMEOUT,
                 backoff: float = DEFAULT_BACKOFF, threads: int = THREADS):
        if not timeout > 0:
            raise ValueError(f"store_timeout must be a positive number of seconds, got {timeout}")
        self.where, self.timeout, self.base_backoff = where, float(timeout), float(backoff)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtool-store")
        self._threads = threads
        self._busy = 0
        self._lock = threading.Lock()
        self._closed_until = 0.0  # skipped until this monotonic time
        self._backoff = self.base_backoff
        self._down_since: float | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def is_down(self) -> bool:
        """Whether the store is being skipped now (a recent timeout or endpoint failure)."""
        return time.monotonic() < self._closed_until

    def _admit(self) -> None:
        with self._lock:
            if time.monotonic() < self._closed_until:
                count("store_unavailable")
                raise StoreUnavailable(errno.EAGAIN, f"{self.where}: skipped while it recovers")
            if self._busy >= self._threads:
                count("store_unavailable")
                raise StoreUnavailable(errno.EBUSY, f"{self.where}: every store thread is "
                                       "still waiting on earlier calls")
            self._busy += 1

    def _done(self, _future: Any = None) -> None:
        with self._lock:
            self._busy -= 1

    def _failed(self, kind: str, reason: str) -> None:
        """Open the breaker: skip the store for the current backoff, and say so once."""
        now = time.monotonic()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = now
            self._closed_until = now + self._backoff
            backoff = self._backoff
            self._backoff = min(MAX_BACKOFF, self._backoff * 2)
        count(kind)
        (log.warning if first else log.info)(
            "kvtool store: %s %s; prefixes are computed instead, store retried in %.0f s",
            self.where, reason, backoff)

    def _succeeded(self) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
            self._backoff = self.base_backoff
        if since is not None:
            log.warning("kvtool store: %s answers again after %.1f s", self.where,
                        time.monotonic() - since)

    def report(self, error: BaseException) -> None:
        """An error met outside :meth:`call` (the saver's writes): when it says the store is
        unusable, skip the store for a while, so that saves are dropped, not queued."""
        if is_down(error):
            self._failed("store_unavailable", f"is unusable ({error})")

    # -- calls -------------------------------------------------------------------------------
    def call(self, kind: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a store thread, waiting at most ``timeout`` seconds.
        :class:`StoreUnavailable` on a timeout (counted as ``<kind>_timeout``) or while the
        store is skipped; ``fn``'s own exceptions pass through (an unreachable endpoint's
        also opens the breaker)."""
        self._admit()
        future = self._pool.submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        try:
            result = future.result(self.timeout)
        except FutureTimeout:
            self._failed(f"{kind}_timeouts", f"did not answer a {kind} within "
                         f"{self.timeout:g} s")
            raise StoreUnavailable(errno.ETIMEDOUT, f"{self.where}: no answer to a {kind} "
                                   f"within {self.timeout:g} s") from None
        except OSError as e:
            if is_down(e):
                self._failed("store_unavailable", f"is unreachable ({e.strerror or e})")
            raise
        self._succeeded()
        return result

    def lookup(self, fn: Callable[..., list], *args: Any) -> list:
        """``fn(*args, found=list, deadline=t)``, a lookup that appends each chunk it
        validates to ``found`` and stops at ``deadline``; past the deadline (or while the
        store is skipped) the chunks validated so far: a shorter prefix is still a hit."""
        found: list = []
        deadline = time.monotonic() + self.timeout
        try:
            return self.call("lookup", fn, *args, found=found, deadline=deadline)
        except StoreUnavailable:
            return list(found)
        except Exception as e:  # never into vLLM's scheduler: a lookup that fails is a miss
            if not is_down(e):  # (an outage was logged when it opened the breaker)
                log.warning("kvtool store: lookup in %s failed (%s: %s); computing the prefix",
                            self.where, type(e).__name__, str(e)[:200])
            return list(found)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def is_down(error: BaseException) -> bool:
    """Whether an error says the store is unusable (unreachable, or its bucket or credentials
    are wrong) rather than one file being bad."""
    if isinstance(error, (StoreUnavailable, TimeoutError, ConnectionError)) or (
            isinstance(error, OSError) and error.errno in DOWN_ERRNOS):
        return True
    s3 = sys.modules.get("kvtool.engines.vllm.store_s3")  # loaded by any S3 store
    return s3 is not None and isinstance(error, (s3.MissingBucketError, s3.CredentialsError))
