"""Reading and writing the files samplec is given: only regular files of bounded size are read (a FIFO or a
device could block or never end), and a file is written whole or not at all (a temporary file and a rename)."""
from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import sys
from pathlib import Path

from samplec.diagnostics import SamplecError

MAX_FILE_BYTES = 64 << 20       # a .smpb is a few kilobytes and a .smp a few hundred bytes


def check_regular(path: str | os.PathLike, limit: int | None = None) -> int:
    """The size of a regular file (of at most `limit` bytes); anything else is refused before it is opened."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SamplecError(f"cannot read {path}: no such file") from None
    except OSError as e:
        raise SamplecError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SamplecError(f"{path}: not a regular file")
    if limit is not None and st.st_size > limit:
        raise SamplecError(f"{path}: {st.st_size} bytes; the limit is {limit}")
    return st.st_size


def read_file(path: str | os.PathLike, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else is refused before it is read."""
    path = Path(path)
    check_regular(path, limit)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise SamplecError(f"cannot read {path}: no such file") from None
    except OSError as e:
        raise SamplecError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise SamplecError(f"{path}: more than {limit} bytes")
    return data


def compiled(data: bytes) -> bool:
    """Whether a file's bytes start as a compiled program (.smpb): a flatbuffer's root offset -- never text -- and
    its identifier."""
    return data[4:8] == b"SMPB" and b"\x00" in data[:4]


def read_source(path: str | os.PathLike) -> str:
    """A .smp file's text (UTF-8; a byte-order mark is not part of the source)."""
    data = read_file(path)
    if compiled(data):
        raise SamplecError(f"{path}: a compiled program (.smpb), not a .smp source (`samplec run` or "
                           "`samplec inspect` takes it)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SamplecError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def write_atomic(path: str | os.PathLike, data: bytes, *, not_over: str | os.PathLike | None = None) -> None:
    """Write `data` to `path` through a temporary file in the same directory, synced, then renamed over it: a
    reader never sees half a file, and a failure leaves the old file as it was. A symbolic link is followed (the
    file it names is replaced, the link stays); an existing file keeps its permissions; a device or a FIFO
    (`-o /dev/null`, `-o /dev/stdout`) is written in place -- never replaced by a file -- and a FIFO nobody reads
    is an error, not a wait. `not_over`: an input that must not be overwritten (`compile -o` naming its own
    source)."""
    if not os.fspath(path):
        raise SamplecError("cannot write to an empty file name")
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise SamplecError(f"cannot write {str(path)!r}: not a file name")
    if not_over is not None and path.exists() and os.path.samefile(path, not_over):
        raise SamplecError(f"cannot write {path}: it is the input file (choose another -o)")
    fd = _own_descriptor(path)
    if fd is not None:                      # (-o /dev/stdout >> log: append to what the shell opened, in place)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            raise SamplecError(f"cannot write {path}: {e.strerror or e}") from None
        return
    try:
        st = os.stat(path)                  # (through links: /dev/stdout -> /proc/self/fd/1 -> a pipe or a tty)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise SamplecError(f"cannot write {path}: {e.strerror or e}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise SamplecError(f"cannot write {path}: it is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        _write_in_place(path, data, fifo=stat.S_ISFIFO(st.st_mode))
        return
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise SamplecError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if st is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SamplecError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _own_descriptor(path: Path) -> int | None:
    """The descriptor `/dev/stdout`, `/dev/stderr`, `/dev/fd/N` or `/proc/self/fd/N` names (written as it is, with
    its own position and append mode -- reopening it by name would truncate a redirected log), or None."""
    m = re.fullmatch(r"/dev/(stdout|stderr|fd/(\d+))|/proc/self/fd/(\d+)", str(path))
    if m is None:
        return None
    number = m.group(2) or m.group(3)
    fd = int(number) if number else 1 if m.group(1) == "stdout" else 2
    try:
        os.fstat(fd)
    except OSError:
        return None
    if fd in (1, 2):
        (sys.stdout if fd == 1 else sys.stderr).flush()
    return fd


def _write_in_place(path: Path, data: bytes, *, fifo: bool) -> None:
    """Write to a device or a FIFO as a stream (a FIFO without a reader is refused at once: O_NONBLOCK)."""
    try:
        fd = os.open(path, os.O_WRONLY | (os.O_NONBLOCK if fifo else 0))
    except OSError as e:
        why = "nothing reads that FIFO" if fifo and e.errno == errno.ENXIO else (e.strerror or e)
        raise SamplecError(f"cannot write {path}: {why}") from None
    try:
        if fifo:
            os.set_blocking(fd, True)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        raise SamplecError(f"cannot write {path}: {e.strerror or e}") from None
