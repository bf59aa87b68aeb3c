"""What a checkpoint's marker records about its files, and checking files against it.

Each file is checksummed in **pieces** of ``PIECE`` bytes (CRC-32 each), computed by the rank that writes it as
the bytes go out (``Digest``), kept beside the file until the seal gathers them into the marker. On resume the
pieces of all files are shared out over the ranks (``verify_shares``: no rank reads more than 1/N of the bytes
plus one piece, however large one file is) and each rank checks its pieces; every rank checks every file's size.
CRC-32 catches the damage a checkpoint meets (torn writes, flipped bits, truncation) at 2.3x the speed of SHA-256
here. Markers of earlier checkpoints hold one CRC-32 a file (``crc32``); those are checked whole.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Collection, Iterable

MARKER = "COMPLETE.json"
CHUNK = 8 << 20           # bytes a read or write call moves
PIECE = 64 << 20          # bytes one piece checksum covers (a multiple of CHUNK)

Unit = tuple[str, "int | None"]   # (file, piece index), or (file, None): the whole file (a marker without pieces)


class Digest:
    """Size and per-piece CRC-32s of a byte stream, fed in order (a file as it is written or read)."""

    def __init__(self, piece: int | None = None):
        self.piece = piece or PIECE
        self.n, self._crc, self.pieces = 0, 0, []

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            room = self.piece - self.n % self.piece
            part = view[:room]
            self._crc = zlib.crc32(part, self._crc)
            self.n += len(part)
            view = view[len(part):]
            if self.n % self.piece == 0:
                self.pieces.append(f"{self._crc:08x}")
                self._crc = 0

    def result(self) -> dict:
        pieces = self.pieces + ([f"{self._crc:08x}"] if self.n % self.piece or not self.n else [])
        return {"bytes": self.n, "piece_bytes": self.piece, "pieces": pieces}


def file_digest(path: Path, sync: bool = False, piece: int | None = None) -> dict:
    """``{"bytes", "piece_bytes", "pieces"}`` of a file read back; with ``sync`` the file is also fsynced."""
    d = Digest(piece)
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK):
            d.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return d.result()


def whole_crc(path: Path) -> str:
    """The CRC-32 of a whole file, as markers without pieces record it."""
    crc = 0
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_sidecar(path: Path, digest: dict) -> None:
    """The digest of a written file, beside it (``NAME.digest``) until the seal gathers it."""
    Path(str(path) + ".digest").write_text(json.dumps(digest))


def read_sidecar(path: Path) -> dict | None:
    """The digest the writer left beside ``path``, if it is there and matches the file's size."""
    side = Path(str(path) + ".digest")
    try:
        d = json.loads(side.read_text())
        ok = int(d["bytes"]) == Path(path).stat().st_size and isinstance(d["pieces"], list)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return d if ok else None


def units(files: dict[str, dict]) -> list[tuple[Unit, int]]:
    """Every checksummed unit of a marker's files with its bytes: each piece, or each file without pieces."""
    out: list[tuple[Unit, int]] = []
    for name, f in files.items():
        n = int(f["bytes"])
        if "pieces" in f:
            size = int(f["piece_bytes"])
            out += [((name, k), min(size, n - k * size)) for k in range(len(f["pieces"]))]
        else:
            out.append(((name, None), n))
    return out


def verify_shares(files: dict[str, dict], world: int) -> list[list[Unit]]:
    """Which rank checksums which pieces: largest first, each to the rank with the fewest bytes so far (ties: the
    lower rank). Every piece goes to one rank, and no rank gets more than 1/world of the bytes plus one piece (a
    whole file, for a marker without pieces). A pure function of the marker: every rank computes the same."""
    shares: list[list[Unit]] = [[] for _ in range(world)]
    load = [0] * world
    for unit, n in sorted(units(files), key=lambda u: (-u[1], u[0][0], u[0][1] or 0)):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(unit)
        load[r] += n
    return shares


def share_bytes(files: dict[str, dict], share: Iterable[Unit]) -> int:
    sizes = dict(units(files))
    return sum(sizes[u] for u in share)


def verify(path: str | Path, checksums: bool = True, only: Collection | None = None) -> str | None:
    """None if the checkpoint directory is complete and every file matches its marker, else what is wrong.
    Sizes are checked for every file the marker lists; checksums for ``only`` those units when given (a rank's
    share: ``(file, piece)`` pairs, or file names for whole files), else for all."""
    p = Path(path)
    marker = p / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish)"
    try:
        doc = json.loads(marker.read_text())
        files = doc["files"]
        assert isinstance(files, dict) and files
    except (OSError, ValueError, KeyError, AssertionError, UnicodeDecodeError) as e:
        return f"{MARKER} is unreadable ({type(e).__name__})"
    for name, want in files.items():
        f = p / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, its marker says {want['bytes']}"
    if "trainer.json" not in files:
        return "trainer.json is not listed in the marker"
    if not checksums:
        return None
    todo = [u for u, _ in units(files)]
    if only is not None:
        wanted = {(u, None) if isinstance(u, str) else tuple(u) for u in only}
        todo = [u for u in todo if u in wanted or (u[0], None) in wanted]
    for name, k in todo:
        want = files[name]
        if k is None:
            if whole_crc(p / name) != want["crc32"]:
                return f"{name} fails its CRC-32 checksum"
            continue
        size = int(want["piece_bytes"])
        crc = 0
        with (p / name).open("rb") as fh:
            fh.seek(k * size)
            left = min(size, int(want["bytes"]) - k * size)
            while left > 0:
                chunk = fh.read(min(CHUNK, left))
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
        if f"{crc:08x}" != want["pieces"][k]:
            return f"{name} fails its CRC-32 checksum (piece {k}, bytes {k * size}..{k * size + size})"
    return None


def marker_files(p: Path) -> dict | None:
    try:
        files = json.loads((Path(p) / MARKER).read_text())["files"]
        return files if isinstance(files, dict) and files else None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def checkpoint_digest(path: str | Path) -> str:
    """A checkpoint's identity: the SHA-256 of its completion marker, which lists every file's size and checksum
    (the same files give the same digest wherever they are copied)."""
    import hashlib

    return hashlib.sha256((Path(path) / MARKER).read_bytes()).hexdigest()


def reference_digest(info: dict, weights: str) -> str:
    """The starting checkpoint's identity: its completion marker (every file's size and checksum) and which of
    its weights were taken (a DPO run's reference, and the frozen base of its adapters)."""
    import hashlib

    return hashlib.sha256(f"{checkpoint_digest(info['path'])}:{weights}".encode()).hexdigest()
