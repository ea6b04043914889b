"""A hub's backup and restore: its SQLite database through SQLite's online backup API (a consistent
copy while the hub serves and writes), then its complete adapters, each with its SHA-256 so a
restore can tell a damaged copy.

The database is copied first: an ended round's adapter landed before its end, so every adapter the
copy names is already on disk when the adapters are copied. Adapters that land later are copied
too when they are there (a complete adapter is never replaced); pieces of uploads still under way
are not (their device sends them again). A `-last` checkpoint may be replaced while it is read:
the hub replaces it by a rename, so the open file is the old one, whole.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import time
from pathlib import Path

from gbray.hub.adapters import sha256_of

log = logging.getLogger(__name__)

MANIFEST = "backup.json"
DB_NAME = "hub.db"


class BackupError(ValueError):
    """A backup or restore that cannot be done (its reason is the message)."""


def _copy_database(source: Path, target: Path) -> None:
    src = sqlite3.connect(source, timeout=30.0)
    dst = sqlite3.connect(target)
    try:
        with dst:
            src.backup(dst)
        check = dst.execute("PRAGMA integrity_check").fetchone()[0]
        if check != "ok":
            raise BackupError(f"the copy of {source} failed SQLite's integrity check: {check}")
    finally:
        src.close()
        dst.close()


def _copy_adapters(source: Path, target: Path) -> dict[str, str]:
    """Every complete adapter under `source`/adapters copied to `target`/adapters; returns
    each file's name and SHA-256 (of the copy, read back)."""
    (target / "adapters").mkdir(parents=True, exist_ok=True)
    digests = {}
    for path in sorted((source / "adapters").glob("*.tgz")):
        copy = target / "adapters" / path.name
        tmp = copy.with_suffix(".partial")
        try:
            shutil.copyfile(path, tmp)
        except FileNotFoundError:
            continue  # a -last checkpoint between its removal and its replacement
        tmp.replace(copy)
        digests[path.name] = sha256_of(copy)
    return digests


def _rounds(db: Path) -> dict:
    con = sqlite3.connect(db)
    try:
        ended = con.execute("SELECT count(*) FROM rounds WHERE ended IS NOT NULL").fetchone()[0]
        total = con.execute("SELECT count(*) FROM rounds").fetchone()[0]
    finally:
        con.close()
    return {"rounds": total, "ended": ended}


def backup(db: Path, store: Path, to: Path) -> dict:
    """Copy a hub (its database `db`, its adapter folder `store`) into the new folder `to`,
    while it serves. Returns what backup.json says: when, the rounds, every adapter's digest."""
    db, store, to = Path(db), Path(store), Path(to)
    if not db.is_file():
        raise BackupError(f"no hub database at {db}")
    if not (store / "adapters").is_dir():
        raise BackupError(f"no hub adapter folder at {store} (expected {store / 'adapters'})")
    if to.exists() and any(to.iterdir()):
        raise BackupError(f"{to} is not empty: a backup goes into a new folder")
    to.mkdir(parents=True, exist_ok=True)
    began = time.time()
    _copy_database(db, to / DB_NAME)
    log.info("database copied (%s)", db)
    adapters = _copy_adapters(store, to / "store")
    log.info("%d adapters copied", len(adapters))
    manifest = {
        "began": began,
        "took_seconds": round(time.time() - began, 2),
        "db": str(db.resolve()),
        "store": str(store.resolve()),
        **_rounds(to / DB_NAME),
        "adapters": adapters,
    }
    (to / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def restore(source: Path, db: Path, store: Path) -> dict:
    """Restore a backup folder into a hub database `db` and adapter folder `store` that do not
    exist yet (a restore never overwrites a hub); every adapter is checked against its digest."""
    source, db, store = Path(source), Path(db), Path(store)
    try:
        manifest = json.loads((source / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise BackupError(
            f"{source} is not a gbray hub backup (no readable {MANIFEST}): {e}"
        ) from e
    if db.exists():
        raise BackupError(f"{db} exists: restore into a new database file")
    if store.exists() and any(store.iterdir()):
        raise BackupError(f"{store} is not empty: restore into a new adapter folder")
    for name, digest in manifest["adapters"].items():
        path = source / "store" / "adapters" / name
        if not path.is_file() or sha256_of(path) != digest:
            raise BackupError(f"the backup's adapter {name} is missing or damaged")
    db.parent.mkdir(parents=True, exist_ok=True)
    _copy_database(source / DB_NAME, db)
    _copy_adapters(source / "store", store)
    (store / "pieces").mkdir(exist_ok=True)
    return {"restored": str(source), "db": str(db), "store": str(store), **_rounds(db),
            "adapters": len(manifest["adapters"])}  # fmt: skip
