"""A checkpoint directory opened once, whose files are read only as the regular files they were.

A weight update names a directory under ``ROLLOUT_WEIGHTS_ROOT``; checking its path and then
reading by path leaves a window in which a component, or a file, is swapped for a symlink that
leads out of the root (a red team loaded outside weights 3 times in 27 that way), and a FIFO or a
device hangs or spins the reader. So a confined directory is opened from the root one component
at a time with ``O_NOFOLLOW`` (a descriptor, not a path), each file is opened relative to that
descriptor with ``O_NOFOLLOW`` and must be a regular file (``fstat`` on the opened descriptor),
and every later read of it goes through that descriptor (libraries that want a path get
``/proc/self/fd/N``, which reopens the same inode, never a new name).

Without a root (the served model's own directory: a hub cache snapshot is made of symlinks into
its blobs) symlinks are followed, but non-regular files are still refused.

Written by hand: the standard library has the primitives (``dir_fd``, ``O_NOFOLLOW``) and no
library offers a confined directory walk with them.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.errors import InvalidRequestError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO for reading would wait for a writer forever; opened this way it
# returns at once, and fstat refuses it.
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class WeightsInvalidError(InvalidRequestError):
    """The directory cannot be swapped into the loaded model; ``errors["problem"]`` says why (here:
    a symlink where a confined file or directory must be, a file that is not a regular one)."""

    code = "weights_invalid"

    def __init__(self, message: str, *, problem: str, **details):
        super().__init__(message, errors={"problem": problem, **details})
        self.problem = problem


class CheckpointDir:
    """Use as ``with CheckpointDir.open(path, root=...) as checkpoint:``; descriptors close on exit."""

    def __init__(self, path: Path, fd: int, *, confined: bool):
        self.path = path  # for messages only: reads go through descriptors
        self._fd = fd
        self._confined = confined
        self._files: dict[str, int] = {}

    @classmethod
    @contextmanager
    def open(cls, directory: str | Path, *, root: str | Path | None = None) -> Iterator[CheckpointDir]:
        """Open ``directory``; with ``root``, only by a walk under the (resolved) root that meets no symlink."""
        directory = Path(directory)
        fd = _open_confined(directory, Path(os.path.realpath(root))) if root is not None else _open_plain(directory)
        checkpoint = cls(directory, fd, confined=root is not None)
        try:
            yield checkpoint
        finally:
            checkpoint.close()

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        os.close(self._fd)

    def names(self) -> list[str]:
        return sorted(os.listdir(self._fd))

    def glob(self, pattern: str) -> list[str]:
        return [name for name in self.names() if fnmatch.fnmatchcase(name, pattern)]

    def has(self, name: str) -> bool:
        """Whether ``name`` is an entry of the directory (of any kind: reading it checks its kind)."""
        try:
            os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def fd(self, name: str) -> int:
        """The descriptor of the regular file ``name``, opened once and kept until close."""
        if name not in self._files:
            if Path(name).name != name or name in (".", ".."):
                raise WeightsInvalidError(f"{name!r} is not a file name of the directory", problem="bad_file", file=name)
            flags = _FILE_FLAGS | (os.O_NOFOLLOW if self._confined else 0)
            try:
                fd = os.open(name, flags, dir_fd=self._fd)
            except FileNotFoundError:
                raise WeightsInvalidError(f"the weights directory has no {name}", problem="missing_file",
                                          file=name) from None
            except OSError:  # ELOOP: a symlink where a confined file must be
                raise WeightsInvalidError(f"{name} is a symlink; weight files must be regular files in the "
                                          "directory", problem="not_a_regular_file", file=name) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise WeightsInvalidError(f"{name} is not a regular file", problem="not_a_regular_file", file=name)
            os.set_blocking(fd, True)
            self._files[name] = fd
        return self._files[name]

    def path_of(self, name: str) -> str:
        """A path that opens the very file :meth:`fd` opened, for libraries that take paths."""
        return f"/proc/self/fd/{self.fd(name)}"

    def read_bytes(self, name: str) -> bytes:
        return b"".join(self.chunks(name))

    def chunks(self, name: str, size: int = 1 << 22) -> Iterator[bytes]:
        fd, offset = self.fd(name), 0
        while chunk := os.pread(fd, size, offset):
            offset += len(chunk)
            yield chunk


def _open_plain(directory: Path) -> int:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        raise WeightsInvalidError("the weights path is not a directory", problem="not_a_directory") from None
    return fd


def _open_confined(directory: Path, root: Path) -> int:
    """The directory's descriptor, reached from ``root`` component by component without following
    a symlink: what lies there when it is opened, not when its path was checked."""
    absolute = directory if directory.is_absolute() else root / directory
    try:
        parts = Path(os.path.normpath(absolute)).relative_to(root).parts
    except ValueError:
        raise WeightsInvalidError("the weights path is outside ROLLOUT_WEIGHTS_ROOT", problem="outside_root") from None
    if ".." in parts:
        raise WeightsInvalidError("the weights path must not contain '..'", problem="outside_root")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    for part in parts:
        try:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            os.close(fd)
            raise WeightsInvalidError(f"the weights path's {part!r} is not a directory in the root (a symlink, "
                                      "or missing)", problem="not_a_directory") from None
        os.close(fd)
        fd = child
    return fd
