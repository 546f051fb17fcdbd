"""Small C kernels for CPU attention, compiled at first use and loaded with `ctypes`.

Each kernel is one C file under ``csrc/`` with its shape constants given as ``-D``
defines. It is built with the system C compiler (``cc`` or ``$CC``) for this CPU
(``-O3 -march=native``) into ``$KVDUPLEX_CACHE_DIR`` (default ``~/.cache/kvduplex``),
keyed by a hash of the source, the compiler, the flags and the CPU, so a changed source or
a different machine builds anew. `ctypes` releases the GIL during each call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvduplex.common.config import CACHE_DIR_VAR

logger = logging.getLogger(__name__)

T = TypeVar("T")

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-shared", "-fPIC")
X86_FLAGS = ("-mprefer-vector-width=512",)
"""x86 compilers only: use 512-bit vectors where the CPU has them (GCC prefers 256)."""


def build_library(source: Path, defines: dict[str, int]) -> Path:
    """The shared library of `source` built with `defines`, compiled now unless cached.

    OSError when there is no compiler or it fails (its error in the message)."""
    cc = os.environ.get("CC")
    compiler = shlex.split(cc) if cc else [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not compiler:
        raise OSError("no C compiler (cc, gcc or $CC)")
    text = source.read_bytes()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = (*FLAGS, *(X86_FLAGS if x86 else ()), *(f"-D{name}={value}" for name, value in defines.items()))
    parts = [text, *(c.encode() for c in compiler), *(f.encode() for f in flags), cpu_id()]
    key = hashlib.sha256(b"\0".join(parts))
    cache = Path(os.environ.get(CACHE_DIR_VAR) or Path.home() / ".cache" / "kvduplex") / "kernels"
    shape = "".join(f"-{v}" for v in defines.values())
    target = cache / f"{source.stem}{shape}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)  # a library loaded from here must be ours
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [*compiler, *flags, "-o", str(built), str(source)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise OSError(f"{' '.join(compiler)} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: processes building at once each land a whole file
    logger.info("built %s with %s: %s", source.name, defines, target)
    return target


def cpu_id() -> bytes:
    """What `-march=native` depends on: the machine and its CPU's flags."""
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features", b"model name")):
                    flags += line
                if line.strip() == b"":
                    break
    except OSError:
        pass
    return platform.machine().encode() + b"\0" + flags


def has_avx512() -> bool:
    """Whether this CPU has AVX-512F (x86 only), which the kernels' 16-float vectors map onto."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return any(line.startswith(b"flags") and b" avx512f" in line for line in cpu_id().split(b"\n"))


class Shares:
    """Runs one call's shares of a kernel's work: the first on the calling thread, the
    others on helper threads (`ctypes` releases the GIL during each kernel call)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def run(self, fn: Callable[[T], None], shares: Sequence[T]) -> None:
        """``fn(share)`` for every share, all done (or the first error raised) on return."""
        if len(shares) == 1:
            fn(shares[0])
            return
        futures = [self._threads(len(shares) - 1).submit(fn, share) for share in shares[1:]]
        try:
            fn(shares[0])  # this thread takes the first share
        finally:
            for f in futures:
                f.result()

    def _threads(self, workers: int) -> ThreadPoolExecutor:
        """Grown by replacing the pool, never shut down here: another engine in the process
        may still be submitting to the old one."""
        pool = self._pool
        if pool is None or self._workers < workers:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kvduplex-{self._name}")
            self._pool, self._workers = pool, workers
        return pool
