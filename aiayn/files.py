"""Writing results safely: a file, a set of files or a directory appears whole or not at all, and an
output path is checked before the work that fills it.

Every file is written under a temporary name beside its final one, fsynced, then renamed over it, so a
kill at any moment leaves either the old file or the new one. `write_set` extends this to several files
whose last one (a model directory's config.json) is what readers look for first; `staged_dir` to a
directory (a checkpoint, an export) filled under a temporary name and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"  # every temporary file or directory this package makes ends so and starts with "."


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call write(tmp) on a temporary file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    tmp = stage(path, write)
    try:
        rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_contents(path: Path, data: str | bytes) -> None:
    """Write bytes as they are, text as UTF-8 (not atomic: for a temporary file that is renamed after)."""
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")


def write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_output(path: str | Path, text: str) -> None:
    """A user's output file: written atomically, through a symlink to its target; a device or a pipe
    (/dev/null, /dev/stdout, a FIFO) is written to, never replaced by a file."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        write_text(target, text)


def stage(path: Path, write: Callable[[Path], Any]) -> Path:
    """write(tmp) into a fsynced temporary file beside `path`, readable by others; returns tmp."""
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    except OSError as e:  # name the file the user asked for, not the temporary one
        raise OSError(e.errno, e.strerror, str(path)) from None
    os.close(fd)
    tmp = Path(name)
    try:
        with writing(path):
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        tmp.chmod(0o644)  # mkstemp makes it private; models and translations are not secrets
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Writing `path` (a file or a directory being filled): a storage failure inside the block is
    raised as the OSError it stands for, naming `path`, whatever the library that wrote reported it as
    (safetensors' SafetensorError, torch.save's RuntimeError "unexpected pos", a bare write's OSError
    without a file name), so that the command line says it in one line. Other errors pass unchanged."""
    try:
        yield
    except Exception as error:
        mapped = storage_error(error, Path(path))
        if mapped is error:
            raise
        raise mapped from error


def storage_error(error: Exception, path: Path) -> Exception:
    """error as an OSError naming path, when it is a failure to store (else error itself). Asked while
    the failed write is still on disk, so that a full disk still shows full."""
    if isinstance(error, ValueError):  # the word for a user's mistake, never a storage failure
        return error
    if isinstance(error, OSError):
        named = error.filename is not None and TMP_SUFFIX not in str(error.filename)
        return error if named else OSError(error.errno, error.strerror or str(error), str(path))
    code = re.search(r"os error (\d+)", str(error))  # Rust's std::io::Error, as safetensors words it
    if code:
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path))
    directory = path if path.is_dir() else path.parent
    try:
        full = os.statvfs(directory).f_bavail == 0
    except OSError as e:  # the directory vanished, or cannot be reached any more
        return OSError(e.errno, e.strerror, str(path))
    if full:  # torch.save reports a short write as "unexpected pos"
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return error


def write_set(
    directory: Path, files: dict[str, Callable[[Path], Any]], last: str, stale: tuple[str, ...] = ()
) -> None:
    """Write several files of `directory` so that a reader never sees a mix of old and new.

    Readers find the set by its `last` file. Every file is first staged under a temporary name; then
    `last` is removed (the old set stops being one), the others are renamed into place, the names in
    `stale` removed, and `last` renamed in place of its old self. A kill while staging leaves the old set
    whole; a kill during the renames (microseconds) leaves no set, which readers refuse, never a mix.
    """
    assert last in files
    staged: dict[str, Path] = {}
    try:
        for name, write in files.items():
            staged[name] = stage(directory / name, write)
        (directory / last).unlink(missing_ok=True)
        fsync_dir(directory)
        for name, tmp in staged.items():
            if name != last:
                rename(tmp, directory / name)
        for name in stale:
            (directory / name).unlink(missing_ok=True)
        fsync_dir(directory)
        rename(staged[last], directory / last)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    fsync_dir(directory)


def check_replaceable(path: Path, force: bool) -> None:
    """An output that exists is replaced only when the user said so."""
    if path.exists() and not force:
        raise ValueError(f"{path} already exists; use --force to replace it")


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A temporary directory beside `final` to fill; when the block ends without an error it replaces
    `final` whole (replace_dir), else it is removed. A kill leaves a temporary name that
    remove_temporaries finds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=TMP_SUFFIX))
    except OSError as e:  # name the directory the user asked for, not the temporary one
        raise OSError(e.errno, e.strerror, str(final)) from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private, like mkstemp in stage
        with writing(final):
            yield tmp
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(directory: Path, dest: Path) -> None:
    """Rename `directory` to `dest` and sync their parent. What dest held (a rename cannot replace a
    directory that is not empty) is renamed aside first and removed only once the new one is in place, so
    a failure leaves the old one where it was (a kill in the microseconds between the two renames leaves
    it beside dest under a temporary name)."""
    aside = None
    if dest.exists():
        aside = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.replaced.", suffix=TMP_SUFFIX))
        os.replace(dest, aside)  # (over the empty directory just made)
    try:
        rename(directory, dest)
    except BaseException:
        if aside is not None:
            os.replace(aside, dest)
        raise
    fsync_dir(dest.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def rename(source: Path, dest: Path) -> None:
    """os.replace, whose failure (a directory where a file goes, a read-only disk) names dest, the path the
    user knows, not the temporary one."""
    try:
        os.replace(source, dest)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(dest)) from None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporaries(directory: Path) -> list[Path]:
    """Delete the temporary files and directories a killed writer left in `directory`; returns them."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX)]
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found


def check_writable_file(path: str | Path, what: str = "output") -> Path:
    """Refuse, before any work, an output file that could not be written: ValueError naming it."""
    if str(path) == "":
        raise ValueError(f"the {what} file name is empty")
    path = Path(os.path.realpath(path))  # a symlink is written through to its target
    if path.exists() and not path.is_file() and not path.is_dir():
        return path  # a device or a pipe: written to as it is
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; the {what} must be a file")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{path}: {parent} is not a directory")
    if not parent.is_dir():
        raise ValueError(f"{path}: the directory {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: the directory {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{path}: the file exists and is not writable")
    return path


def check_writable_dir(path: str | Path, what: str = "output directory") -> Path:
    """Refuse, before any work, a directory that could not be created or written: ValueError naming it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory; the {what} must be a directory")
    existing = path
    while not existing.exists():  # the nearest ancestor that exists must let us create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: {existing} is not writable")
    return path
