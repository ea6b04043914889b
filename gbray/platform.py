"""What the process was handed, and the per-OS fixes (no-ops where they do not apply)."""

from __future__ import annotations

import contextlib
import os
import platform as _platform
import socket
import sys
from pathlib import Path

_SECRET_MARKS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


# Whether this process has run prepare_torch_import (it must run before the first `import torch`).
TORCH_IMPORT_PREPARED = False


def prepare_torch_import() -> None:
    """On Windows a browser-started process could not import torch (WinError 1114 from c10.dll
    under the loader flags torch uses); loading c10.dll once under default search rules first
    fixes it. Elsewhere this does nothing. Runs when the gbray package is imported."""
    global TORCH_IMPORT_PREPARED
    TORCH_IMPORT_PREPARED = True
    if sys.platform != "win32":
        return
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        dll = Path(spec.origin).parent / "lib" / "c10.dll"
        if dll.exists():
            with contextlib.suppress(OSError):
                ctypes.WinDLL(str(dll))


def set_threads(threads: int) -> int:
    """Pin torch's intra-op threads; 0 means the CPUs this process may use. Returns the count.
    Oversubscribed threads are catastrophic: two 2-thread torch processes on 2 cores ran 10x slower."""
    import torch

    n = threads if threads > 0 else available_cpus()
    torch.set_num_threads(n)
    return n


def available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _rlimits() -> dict:
    try:
        import resource
    except ImportError:
        return {}
    out = {}
    for name in ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_NPROC"):
        if hasattr(resource, name):
            soft, hard = resource.getrlimit(getattr(resource, name))
            out[name] = {
                "soft": None if soft == resource.RLIM_INFINITY else soft,
                "hard": None if hard == resource.RLIM_INFINITY else hard,
            }
    return out


def safe_environment() -> dict:
    """The environment with every variable whose name holds TOKEN or KEY (or a like mark) left out."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if not any(mark in k.upper() for mark in _SECRET_MARKS)
    }


def process_record() -> dict:
    """What this process was handed: interpreter, paths, CPUs, memory and job limits, environment."""
    import psutil

    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "os": _platform.platform(),
        "python": sys.version.split()[0],
        "interpreter": sys.executable,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "sys_path": sys.path,
        "cpus": available_cpus(),
        "memory_total": psutil.virtual_memory().total,
        "memory_available": psutil.virtual_memory().available,
        "cgroup_memory_limit": _cgroup_memory_limit(),
        "rlimits": _rlimits(),
        "environment": safe_environment(),
    }
