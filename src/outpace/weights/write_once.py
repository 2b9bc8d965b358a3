"""Files a converted model folder gains after conversion, each written by the first load that needs it.

The float32 copy of the matrices kept as blocks (gguf.dequantized_copy) and a draft's Q4_0 blocks
(quantized.requantized_copy) are computed from the folder's blocks, so a load can always compute
them in memory instead; written once, later loads read them. One process writes at a time (an
flock on the file's folder: tensor-parallel ranks load together), under a temporary name renamed
into place, so a file that exists is whole.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

FREE_MARGIN = 64 << 20      # bytes a disk keeps free beyond the file, for the files others write


def write_once(path: Path, need: int, write: Callable[[Path], None], what: str, instead: str) -> bool:
    """Whether path holds its file (of about `need` bytes): written by write(a temporary path
    beside it) unless another process wrote it first. False where it cannot be written (a full
    disk, a read-only folder): nothing is left behind, and stderr says that `what` could not be
    written, what it takes on disk, what the loads do `instead` and what to do."""
    work = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        lock = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.is_file():      # another process wrote it while this one waited
                return True
            for dead in path.parent.glob(f".{path.name}.tmp-*"):     # a writer killed midway
                dead.unlink(missing_ok=True)
            if shutil.disk_usage(path.parent).free < need + FREE_MARGIN:     # the write would fill the disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            write(work)
            os.replace(work, path)
        finally:
            os.close(lock)
    except OSError as error:
        with contextlib.suppress(OSError):      # a read-only folder has none to remove
            work.unlink(missing_ok=True)
        print(f"outpace: could not write the {what} ({error.strerror or error}; it takes {need / 1e9:.1f} GB in "
              f"{path.parent}): {instead}. Free disk space or make the folder writable to keep them.",
              file=sys.stderr)
        return False
    return True
