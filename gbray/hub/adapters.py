"""Adapters on the hub's disk: whole bodies and 16 MB pieces, checked before they are kept.

A piece sent twice is stored once; pieces are assembled only when all are in; the assembled tgz
must open, hold adapter_config.json and weights at its top, have no member outside it, no links,
and stay under the size limit. Anything refused leaves nothing behind.
"""

from __future__ import annotations

import math
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

PIECE = 16 * 1024 * 1024
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class Refused(Exception):
    """An upload the hub refuses; status is the HTTP code (400 or 413)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def check_tgz(path: Path) -> list[str]:
    """The member names of a valid adapter tgz, or Refused(400) saying what is wrong."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise Refused(400, f"not a readable tgz: {e}") from e
    root = Path("/adapter-root")
    for m in members:
        if m.issym() or m.islnk():
            raise Refused(400, f"link in adapter: {m.name}")
        if not (m.isfile() or m.isdir()):
            raise Refused(400, f"special file in adapter: {m.name}")
        if m.name.startswith(("/", "\\")) or ".." in Path(m.name).parts:
            # data_filter would quietly strip a leading slash; an absolute name is refused outright.
            raise Refused(400, f"member outside its folder: {m.name}")
        try:
            # tarfile's own filter judges paths (absolute, '..', outside the destination).
            tarfile.data_filter(m, str(root))
        except tarfile.FilterError as e:
            raise Refused(400, f"member outside its folder: {m.name} ({e})") from e
    # The field's client extracts the tgz and loads the folder itself: the files sit at the top.
    top = {Path(m.name).name for m in members if m.isfile() and len(Path(m.name).parts) == 1}
    if "adapter_config.json" not in top:
        raise Refused(400, "adapter has no adapter_config.json at the top of the tgz")
    if not top & set(WEIGHTS):
        raise Refused(
            400, "adapter has no weights (adapter_model.safetensors or .bin) at the top of the tgz"
        )
    return [m.name for m in members]


def safe_name(name: str) -> str:
    if (
        not name
        or any(
            c not in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_."
            for c in name
        )
        or name.startswith(".")
    ):
        raise Refused(400, f"bad adapter name {name!r}")
    return name


class AdapterStore:
    def __init__(self, root: Path, size_limit: int = 512 * 1024 * 1024, piece: int = PIECE):
        self.root = Path(root)
        self.size_limit, self.piece = size_limit, piece
        (self.root / "adapters").mkdir(parents=True, exist_ok=True)
        (self.root / "pieces").mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / "adapters" / f"{safe_name(name)}.tgz"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def _keep(self, tmp: Path, name: str) -> int:
        try:
            size = tmp.stat().st_size
            if size > self.size_limit:
                raise Refused(
                    413, f"adapter of {size} bytes is over the limit of {self.size_limit}"
                )
            check_tgz(tmp)
            os.replace(tmp, self.path(name))
            return size
        finally:
            tmp.unlink(missing_ok=True)

    def put_whole(self, name: str, chunks) -> int:
        """Store a whole body streamed as byte chunks; refused past the limit without reading on."""
        safe_name(name)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".upload")
        size = 0
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                size += len(chunk)
                if size > self.size_limit:
                    f.close()
                    Path(tmp).unlink(missing_ok=True)
                    raise Refused(413, f"adapter body over the limit of {self.size_limit} bytes")
                f.write(chunk)
        return self._keep(Path(tmp), name)

    def put_piece(self, name: str, index: int, of: int, body: bytes) -> dict:
        """Store piece `index` of `of`; assemble and check when all are in."""
        safe_name(name)
        most = max(1, math.ceil(self.size_limit / self.piece))
        if of < 1 or of > most:
            raise Refused(413 if of > most else 400, f"of={of}: an adapter has 1 to {most} pieces")
        if not 0 <= index < of:
            raise Refused(400, f"chunk={index} is outside 0..{of - 1}")
        if not 0 < len(body) <= self.piece:
            raise Refused(400, f"a piece holds 1 to {self.piece} bytes, this one {len(body)}")
        if index < of - 1 and len(body) != self.piece:
            raise Refused(
                400,
                f"piece {index} of {of} must be {self.piece} bytes (only the last may be short)",
            )
        folder = self.root / "pieces" / name
        folder.mkdir(exist_ok=True)
        marker = folder / "of"
        if marker.exists() and int(marker.read_text()) != of:
            raise Refused(400, f"of={of} differs from this upload's of={marker.read_text()}")
        marker.write_text(str(of))
        tmp = folder / f"{index}.tmp"
        tmp.write_bytes(body)
        os.replace(tmp, folder / f"{index}.part")  # a repeated piece replaces itself
        have = sorted(int(p.stem) for p in folder.glob("*.part"))
        if len(have) < of:
            return {"stored": index, "have": len(have), "of": of, "complete": False}
        fd, assembled = tempfile.mkstemp(dir=self.root, suffix=".upload")
        try:
            with os.fdopen(fd, "wb") as out:
                for i in range(of):
                    with open(folder / f"{i}.part", "rb") as part:
                        shutil.copyfileobj(part, out)
            size = self._keep(Path(assembled), name)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {"stored": index, "have": of, "of": of, "complete": True, "size": size}
