"""MPRanks: tensor-parallel ranks 1..N-1 as local processes driven over pipes ("mp" backend).

Each rank is a fresh interpreter (`python -m cover_vllm.executor.remote FD`) holding one end of
a private socket pair: no port, no `__main__` re-import (a user script needs no
`if __name__ == "__main__"` guard), no fork of a process that already runs torch threads.
Requests are pickled with the plain pickler (tensors by value) and sent with `send_bytes`;
replies are polled with a deadline while checking that the process is alive, so a dead rank is
noticed at once and a hung one after `timeout_s`. A rank exits when the driver's end closes
(the engine process is gone); `shutdown` asks, then terminates, then kills.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.executor.base import STEP_METHODS, RemoteRankError

_POLL_S = 0.05


class MPRanks:
    host = "127.0.0.1"

    def __init__(self) -> None:
        self._procs: list[Any] = []        # [N-1] multiprocessing.Process, rank order
        self._conns: list[Any] = []        # [N-1] driver ends of the pipes
        self.pids: list[int] = []

    def start(self, config: EngineConfig, world_size: int) -> None:
        env = dict(os.environ)     # the driver's import path, as multiprocessing's spawn does
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        for rank in range(1, world_size):
            parent, child = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "cover_vllm.executor.remote",
                                     str(child.fileno())], pass_fds=(child.fileno(),), env=env)
            child.close()
            conn = Connection(parent.detach())
            self._procs.append(proc)
            self._conns.append(conn)
            self.pids.append(proc.pid)
            conn.send_bytes(pickle.dumps((config, rank, world_size)))

    def _error(self, i: int, detail: str, died: bool = False) -> RemoteRankError:
        return RemoteRankError(i + 1, detail, died, self._procs[i].pid)

    def _died(self, i: int) -> RemoteRankError:
        try:
            code = self._procs[i].wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return self._error(i, f"its process exited (exit code {code})", died=True)

    def call(self, method: str, *args: Any) -> str:
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for i, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError as exc:          # BrokenPipeError: the rank is gone
                raise self._died(i) from exc
        return method

    def _recv(self, i: int, deadline: float) -> Any:
        conn, proc = self._conns[i], self._procs[i]
        while True:
            if conn.poll(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    raise self._died(i) from None
                if status == "error":
                    raise self._error(i, value)
                return value
            if not proc.poll() is None and not conn.poll(0):
                raise self._died(i)
            if time.monotonic() >= deadline:
                raise self._error(i, "no answer before the timeout (hung or overloaded)")

    def wait(self, pending: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results = [self._recv(i, deadline) for i in range(len(self._conns))]
        if pending in STEP_METHODS:
            for i, tb in enumerate(results):
                if tb is not None:
                    raise self._error(i, tb)
        return results

    def diagnose(self, pending: Any, grace_s: float) -> list[RemoteRankError]:
        deadline = time.monotonic() + grace_s
        found: dict[int, RemoteRankError] = {}
        while not found and time.monotonic() < deadline:
            for i, (conn, proc) in enumerate(zip(self._conns, self._procs)):
                try:
                    if conn.poll(0):
                        status, value = conn.recv()
                        if status == "error" or value is not None:
                            found[i] = self._error(i, value)
                except (EOFError, OSError):
                    found[i] = self._died(i)
                if i not in found and not proc.poll() is None:
                    found[i] = self._died(i)
            time.sleep(0.02)
        return [found[i] for i in sorted(found)]

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", ())))
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            _wait(proc, deadline - time.monotonic())
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                _wait(proc, 2.0)
            if proc.poll() is None:
                proc.kill()
                _wait(proc, 2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        pass
