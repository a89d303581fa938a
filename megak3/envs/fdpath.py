"""Host-side operations on a tree the agent controls, by directory file descriptor.

The worker runs as root outside the jail, and everything below an episode's directory was written by
the agent's commands. So nothing here resolves a multi-component path through that tree or follows a
symlink in it: every operation starts from a trusted directory fd and takes one component at a time,
``os.open(name, O_DIRECTORY | O_NOFOLLOW, dir_fd=fd)`` (a planted symlink gives ELOOP, a planted file
ENOTDIR), ``*at`` calls with ``follow_symlinks=False``. Walks hold two directory fds at most and climb
back with ``..``, checked against the (device, inode) they left, so a tree deeper than Python's
recursion limit or the fd limit is walked as easily as a flat one.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Callable, List, Optional, Sequence

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(dir_fd: int, name: str) -> int:
    """fd of directory ``name`` in ``dir_fd``; never through a symlink (ELOOP) or a non-directory (ENOTDIR)."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def open_dirs(root_fd: int, parts: Sequence[str], make: Optional[Callable[[int, str], None]] = None) -> int:
    """fd of the directory ``parts`` (components, no ``..``) below ``root_fd``, one component at a time;
    a missing component is an error, or ``make(parent_fd, name)`` creates it first."""
    fd = os.dup(root_fd)
    try:
        for comp in parts:
            try:
                nfd = open_dir(fd, comp)
            except FileNotFoundError:
                if make is None:
                    raise
                make(fd, comp)
                nfd = open_dir(fd, comp)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ident(st: os.stat_result):
    return st.st_dev, st.st_ino


def walk(top_fd: int, on_entry: Callable[[int, str, os.stat_result], bool],
         on_leave: Optional[Callable[[int, str], None]] = None) -> None:
    """Depth-first over everything below directory ``top_fd`` without following links or recursing.

    ``on_entry(dir_fd, name, lstat)`` sees every entry (a directory's entries are listed before any is
    visited); a directory is descended into when it returns true. ``on_leave(parent_fd, name)`` runs
    after a directory's contents were visited. ``top_fd`` itself is neither visited nor closed.
    """
    fd = os.dup(top_fd)
    levels: List[tuple] = []            # (name, (dev, ino) of its parent, the parent's unvisited subdirs)
    try:
        pending = _scan(fd, on_entry)
        while True:
            if pending:
                name = pending.pop()
                here = _ident(os.fstat(fd))
                child = open_dir(fd, name)
                levels.append((name, here, pending))
                os.close(fd)
                fd = child
                pending = _scan(fd, on_entry)
                continue
            if not levels:
                return
            name, parent, pending = levels.pop()
            up = os.open("..", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            if _ident(os.fstat(fd)) != parent:
                raise OSError(errno.ESTALE, "a directory moved while it was walked")
            if on_leave is not None:
                on_leave(fd, name)
    finally:
        os.close(fd)


def _scan(fd: int, on_entry) -> List[str]:
    subdirs = []
    for name in sorted(os.listdir(fd)):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if on_entry(fd, name, st) and stat.S_ISDIR(st.st_mode):
            subdirs.append(name)
    subdirs.reverse()                   # popped from the end: visited in name order
    return subdirs


def remove_at(dir_fd: int, name: str) -> None:
    """Delete entry ``name`` of directory ``dir_fd`` and everything under it (links are removed, never followed)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return

    def entry(fd, n, s):
        if stat.S_ISDIR(s.st_mode):
            return True
        os.unlink(n, dir_fd=fd)
        return False

    sub = open_dir(dir_fd, name)
    try:
        walk(sub, entry, lambda fd, n: os.rmdir(n, dir_fd=fd))
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it. ``path`` itself is a host path the worker chose (its parent
    directories are trusted); below it nothing is followed (``remove_at``)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        remove_at(pfd, name)
    finally:
        os.close(pfd)


def tree_bytes(top_fd: int) -> int:
    """Allocated bytes of everything below directory ``top_fd`` (``st_blocks``, links not followed)."""
    total = 0

    def entry(fd, name, st):
        nonlocal total
        total += st.st_blocks * 512
        return True

    walk(top_fd, entry)
    return total
