"""Listing the image files under a folder, following symbolic links but reading every file once.

``os.walk(root, followlinks=True)`` (what timm's folder reader uses) enters a link to a directory above it again and
again, until the path holds more links than the system resolves: a folder of 20 images with such a loop lists each
of them 41 times, under different paths, so a random train/val split puts the same image in both.  It also lists a
directory reached through two paths (a link to a sibling folder) twice.

:func:`find_image_files` walks the folder itself and keeps the real path of every directory and file it has read:

* the directories reached without a link are read first, at their own place; a link to one of them (or to one
  already read) is skipped, so a loop ends at its link and a linked copy of a folder adds nothing;
* links leading out of the tree are followed, once per real directory and file;
* a file reached under two paths is listed once, under the path without a link when it has one.

A dangling link with an image extension is listed (as ``os.walk`` lists it), for the dataset to report as unreadable.
"""
from __future__ import annotations

import os
from typing import Iterable, NamedTuple

__all__ = ["ImageFile", "find_image_files"]


class ImageFile(NamedTuple):
    path: str  # under the walked root, as the walk reached it
    real: str  # with every link resolved: the same file has the same ``real`` under any path


def _walk_order(root: str):
    """Sort key giving ``os.walk``'s top-down order with sorted names: a folder's files, then its sub-folders."""
    prefix = len(os.path.join(root, ""))  # every path found is the root joined with the names below it

    def key(file: ImageFile):
        *dirs, name = file.path[prefix:].split(os.sep)
        return tuple((1, d) for d in dirs) + ((0, name),)
    return key


def find_image_files(root: str, extensions: Iterable[str], sort: bool = True) -> list[ImageFile]:
    """Every file under ``root`` whose name ends in one of ``extensions`` (case-insensitive), each real file once,
    in ``os.walk``'s top-down order with sorted names (``sort=False``: in no set order, for a caller that sorts
    them its own way); folders that cannot be read are passed over, as ``os.walk`` does."""
    exts = tuple(e.lower() for e in extensions)
    seen_dirs: set[str] = set()
    seen_files: set[str] = set()
    found: list[ImageFile] = []
    pending = [(root, os.path.realpath(root))]  # directories to read: (path, real path)
    links: list[str] = []  # links met while reading, followed once the directories before them are read

    def add(path: str, real: str) -> None:
        if real not in seen_files and path.lower().endswith(exts):
            seen_files.add(real)
            found.append(ImageFile(path, real))

    while pending or links:
        if not pending:
            path = links.pop(0)
            real = os.path.realpath(path)
            if os.path.isdir(real):
                if real not in seen_dirs:
                    pending.append((path, real))
            else:
                add(path, real)
            continue
        path, real = pending.pop()
        if real in seen_dirs:
            continue
        seen_dirs.add(real)
        real_dir = os.path.join(real, "")
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                links.append(entry.path)
            elif entry.is_dir():
                pending.append((entry.path, real_dir + entry.name))  # not a link: its real path is below real
            else:
                add(entry.path, real_dir + entry.name)
    return sorted(found, key=_walk_order(root)) if sort else found
