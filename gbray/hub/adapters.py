"""Adapters on the hub's disk: whole bodies and 16 MB pieces, checked to their last byte before
they are kept.

A tgz must hold adapter_config.json and weights at its top (the field's client extracts it into a
folder and loads that folder), no member outside it, no links or special files; every member is
read through, so gzip's CRC and length are checked, and what it expands to is held to the size
limit while it is read (a small body can expand to gigabytes). A safetensors file's header must
parse and describe the bytes that follow. A complete adapter is never replaced (the same bytes
again are a retry); the `-last` checkpoint may be. Pieces belong to one upload: a new first piece
starts the upload over. Anything refused leaves nothing behind, and start-up clears what a crash
left. These calls block (disk, decompression): the server runs them off its event loop.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
import shutil
import struct
import tarfile
import tempfile
import zlib
from pathlib import Path

PIECE = 16 * 1024 * 1024
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
READ = 1024 * 1024
# The largest safetensors header the hub reads (the safetensors package allows 100 MB; a LoRA of
# a few thousand tensors needs well under 1 MB).
HEADER_LIMIT = 16 * 1024 * 1024
# safetensors dtypes and their sizes in bytes; the hub never imports torch or numpy, so the
# header is read here rather than with the safetensors package.
DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class Refused(Exception):
    """An upload the hub refuses; status is the HTTP code (400, 403, 409 or 413)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def safe_name(name: str) -> str:
    if not NAME.fullmatch(name or ""):
        raise Refused(400, f"bad adapter name {name[:60]!r}: letters, digits, - _ . (at most 128)")
    return name


def _check_member(member: tarfile.TarInfo) -> None:
    if member.issym() or member.islnk():
        raise Refused(400, f"link in adapter: {member.name[:200]}")
    if not (member.isfile() or member.isdir()):
        raise Refused(400, f"special file in adapter: {member.name[:200]}")
    if member.name.startswith(("/", "\\")) or ".." in Path(member.name).parts:
        # data_filter would quietly strip a leading slash; an absolute name is refused outright.
        raise Refused(400, f"member outside its folder: {member.name[:200]}")
    try:
        # tarfile's own filter judges paths (absolute, '..', outside the destination).
        tarfile.data_filter(member, "/adapter-root")
    except tarfile.FilterError as e:
        raise Refused(400, f"member outside its folder: {member.name[:200]} ({e})") from e


class _SafetensorsHeader:
    """Reads a safetensors file as it streams by and checks that its header parses and that its
    tensors fill exactly the bytes after it."""

    def __init__(self, size: int):
        self.size, self.head = size, b""

    def feed(self, chunk: bytes) -> None:
        if len(self.head) < 8 + HEADER_LIMIT:
            self.head += chunk[: 8 + HEADER_LIMIT - len(self.head)]

    def check(self) -> None:
        if self.size < 8 or len(self.head) < 8:
            raise Refused(400, "safetensors file too short for its header")
        (length,) = struct.unpack("<Q", self.head[:8])
        if length > self.size - 8:
            raise Refused(400, f"safetensors header of {length} bytes does not fit the file")
        if length > HEADER_LIMIT:
            raise Refused(
                413, f"safetensors header of {length} bytes is over the hub's {HEADER_LIMIT} bytes"
            )
        try:
            header = json.loads(self.head[8 : 8 + length])
        except (UnicodeDecodeError, ValueError) as e:
            raise Refused(400, f"safetensors header does not parse: {e}") from e
        if not isinstance(header, dict):
            raise Refused(400, "safetensors header is not an object")
        data = self.size - 8 - length
        spans = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
                count = math.prod(int(d) for d in shape)
                ok = dtype in DTYPES and 0 <= start <= end <= data
                ok = ok and end - start == count * DTYPES[dtype]
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise Refused(400, f"safetensors header: tensor {str(name)[:80]!r} is malformed")
            spans.append((start, end))
        covered = 0
        for start, end in sorted(spans):
            if start != covered:
                raise Refused(400, "safetensors header: tensors overlap or leave gaps")
            covered = end
        if covered != data:
            raise Refused(400, "safetensors header does not describe the bytes after it")


def check_tgz(path: Path, expand_limit: int = 1 << 40) -> list[str]:
    """The member names of a valid adapter tgz, read to its last byte, or Refused saying why."""
    names, top, expanded = [], set(), 0
    try:
        # A tar stream over GzipFile: GzipFile checks the CRC and length when it reaches the end.
        with gzip.open(path, "rb") as gz, tarfile.open(fileobj=gz, mode="r|") as tar:
            for member in tar:
                _check_member(member)
                names.append(member.name)
                expanded += tarfile.BLOCKSIZE + member.size
                if expanded > expand_limit:
                    raise Refused(413, f"adapter expands past the limit of {expand_limit} bytes")
                if not member.isfile():
                    continue
                parts = Path(member.name).parts
                if len(parts) == 1 or (len(parts) == 2 and parts[0] == "."):
                    top.add(parts[-1])
                tensors = (
                    _SafetensorsHeader(member.size) if parts[-1].endswith(".safetensors") else None
                )
                stream = tar.extractfile(member)
                while chunk := stream.read(READ):
                    if tensors:
                        tensors.feed(chunk)
                if tensors:
                    tensors.check()
            # Read the gzip stream to its end: only there are its CRC and length checked.
            while chunk := gz.read(READ):
                expanded += len(chunk)
                if expanded > expand_limit:
                    raise Refused(413, f"adapter expands past the limit of {expand_limit} bytes")
    except Refused:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise Refused(400, f"not a whole, readable tgz: {e}") from e
    if "adapter_config.json" not in top:
        raise Refused(400, "adapter has no adapter_config.json at the top of the tgz")
    if not top & set(WEIGHTS):
        raise Refused(
            400, "adapter has no weights (adapter_model.safetensors or .bin) at the top of the tgz"
        )
    return names


def sha256_of(path: Path) -> str:
    """A file's SHA-256, read a mebibyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ):
            h.update(chunk)
    return h.hexdigest()


class AdapterStore:
    def __init__(self, root: Path, size_limit: int = 512 * 1024 * 1024, piece: int = PIECE):
        self.root = Path(root)
        self.size_limit, self.piece = size_limit, piece
        (self.root / "adapters").mkdir(parents=True, exist_ok=True)
        (self.root / "pieces").mkdir(parents=True, exist_ok=True)
        self.clean()

    def clean(self) -> None:
        """Remove what a crash can leave: temporary files, and piece sets whose marker is unreadable."""
        for debris in [*self.root.glob("*.upload"), *self.root.glob("pieces/*/*.tmp")]:
            debris.unlink(missing_ok=True)
        for folder in (self.root / "pieces").iterdir():
            if self._marker(folder) is None:
                shutil.rmtree(folder, ignore_errors=True)

    def path(self, name: str) -> Path:
        return self.root / "adapters" / f"{safe_name(name)}.tgz"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def new_upload(self) -> tuple[int, Path]:
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".upload")
        return fd, Path(tmp)

    def keep(self, tmp: Path, name: str) -> int:
        """Check an uploaded file and keep it under `name`; the temporary file is gone after."""
        try:
            size = tmp.stat().st_size
            if size > self.size_limit:
                raise Refused(
                    413, f"adapter of {size} bytes is over the limit of {self.size_limit}"
                )
            target = self.path(name)
            if target.exists() and not name.endswith("-last"):
                if sha256_of(target) == sha256_of(tmp):
                    return size  # the same bytes again: a retry
                raise Refused(
                    409, f"adapter {name} is complete; a complete adapter is never replaced"
                )
            check_tgz(tmp, expand_limit=self.size_limit)
            os.replace(tmp, target)
            return size
        finally:
            tmp.unlink(missing_ok=True)

    # -- pieces -----------------------------------------------------------------------------------

    @staticmethod
    def _marker(folder: Path) -> dict | None:
        try:
            marker = json.loads((folder / "marker.json").read_text())
            return marker if isinstance(marker, dict) and {"of", "first"} <= set(marker) else None
        except (OSError, ValueError):
            return None

    def put_piece(self, name: str, index: int, of: int, body: bytes, by: str = "") -> dict:
        """Store piece `index` of `of` from token `by`; assemble and check when all are in. A
        piece 0 other than the stored one (other bytes, count or token) begins a new upload, and
        a later piece must come from the upload's token: the pieces of two uploads never mix."""
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
        marker = self._marker(folder)
        first = hashlib.sha256(body).hexdigest() if index == 0 else None
        upload = {"of": of, "first": first, "by": by}
        if index == 0 and marker != upload:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            tmp = folder / "marker.tmp"
            tmp.write_text(json.dumps(upload))
            os.replace(tmp, folder / "marker.json")  # never half-written
            marker = upload
        if marker is None:
            raise Refused(409, f"piece {index} of an upload to {name} that has no first piece")
        if marker["of"] != of:
            raise Refused(409, f"of={of} differs from this upload's of={marker['of']}")
        if marker.get("by", "") != by:
            raise Refused(409, f"piece {index} of another token's upload to {name}")
        # Each piece goes straight to its place in one file: every byte is written once.
        data = folder / "data.upload"
        with open(data, "r+b" if data.exists() else "wb") as out:
            out.seek(index * self.piece)
            out.write(body)
            if index == of - 1:
                out.truncate(index * self.piece + len(body))
            # On disk before it is acknowledged; and flushed piece by piece, the write-back of a
            # night's adapters never piles up in front of the notes' small writes.
            out.flush()
            os.fdatasync(out.fileno())
        (folder / f"{index}.done").touch()  # after the bytes: a piece cut short is sent again
        have = sum(1 for i in range(of) if (folder / f"{i}.done").is_file())
        if have < of:
            return {"stored": index, "have": have, "of": of, "complete": False}
        try:
            size = self.keep(data, name)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {"stored": index, "have": of, "of": of, "complete": True, "size": size}
