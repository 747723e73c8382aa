"""A C file compiled for this machine at start-up and called through ctypes: how an engine adds a kernel PyTorch lacks.

The build is named for a digest of the source, the flags, the compiler and every CPU flag, so a changed source, another
compiler or a cache copied to another kind of CPU builds again; each process builds under a name of its own and renames
it into place, so two starting at once never load half a file. ctypes releases the GIL while a C function runs."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from shared.devices import cpu_flags


class NativeBuildFailed(RuntimeError):
    """No C compiler here, or the build failed; the message says which, with the compiler's own words."""


def find_compiler(compiler: str | None = None) -> str:
    """``compiler``, else ``$CC``, ``cc`` or ``gcc``, as found on PATH; :class:`NativeBuildFailed` when none is."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or shutil.which(compiler) is None:
        raise NativeBuildFailed(f"built with a C compiler ($CC, cc or gcc), and none was found{f' ({compiler!r})' if compiler else ''}")
    return compiler


def library_path(source: Path, flags: tuple[str, ...], compiler: str, cache: Path) -> Path:
    """Where ``compiler``'s build of ``source`` with ``flags`` lives in ``cache``."""
    named = "\0".join([source.read_text(), *flags, compiler, " ".join(cpu_flags(every=True))])
    return cache / f"{source.stem}-{hashlib.sha256(named.encode()).hexdigest()[:16]}.so"


def build_library(source: Path, flags: tuple[str, ...], signatures: dict[str, list], cache: Path,
                  compiler: str | None = None) -> ctypes.CDLL:
    """``source`` built with ``flags`` (a shared library's among them) into ``cache`` once (:func:`library_path`) and loaded, each function of
    ``signatures`` (name: ctypes argument types) declared to return nothing; :class:`NativeBuildFailed` with the reason."""
    compiler = find_compiler(compiler)
    target = library_path(source, flags, compiler, cache)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        done = subprocess.run([compiler, *flags, "-o", str(partial), str(source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise NativeBuildFailed(f"building {source.name} with {compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    library = ctypes.CDLL(str(target))
    for name, arguments in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, None
    return library
