"""Peer processes (``peer_server.py``) on 127.0.0.1 for the transfer tests."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("peer_server.py")
READY_TIMEOUT_S = 60.0


@dataclass
class PeerProcess:
    """A running ``peer_server.py``."""

    proc: subprocess.Popen[bytes]
    port: int
    engine_id: str
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap (a stopped process dies too)."""
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is stopped), then SIGKILL if it lingers."""
        if self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


class PeerLauncher:
    """Starts ``peer_server.py`` processes; `stop_all` stops every one of them.

    `launch` returns at once (start several peers in parallel), `PendingPeer.wait`
    blocks until the peer writes its ready line to our pipe (its socket listens).
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[PeerProcess] = []
        self._pending: list[PendingPeer] = []

    def launch(self, env: dict[str, str] | None = None, **flags: object) -> PendingPeer:
        args = [sys.executable, str(PEER_SCRIPT)]
        for key, value in flags.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        rfd, wfd = os.pipe()
        log = self.logdir / f"peer{len(self._pending)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*args, "--ready-fd", str(wfd)],
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(wfd,),
                env={**os.environ, **(env or {})},
            )
        os.close(wfd)
        pending = PendingPeer(self, proc, rfd, log)
        self._pending.append(pending)
        return pending

    def spawn(self, env: dict[str, str] | None = None, **flags: object) -> PeerProcess:
        return self.launch(env, **flags).wait()

    def stop_all(self) -> None:
        for pending in self._pending:
            pending.close()
        for peer in self.procs:
            peer.stop()


@dataclass
class PendingPeer:
    launcher: PeerLauncher
    proc: subprocess.Popen[bytes]
    rfd: int
    log: Path
    peer: PeerProcess | None = None

    def wait(self, timeout: float = READY_TIMEOUT_S) -> PeerProcess:
        if self.peer is not None:
            return self.peer
        try:
            line = _read_line(self.rfd, timeout, self.proc)
        except BaseException as exc:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"{exc}; log:\n{self.log.read_text()[-2000:]}") from exc
        finally:
            self._close_pipe()
        info = json.loads(line)
        self.peer = PeerProcess(self.proc, int(info["port"]), info["engine_id"], self.log)
        self.launcher.procs.append(self.peer)
        return self.peer

    def _close_pipe(self) -> None:
        if self.rfd >= 0:
            os.close(self.rfd)
            self.rfd = -1

    def close(self) -> None:
        """Close the pipe; kill the process if nobody waited for it to become ready."""
        self._close_pipe()
        if self.peer is None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _read_line(fd: int, timeout: float, proc: subprocess.Popen[bytes]) -> str:
    end = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"peer {proc.args} not ready after {timeout} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"peer exited before it was ready (rc={proc.wait(5)})")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()
