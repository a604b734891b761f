"""The C extensions, when built: the codec's fast path for one plain ndarray per frame (`NATIVE`,
from `_native.c`), the folding CRC32C (`crc32c`, from `_crc.c`) and, through `load`, the stream
sockets' (`transports/_stream.c`); None (or the `crc32c` package's function) otherwise. `crc32c_copy` (also
`_crc.c`) copies what it checksums, in one pass; `copy_streamed` copies around the cache.

`frame.encode` and `frame.decode` (and the reassembler) try `NATIVE` first and fall back to Python
for anything it does not take. Set TENSORBUS_NATIVE=0 to run the Python paths only. A build made
from another version of its `.c` than the one beside it (a checkout edited since `pip install -e .`)
is not used: it warns once and the Python path runs.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ..buffers import copy_into
from ..errors import UnsupportedDtype
from .dtypes import describe, loaded_whitelist, resolve, when_widened

Buffer = Any  # (frame.Buffer: any buffer; frame imports this module)


def _resolved() -> dict[str, dict[str, object]]:
    """Every (name, byte order) `resolve` accepts, with the dtype it builds (of the dtypes known so far: a frame
    of another one goes to Python, whose `resolve` imports ml_dtypes and widens this table for the next)."""
    table: dict[str, dict[str, object]] = {}
    for name in loaded_whitelist():
        for order in ("<", ">", "|"):
            try:
                table.setdefault(name, {})[order] = resolve(name, order)
            except UnsupportedDtype:
                pass
    return table


def enabled() -> bool:
    """False when TENSORBUS_NATIVE=0: run the Python paths only."""
    return os.environ.get("TENSORBUS_NATIVE", "1") != "0"


#: the header the C extensions share: part of each one's source, as setup.py hashes it
SHARED_HEADER = Path(__file__).with_name("_frame.h")


def checked(module: ModuleType) -> ModuleType | None:
    """`module` (a C extension of tensorbus) if it was built from the source beside it (or none is there);
    else None, with a warning: a checkout whose C was edited since its last build."""
    built = Path(str(module.__file__))
    source = built.with_name(built.name.split(".", 1)[0] + ".c")
    if source.exists() and _source_hash(source) != module.SOURCE_HASH:
        warnings.warn(
            f"{built} was built from another {source.name}: not used (rebuild: pip install -e .)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return module


def agrees(module: ModuleType | None, constants: dict[str, int]) -> ModuleType | None:
    """`module` if it was built with these values of the constants its C repeats from Python (by name);
    else None, with a warning: its C and the Python beside it no longer describe the same format."""
    if module is not None and any(getattr(module, name, None) != value for name, value in constants.items()):
        warnings.warn(
            f"{module.__file__} disagrees with the Python's constants: not used", RuntimeWarning, stacklevel=2
        )
        return None
    return module


def _source_hash(source: Path) -> str:
    """What setup.py compiles into an extension: the SHA-256 of its .c followed by the shared header."""
    digest = hashlib.sha256(source.read_bytes())
    if SHARED_HEADER.exists():
        digest.update(SHARED_HEADER.read_bytes())
    return digest.hexdigest()


def load(name: str) -> ModuleType | None:
    """The C extension `name` (e.g. "tensorbus.transports._stream") when enabled, built, and not stale."""
    if not enabled():
        return None
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return checked(module)


def _folding() -> ModuleType | None:
    """`_crc.c` where it is built and the CPU has AVX2 and VPCLMULQDQ (its functions need both), else None."""
    fast = load(f"{__package__}._crc")
    return fast if fast is not None and fast.ACCELERATED else None


def _crc32c() -> Callable[..., int]:
    """The folding CRC32C where the CPU has AVX2 and VPCLMULQDQ (faster: docs/PERFORMANCE.md), else the package's."""
    fast = _folding()
    if fast is not None:
        return fast.crc32c
    import crc32c as crc32c_package  # (only here: importing it costs a process ~50 ms, `importlib.metadata`)

    return crc32c_package.crc32c


#: CRC32C of a buffer, continuing from the CRC `value` of what came before (`crc32c.crc32c`'s call)
crc32c = _crc32c()


def plain_copy(dst: Buffer, src: Buffer) -> None:
    """`copy_streamed`'s readable path: `dst[:] = src` (glibc's memcpy), letting other threads run meanwhile
    when it is large (`buffers.copy_into`)."""
    copy_into(memoryview(dst).cast("B"), memoryview(src).cast("B"))


def copy_then_crc(dst: Buffer, src: Buffer, value: int = 0) -> int:
    """`crc32c_copy`'s readable path: `src` copied into `dst` (as long), then its CRC32C (a second read of it)."""
    plain_copy(dst, src)
    return crc32c(src, value)


def _crc32c_copy() -> Callable[..., int]:
    """The folding CRC32C that copies what it reads where the CPU has it (one pass: `_crc.c`), else `copy_then_crc`."""
    fast = _folding()
    return copy_then_crc if fast is None else fast.crc32c_copy


#: `dst[:] = src` and the CRC32C of `src` continuing from `value`, in one pass where it can
crc32c_copy = _crc32c_copy()


def _copy_streamed() -> Callable[[Buffer, Buffer], None]:
    """`_crc.c`'s copy with streaming stores where the CPU has it, else `plain_copy`."""
    fast = _folding()
    return plain_copy if fast is None else fast.copy_streamed


#: `dst[:] = src` around the cache (from `STREAMED_FROM` bytes: the bytes go to another core, which reads them
#: from memory anyway); `dst` and `src` do not overlap
copy_streamed = _copy_streamed()
#: the size from which `copy_streamed` copies faster than memcpy here: past the core's own cache (4 MiB). Above
#: 128 MiB glibc's memcpy streams by itself, up to a tenth faster when the two addresses lie alike in their pages,
#: but at a third of the speed when the destination is a little past the source (a frame's head before a tensor's
#: bytes, the source 16 bytes into its page, as large numpy arrays are): docs/PERFORMANCE.md
STREAMED_FROM = 4 << 20


def crc32c_c() -> object:
    """`crc32c` as a C function for the other extensions (`_crc`'s CRC32C_C capsule) where it is the folding one,
    else None."""
    fast = _folding()
    return fast.CRC32C_C if fast is not None and crc32c is fast.crc32c else None


def configure(native: ModuleType) -> None:
    """Hand `_native` what it takes from Python: the dtypes it decodes, how it describes them, and the CRC32C."""
    native.configure(_resolved(), describe, crc32c, crc32c_c())


def _load() -> ModuleType | None:
    native = load(f"{__package__}._native")
    if native is not None:
        configure(native)
        when_widened(lambda: configure(native))
    return native


#: the extension, configured; None when it is not built, is stale, or TENSORBUS_NATIVE=0
NATIVE = _load()
