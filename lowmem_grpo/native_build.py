"""Compiling the project's plain-C++ CPU kernels (optim/host_*.cpp, policy/decode_attention.cpp) on first use.

`build_library(prefix, sources, cflags)` compiles the sources into one shared library with torch's
extension builder (cached in TORCH_EXTENSIONS_DIR) and loads it with ctypes. The library's name carries
the CPU's instruction sets (-march=native code must not run on another CPU type that shares the cache)
and a hash of the sources and flags (two checkouts with different kernels keep a build each).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
from pathlib import Path
from typing import Optional, Sequence


def cpu_tag() -> str:
    """A short hash of the machine's architecture and CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def source_tag(sources: Sequence[Path], cflags: Sequence[str]) -> str:
    """A short hash of the sources' bytes and the flags."""
    digest = hashlib.sha1(" ".join(cflags).encode())
    for source in sources:
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:10]


def build_library(prefix: str, sources: Sequence[Path], cflags: Sequence[str], headers: Sequence[Path] = (),
                  target: Optional[str] = None, ldflags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile (or find in torch's extension cache) and load `sources` as one library; `headers` (the ones
    they include) count in its name. `target` names the build in place of the CPU tag (a fixed -march);
    `ldflags` are added to the link (they count in the name too). Raises what the compiler raised."""
    from torch.utils import cpp_extension
    try:  # the pip package `ninja` puts its binary beside its module; a venv's bin/ is not always on PATH
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    name = f"{prefix}_{target or cpu_tag()}_{source_tag([*sources, *headers], [*cflags, *ldflags])}"
    path = cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                              extra_ldflags=["-pthread", *ldflags], is_python_module=False, verbose=False)
    return ctypes.CDLL(path)
