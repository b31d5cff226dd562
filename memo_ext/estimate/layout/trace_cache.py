"""The trace cache: traces on disk keyed by the tracer's request (memo_ext.trace.request)
and the tracer's sources (memo_ext.estimate.trace_key), traced on a miss by a pool of tracer
workers."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from memo_ext.estimate.memory import EstimateError
from memo_ext.estimate.trace_key import tracer_digest
from memo_ext.trace import Trace, read_trace
from memo_ext.trace.request import TraceRequest

class TraceCache:
    """Traces on disk, keyed by the request and the tracer's sources, so a repeated estimate or
    search costs no tracing. ``directory`` None: no cache. Misses are traced by a
    :class:`memo_ext.estimate.tracer.TracerPool` of ``workers`` long-lived tracer workers
    (started on the first miss; :meth:`close` ends them)."""

    def __init__(self, directory: Optional[Path], workers: int = 2) -> None:
        self.directory = None if directory is None else Path(directory)
        self.workers = workers
        self._pool = None
        self._pool_lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._prefetcher: Optional[ThreadPoolExecutor] = None
        #: prefetched traces (their futures) until a trace() takes them
        self._prefetched: dict[str, Future] = {}
        # Every project module the tracer imports, wherever installed, and the versions of
        # Python, torch and megatron-core (memo_ext.estimate.trace_key).
        self._sources_digest = tracer_digest()

    def __enter__(self) -> "TraceCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the tracer processes (a later miss starts them again). Background traces under
        way finish first; those not yet started are dropped."""
        with self._pool_lock:
            prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            # The traces under way finish first, on the pool below: a prefetch still running
            # after the pool is taken would start a new one that nobody closes.
            prefetcher.shutdown(wait=True, cancel_futures=True)
        with self._pool_lock:
            pool, self._pool = self._pool, None
            dropped = [(key, future) for key, future in self._prefetched.items()
                       if not future.done()]
            self._prefetched.clear()
            for key, _ in dropped:
                del self._pending[key]
        for _, future in dropped:  # nobody waits on them any more
            future.set_exception(EstimateError("the trace cache was closed before this trace"))
        if pool is not None:
            pool.close()

    def prefetch(self, requests: list[TraceRequest]) -> None:
        """Start tracing ``requests`` now, in the background, so that the workers are busy
        while the caller asks for them one at a time (a layout's few-layer traces, its
        persistent state and its check are independent; asked for in turn they keep one
        worker of the pool busy and the others idle). The next :meth:`trace` of each takes its
        result, waiting for it if need be, error included; requests already being traced are
        not traced again."""
        with self._pool_lock:
            if self._prefetcher is None:
                # As many as the pool can trace and as many waiting for a worker: more threads
                # would only queue longer.
                self._prefetcher = ThreadPoolExecutor(max_workers=2 * self.workers,
                                                      thread_name_prefix="trace-prefetch")
            prefetcher = self._prefetcher
            started = []
            for request in requests:
                key = request.key()
                if key in self._pending or key in self._prefetched:
                    continue
                # Claimed here, not in the background thread: a trace() asked before that
                # thread starts waits for it instead of tracing the same request too.
                future = self._pending[key] = self._prefetched[key] = Future()
                started.append((future, request, key))
        for future, request, key in started:
            prefetcher.submit(self._fill, future, request, key)

    def _fill(self, future: Future, request: TraceRequest, key: str) -> None:
        """Trace ``request`` into ``future`` (which trace() and prefetch() claimed)."""
        try:
            future.set_result(self._trace_once(request, key))
        except BaseException as exc:  # noqa: BLE001  (raised by whoever waits on it)
            future.set_exception(exc)
        finally:
            with self._pool_lock:
                if self._pending.get(key) is future:
                    del self._pending[key]

    def _traced(self, request: TraceRequest, output: Path) -> Trace:
        from memo_ext.estimate.tracer import TracerPool

        with self._pool_lock:
            if self._pool is None:
                self._pool = TracerPool(self.workers)
            pool = self._pool
        return pool.trace(request, output)

    def trace(self, request: TraceRequest) -> Trace:
        """The trace of ``request``, from the cache or traced now; a request made while the
        same one is being traced waits for it rather than tracing it again (a search's layouts
        share traces, e.g. the persistent state of every policy), and a prefetched one
        (:meth:`prefetch`) is taken from there."""
        key = request.key()
        with self._pool_lock:
            pending = self._prefetched.pop(key, None) or self._pending.get(key)
            mine = pending is None
            if mine:
                pending = self._pending[key] = Future()
        if mine:
            self._fill(pending, request, key)
        return pending.result()

    def _trace_once(self, request: TraceRequest, request_key: str) -> Trace:
        if self.directory is None:
            with tempfile.TemporaryDirectory(prefix="memo_estimate_") as workdir:
                return self._traced(request, Path(workdir) / "trace.jsonl.gz")
        key = hashlib.sha256(json.dumps([request_key, self._sources_digest]).encode()
                             ).hexdigest()
        path = self.directory / f"{key[:32]}.jsonl.gz"
        if path.exists():
            try:
                return read_trace(path)
            except Exception:  # a damaged cache entry is traced again, never trusted
                path.unlink(missing_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.directory) as workdir:  # parallel-safe
            partial = Path(workdir) / "trace.jsonl.gz"
            trace = self._traced(request, partial)
            os.replace(partial, path)
        return trace


def default_cache_dir() -> Path:
    """$MEMO_ESTIMATE_CACHE, else ~/.cache/megatron-memo/traces."""
    configured = os.environ.get("MEMO_ESTIMATE_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-memo" \
        / "traces"
