"""A pool of long-lived tracer workers, so that many traces pay the tracer's start-up once.

Importing torch and megatron takes about 3.5 s, while the trace itself of a small model (7B
shape cut to 5 layers, TP=4 CP=2, 128K tokens) takes about 1.5 s: start-up is most of the cost of
the small traces a layout search runs by the dozen. :class:`TracerPool` keeps up to ``workers``
workers of this interpreter running the tracer engine's loop (``python -m TRACE_MODULE --serve``,
megatron/training/tracing.py: one JSON request per line on stdin, a typed
:class:`~memo_ext.planner.trace.request.TraceRequest` as a dict, one JSON answer per line on
stdout) and hands each trace to an idle one. Each worker builds its own fake world and sees no
GPU (tracer_environment), and memo_ext never imports the trainer: the workers do.

Measured on a 2-core CPU machine, 4 sequential traces of that 5-layer model at 128K tokens: one
subprocess per trace 21.1 s (5.3 s each); the pool with one worker 8.2 s (4.3 s for the first,
which starts the server, then 1.3 s each), the same traces. A server's memory grows by under
1 MB a trace (390 -> 401 MB resident over 12 traces).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Optional

from memo_ext.estimate.memory import TRACE_MODULE, EstimateError, tracer_environment
from memo_ext.planner.trace import Trace, read_trace
from memo_ext.planner.trace.request import TraceRequest

#: Seconds a server gets to exit after its stdin closes before it is killed.
CLOSE_TIMEOUT_S = 10.0
#: Lines of a server's stderr kept for the message when it dies.
STDERR_LINES = 50


class _Server:
    """One tracer in server mode; used by one thread at a time (the pool sees to it)."""

    def __init__(self, workdir: str) -> None:
        # cwd=workdir: ``-m`` puts the working directory first on sys.path, and workdir holds
        # nothing that could shadow the installed modules.
        self.process = subprocess.Popen(
            [sys.executable, "-m", TRACE_MODULE, "--serve"], cwd=workdir, env=tracer_environment(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, encoding="utf-8", errors="replace", bufsize=1)
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_LINES)
        # Drained all the time: a full stderr pipe would block the server mid-trace.
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _drain_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip("\n"))

    def request(self, request: TraceRequest, output: Path) -> Optional[dict]:
        """The server's answer to one trace request, or None when it has died."""
        try:
            self.process.stdin.write(json.dumps({"request": request.to_dict(),
                                                 "output": str(output)}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def death_message(self) -> str:
        """The last line the dead server wrote to stderr, with its exit status."""
        try:
            status = self.process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # stdout closed but still running: end it
            self.process.kill()
            status = self.process.wait()
        self._drain.join(timeout=CLOSE_TIMEOUT_S)  # the rest of its stderr
        lines = [line for line in self.stderr_tail if line.strip()]
        last = lines[-1].strip() if lines else "(no output)"
        return f"{last} (tracer process exited with status {status})"

    def close(self, kill: bool = False) -> None:
        """End the server: EOF on its stdin, then a kill if it does not exit in time (at once
        with ``kill``: it may be in the middle of a trace nobody waits for)."""
        if kill:
            self.process.kill()
        try:
            self.process.stdin.close()
        except OSError:  # already dead: the pipe is broken
            pass
        try:
            self.process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._drain.join(timeout=CLOSE_TIMEOUT_S)
        self.process.stdout.close()
        self.process.stderr.close()


class TracerPool:
    """Up to ``workers`` tracer servers, started when first needed; thread-safe. A trace goes
    to an idle server, or waits for one. Use as a context manager, or call :meth:`close`."""

    def __init__(self, workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"TracerPool needs at least one worker, not {workers}")
        self.workers = workers
        self._servers: set[_Server] = set()  # started and not yet ended, idle or busy
        self._idle: list[_Server] = []
        self._closed = False
        self._changed = threading.Condition()
        self._workdir = tempfile.TemporaryDirectory(prefix="memo_tracer_")

    def __enter__(self) -> "TracerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The process ids of the servers now running, idle or busy."""
        with self._changed:
            return sorted(server.process.pid for server in self._servers)

    def trace(self, request: TraceRequest, output: Path) -> Trace:
        """The tracer's trace of ``request``, written to ``output`` and read back. Raises
        EstimateError when it fails."""
        output = Path(output).resolve()  # the server runs elsewhere
        seq = request.seq_length
        server = self._acquire()
        try:
            reply = server.request(request, output)
        except BaseException:  # interrupted mid-request: its answer would confuse the next
            self._discard(server, kill=True)
            raise
        if reply is None:
            message = server.death_message()
            self._discard(server)  # the next trace starts a fresh one
            raise EstimateError(f"tracing at {seq} tokens failed: {message}")
        self._release(server)
        if not reply.get("ok"):
            raise EstimateError(f"tracing at {seq} tokens failed: {reply.get('error')}")
        return read_trace(output)

    def close(self) -> None:
        """End the idle servers now; a busy one ends when its trace returns."""
        with self._changed:
            self._closed = True
            idle, self._idle = self._idle, []
            self._servers.difference_update(idle)
            self._changed.notify_all()  # waiting traces fail rather than wait forever
            cleanup = not self._servers
        for server in idle:
            server.close()
        if cleanup:  # else the last busy server's release does it
            self._workdir.cleanup()

    def _acquire(self) -> _Server:
        with self._changed:
            while True:
                if self._closed:
                    raise EstimateError("the tracer pool is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._servers) < self.workers:
                    server = _Server(self._workdir.name)  # Popen returns at once
                    self._servers.add(server)
                    return server
                self._changed.wait()

    def _release(self, server: _Server) -> None:
        with self._changed:
            if not self._closed:
                self._idle.append(server)
                self._changed.notify()
                return
        self._discard(server)

    def _discard(self, server: _Server, kill: bool = False) -> None:
        server.close(kill)
        with self._changed:
            self._servers.discard(server)
            self._changed.notify()
            cleanup = self._closed and not self._servers
        if cleanup:
            self._workdir.cleanup()
