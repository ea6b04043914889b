"""The hub's SQLite store: corpus, rounds, notes, checks, baselines, tokens, serving.

WAL, a busy timeout, every write in a transaction; a connection per call, so the server's worker
threads never share one. Adapters live as files under the store folder; only their names are here.
Imports nothing of torch: the hub runs on a machine without it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from gbray.data.sampler import draw
from gbray.data.turns import BadLines, parse_turn
from gbray.hub.gate import Candidate, GateRules, Serving, judged_rows, refusal
from gbray.paired import fallen_tools, pair

SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY, split TEXT NOT NULL, job TEXT, tool TEXT NOT NULL, tier TEXT NOT NULL,
    line TEXT NOT NULL, taken_by TEXT, taken_at REAL);
CREATE INDEX IF NOT EXISTS turns_split ON turns(split, taken_by);
CREATE TABLE IF NOT EXISTS corpus (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS tokens (name TEXT PRIMARY KEY, hash TEXT UNIQUE NOT NULL, owner INTEGER NOT NULL,
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    id TEXT PRIMARY KEY, device TEXT, base TEXT, turns INTEGER, recipe TEXT, status TEXT NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, ended REAL, baseline REAL, result REAL, adapter TEXT,
    paper TEXT, why TEXT, trained INTEGER, draw_seed INTEGER, end_body TEXT, stop INTEGER DEFAULT 0,
    token TEXT);
CREATE TABLE IF NOT EXISTS notes (seq INTEGER PRIMARY KEY AUTOINCREMENT, round TEXT NOT NULL, line TEXT,
    at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS notes_round ON notes(round, seq);
CREATE TABLE IF NOT EXISTS checks (seq INTEGER PRIMARY KEY AUTOINCREMENT, round TEXT NOT NULL, step INTEGER,
    turns INTEGER, val_loss REAL, train_loss REAL, best REAL, lr REAL, at REAL NOT NULL,
    val_agreement REAL, phase TEXT);
CREATE TABLE IF NOT EXISTS baselines (
    scope TEXT, base TEXT, paper TEXT, turns INTEGER, answer INTEGER, student TEXT, value REAL, by TEXT,
    claimed REAL, body TEXT, PRIMARY KEY (scope, base, paper, turns, answer, student));
CREATE TABLE IF NOT EXISTS serving (seq INTEGER PRIMARY KEY AUTOINCREMENT, round TEXT NOT NULL,
    adapter TEXT NOT NULL, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (seq INTEGER PRIMARY KEY AUTOINCREMENT, round TEXT NOT NULL,
    at REAL NOT NULL, promoted INTEGER NOT NULL, by TEXT NOT NULL, why TEXT NOT NULL);
"""


def _small_count(value) -> int | None:
    return value if isinstance(value, int) and 0 <= value <= 64 else None


def shares_of(row: dict, token_of: dict[str, str]) -> None:
    """A share names its merge round and a merge how many shares it joins, as the device's
    recipe says; a share's merge counts only if the same token registered it (a device must not
    put its rounds beside another's). The token's name leaves the row."""
    row["share"], row["merge_of"] = _small_count(row["share"]), _small_count(row["merge_of"])
    merge, token = row["share_of"], row.pop("token")
    same = isinstance(merge, str) and token is not None and token_of.get(merge) == token
    row["share_of"] = merge if same and row["share"] is not None else None


class Conflict(Exception):
    """A request the hub refuses with 409, with the reason."""


class NotFound(Exception):
    pass


class Forbidden(Exception):
    """A token writing what is not its own (403)."""


# Who is calling: the token's name and whether it is an owner's.
Caller = tuple[str, bool]


# How long the server reuses a token's answer (gbray.hub.server.Gate): a revocation is in force
# this long after it is written.
TOKEN_SECONDS = 5.0


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A URL-safe secret that never begins with "-": devices pass it as `--token VALUE`, and
    argparse takes a value beginning with "-" for a flag (1 token in 64 would otherwise be)."""
    while (token := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return token


class Store:
    def __init__(self, path: Path, claim_timeout: float = 600.0, rules: GateRules | None = None):
        self.path = Path(path)
        self.rules = rules or GateRules()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.claim_timeout = claim_timeout
        self._local = threading.local()
        self._deciding = threading.Lock()
        with self.connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            # Columns added since the first hubs; their databases gain them on start.
            for table, column, kind in (
                ("baselines", "body", "TEXT"),
                ("rounds", "token", "TEXT"),
                ("checks", "val_agreement", "REAL"),
                ("checks", "phase", "TEXT"),
            ):
                names = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in names:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    @contextmanager
    def connect(self):
        """This thread's connection (one per thread: the server's workers never share one, and
        opening one per call was a large part of a note's time)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA busy_timeout=30000")
            # With WAL, NORMAL keeps the database consistent through any crash; only a power
            # loss can drop the last commits. FULL synced every note to disk.
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        yield db

    @contextmanager
    def transaction(self):
        """BEGIN IMMEDIATE: concurrent writers queue up instead of interleaving."""
        with self.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    # -- tokens ---------------------------------------------------------------------------------

    def add_token(self, name: str, owner: bool) -> str:
        token = new_token()
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO tokens VALUES (?, ?, ?, ?)",
                (name, hash_token(token), int(owner), time.time()),
            )
        return token

    def tokens(self) -> list[dict]:
        """Every token's name, whether it is an owner's, and when it was made (never the token:
        only its hash is kept)."""
        with self.connect() as db:
            rows = db.execute("SELECT name, owner, created FROM tokens ORDER BY created").fetchall()
        return [
            {"name": r["name"], "owner": bool(r["owner"]), "created": r["created"]} for r in rows
        ]

    def revoke_token(self, name: str) -> bool:
        """Forget the token named `name`; returns whether there was one. The rounds it
        registered stay; a token added later under the name may write them again."""
        with self.transaction() as db:
            return db.execute("DELETE FROM tokens WHERE name = ?", (name,)).rowcount > 0

    def who(self, token: str) -> tuple[str, bool] | None:
        with self.connect() as db:
            row = db.execute(
                "SELECT name, owner FROM tokens WHERE hash = ?", (hash_token(token),)
            ).fetchone()
        return (row["name"], bool(row["owner"])) if row else None

    # -- corpus ---------------------------------------------------------------------------------

    def load(self, train: Path, evaluation: Path) -> dict:
        """Load a corpus; the eval file is cut by job from train (a job in both is kept in eval only)."""
        bad = BadLines()
        rows: dict[str, list] = {"train": [], "eval": []}
        for split, path in (("eval", evaluation), ("train", train)):
            with open(path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    turn = parse_turn(raw, f"{path.name}:{number}", bad)
                    if turn is None:
                        continue
                    rows[split].append(
                        (split, turn["job"], turn["tool"], turn["tier"], raw.decode().strip())
                    )
        eval_jobs = {r[1] for r in rows["eval"]}
        dropped = sum(1 for r in rows["train"] if r[1] in eval_jobs)
        rows["train"] = [r for r in rows["train"] if r[1] not in eval_jobs]
        scope = (
            "hub-"
            + hashlib.sha256(json.dumps([r[4] for r in rows["eval"]]).encode()).hexdigest()[:12]
        )
        with self.transaction() as db:
            db.execute("DELETE FROM turns")
            db.executemany(
                "INSERT INTO turns (split, job, tool, tier, line) VALUES (?, ?, ?, ?, ?)",
                rows["eval"] + rows["train"],
            )
            db.execute("INSERT OR REPLACE INTO corpus VALUES ('scope', ?)", (scope,))
        return {
            "train": len(rows["train"]),
            "eval": len(rows["eval"]),
            "scope": scope,
            "train_dropped_for_eval_jobs": dropped,
            "bad_lines": bad.as_dict(),
        }

    def scope(self) -> str:
        with self.connect() as db:
            row = db.execute("SELECT value FROM corpus WHERE key = 'scope'").fetchone()
        return row["value"] if row else "hub-empty"

    def take_slice(self, want: int, device: str, seed: int) -> list[str]:
        """Draw at most `want` untaken train turns with the shared sampler and mark them taken by
        device. Only what is untaken is drawn from: marks are cleared by the owner, never by a
        device's request (`gbray hub marks clear`)."""
        with self.transaction() as db:
            rows = db.execute(
                "SELECT id, tool, tier FROM turns WHERE split = 'train' AND taken_by IS NULL "
                "ORDER BY id"
            ).fetchall()
            picked = draw([r["tool"] for r in rows], [r["tier"] for r in rows], want, seed=seed)
            ids = [rows[i]["id"] for i in picked]
            now = time.time()
            db.executemany(
                "UPDATE turns SET taken_by = ?, taken_at = ? WHERE id = ?",
                [(device, now, i) for i in ids],
            )
            lines = {}
            for chunk in range(0, len(ids), 500):
                part = ids[chunk : chunk + 500]
                marks = ",".join("?" * len(part))
                for r in db.execute(f"SELECT id, line FROM turns WHERE id IN ({marks})", part):
                    lines[r["id"]] = r["line"]
        return [lines[i] for i in ids]

    def clear_marks(self) -> int:
        """The owner's act: every train turn is untaken again (a new pass over the corpus)."""
        with self.transaction() as db:
            return db.execute(
                "UPDATE turns SET taken_by = NULL, taken_at = NULL WHERE taken_by IS NOT NULL"
            ).rowcount

    def paper(self, turns: int) -> tuple[list[str], str, str]:
        with self.connect() as db:
            lines = [
                r["line"]
                for r in db.execute(
                    "SELECT line FROM turns WHERE split = 'eval' ORDER BY id LIMIT ?", (turns,)
                )
            ]
        paper_id = "p-" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]
        return lines, paper_id, self.scope()

    def coverage(self) -> dict:
        with self.connect() as db:
            total = db.execute("SELECT COUNT(*) FROM turns WHERE split = 'train'").fetchone()[0]
            taken = db.execute(
                "SELECT COUNT(*) FROM turns WHERE split = 'train' AND taken_by IS NOT NULL"
            ).fetchone()[0]
            trained = db.execute(
                "SELECT COALESCE(SUM(trained), 0) FROM rounds WHERE ended IS NOT NULL"
            ).fetchone()[0]
        # Counted from what rounds report they trained, not from what they were handed.
        return {
            "corpus": total,
            "handed_out": taken,
            "trained": min(trained, total) if total else trained,
            "share": round(trained / total, 4) if total else 0.0,
        }

    # -- rounds ---------------------------------------------------------------------------------

    def register(self, device: str, base: str, turns: int, recipe: dict, who: Caller) -> str:
        """A new round, owned by the token that registered it."""
        round_id = time.strftime("r%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO rounds (id, device, base, turns, recipe, status, created, updated, token) "
                "VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?)",
                (round_id, device, base, turns, json.dumps(recipe), now, now, who[0]),
            )
        return round_id

    def _own(self, db, round_id: str, who: Caller) -> sqlite3.Row:
        """The round's row, if `who` may write it: the token that registered it, or an owner."""
        row = db.execute(
            "SELECT stop, token, ended, end_body FROM rounds WHERE id = ?", (round_id,)
        ).fetchone()
        if row is None:
            raise NotFound(f"no round {round_id}")
        if not who[1] and row["token"] != who[0]:
            raise Forbidden(f"round {round_id} belongs to another token")
        return row

    def writable(self, round_id: str, who: Caller) -> None:
        """Raises unless `who` may write the round (checked before an upload is read)."""
        with self.connect() as db:
            self._own(db, round_id, who)

    def _touch(self, db, round_id: str, who: Caller) -> bool:
        """Mark the round alive; returns whether the owner asked it to stop."""
        row = self._own(db, round_id, who)
        db.execute("UPDATE rounds SET updated = ? WHERE id = ?", (time.time(), round_id))
        return bool(row["stop"])

    def note(self, round_id: str, line: str, who: Caller) -> bool:
        with self.transaction() as db:
            stop = self._touch(db, round_id, who)
            db.execute(
                "INSERT INTO notes (round, line, at) VALUES (?, ?, ?)",
                (round_id, line, time.time()),
            )
        return stop

    def check(self, round_id: str, point: dict, who: Caller) -> bool:
        with self.transaction() as db:
            stop = self._touch(db, round_id, who)
            db.execute(
                "INSERT INTO checks (round, step, turns, val_loss, train_loss, best, lr, at, "
                "val_agreement, phase) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    round_id,
                    point.get("step"),
                    point.get("turns"),
                    point.get("valLoss"),
                    point.get("trainLoss"),
                    None if point.get("best") is None else int(bool(point["best"])),
                    point.get("lr"),
                    time.time(),
                    point.get("valAgreement"),
                    point.get("phase"),
                ),
            )
        return stop

    def stopping(self, round_id: str) -> bool:
        with self.connect() as db:
            row = db.execute("SELECT stop FROM rounds WHERE id = ?", (round_id,)).fetchone()
        if row is None:
            raise NotFound(f"no round {round_id}")
        return bool(row["stop"])

    def end(self, round_id: str, body: dict, who: Caller) -> bool:
        """Store a round's end, once; `baseline` and `result` are exam objects (`agreement_pct`)
        or None. The same end again is a retry and changes nothing (returns False); another end
        is refused."""

        def agreement(exam: dict | None) -> float | None:
            return float(exam["agreement_pct"]) if exam else None

        text = json.dumps(body, sort_keys=True)
        with self.transaction() as db:
            row = self._own(db, round_id, who)
            if row["ended"] is not None:
                if row["end_body"] == text:
                    return False
                raise Conflict(f"round {round_id} has already ended; a round ends once")
            db.execute(
                "UPDATE rounds SET updated = ?, status = ?, ended = ?, baseline = ?, result = ?, adapter = ?, paper = ?,"
                " why = ?, trained = ?, draw_seed = ?, end_body = ? WHERE id = ?",
                (
                    time.time(),
                    body.get("status", "done"),
                    time.time(),
                    agreement(body.get("baseline")),
                    agreement(body.get("result")),
                    body.get("adapter"),
                    body.get("paper"),
                    body.get("why"),
                    int(body.get("trained") or 0),
                    body.get("drawSeed"),
                    text,
                    round_id,
                ),
            )
        return True

    def request_stop(self, round_id: str) -> None:
        with self.transaction() as db:
            if db.execute("UPDATE rounds SET stop = 1 WHERE id = ?", (round_id,)).rowcount == 0:
                raise NotFound(f"no round {round_id}")

    def round(self, round_id: str) -> dict:
        with self.connect() as db:
            row = db.execute("SELECT * FROM rounds WHERE id = ?", (round_id,)).fetchone()
            if row is None:
                raise NotFound(f"no round {round_id}")
            out = dict(row)
            out["recipe"] = json.loads(out["recipe"] or "{}")
            out["end_body"] = json.loads(out["end_body"]) if out["end_body"] else None
            out.update(self._compared(out["end_body"]))
            out["notes"] = [
                dict(r)
                for r in db.execute(
                    "SELECT seq, line, at FROM notes WHERE round = ? ORDER BY seq", (round_id,)
                )
            ]
            out["checks"] = [
                {**dict(r), "best": None if r["best"] is None else bool(r["best"])}
                for r in db.execute(
                    "SELECT step, turns, val_loss AS valLoss, train_loss AS trainLoss, best, lr, at, "
                    "val_agreement AS valAgreement, phase FROM checks "
                    "WHERE round = ? ORDER BY seq",
                    (round_id,),
                )
            ]
        return out

    def state(self) -> dict:
        with self.connect() as db:
            rounds = [
                dict(r)
                for r in db.execute(
                    "SELECT id, device, base, turns, status, created, updated, ended, baseline, result, adapter, "
                    "paper, why, trained, stop, json_extract(recipe, '$.student') AS student, "
                    "json_extract(recipe, '$.start') AS start, json_extract(recipe, '$.trial') AS trial, "
                    "json_extract(recipe, '$.share') AS share, json_extract(recipe, '$.share_of') AS share_of, "
                    "json_extract(recipe, '$.merge_of') AS merge_of, token, "
                    "json_extract(end_body, '$.baseline.marks') AS before_marks, "
                    "json_extract(end_body, '$.result.marks') AS after_marks "
                    "FROM rounds "
                    "ORDER BY created DESC"
                )
            ]
        token_of = {r["id"]: r["token"] for r in rounds}
        for r in rounds:
            paired = pair(r.pop("before_marks"), r.pop("after_marks"))
            r["p_value"] = paired.p_value if paired else None
            shares_of(r, token_of)
        return {
            "rounds": rounds,
            "coverage": self.coverage(),
            "serving": self.serving(),
            "decisions": self.decisions(),
            "tools_served": self.tools_served(),
        }

    def _compared(self, body: dict | None) -> dict:
        """The hub's own paired counts (from the marks) and fallen tools (by its rules)."""
        body = body if isinstance(body, dict) else {}
        exams = [
            body.get(k) if isinstance(body.get(k), dict) else {} for k in ("baseline", "result")
        ]
        paired = pair(exams[0].get("marks"), exams[1].get("marks"))
        return {
            "paired": asdict(paired) if paired else None,
            "fell": fallen_tools(judged_rows(body), self.rules.fall_rule()),
        }

    # -- baselines ------------------------------------------------------------------------------

    def _device_alive(self, db, device: str, since: float) -> bool:
        row = db.execute("SELECT MAX(updated) FROM rounds WHERE device = ?", (device,)).fetchone()
        return max(row[0] or 0.0, since) > time.time() - self.claim_timeout

    def ask_baseline(self, key: tuple, device: str) -> dict:
        """Known: the exam object. Unknown and unclaimed (or its claimant went silent): the asker
        measures. Claimed by a live device: that device measures; train at once, read it at the end.
        Answers the field's shapes: `{known: true, baseline: {agreement_pct, turns}, by}` or
        `{known: false, measure, by}`."""
        with self.transaction() as db:
            row = db.execute(
                "SELECT value, by, claimed, body FROM baselines WHERE scope = ? AND base = ? "
                "AND paper = ? AND turns = ? AND answer = ? AND student = ?",
                key,
            ).fetchone()
            if row and row["value"] is not None:
                exam = json.loads(row["body"]) if row["body"] else {}
                exam = {**exam, "agreement_pct": row["value"], "turns": exam.get("turns", key[3])}
                return {"known": True, "baseline": exam, "by": row["by"]}
            if row and row["by"] != device and self._device_alive(db, row["by"], row["claimed"]):
                return {"known": False, "measure": False, "by": row["by"]}
            db.execute(
                "INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?, NULL)",
                (*key, device, time.time()),
            )
            return {"known": False, "measure": True, "by": device}

    def tell_baseline(self, key: tuple, exam: dict, device: str) -> None:
        """Keep a measured baseline: the exam object as told (`agreement_pct`, `turns`, ...)."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*key, float(exam["agreement_pct"]), device, time.time(), json.dumps(exam)),
            )

    # -- promotion ------------------------------------------------------------------------------

    def promote(
        self, round_id: str, adapter_name: str, adapter_exists: bool, by: str = "owner"
    ) -> dict:
        """Put the round's adapter into service, or refuse (Conflict) naming the rule. Either way
        the decision is kept (`decisions`: the history the status page draws)."""
        try:
            serving = self._promote(round_id, adapter_name, adapter_exists)
        except Conflict as e:
            self._decide(round_id, False, by, str(e))
            raise
        self._decide(round_id, True, by, "it passed the gate")
        return serving

    def auto_promote(self, round_id: str) -> dict | None:
        """`gbray hub serve --auto-promote`: a round that ended done with a baseline and a
        result, its adapter on the hub, is put to the gate once (trials, measurements and shares
        are not candidates). The decision is kept and noted on the round; returns it, or None for a
        non-candidate or a round already decided."""
        with self.connect() as db:
            row = db.execute(
                "SELECT status, result, baseline FROM rounds WHERE id = ?", (round_id,)
            ).fetchone()
        if row is None or row["status"] != "done" or None in (row["result"], row["baseline"]):
            return None
        with self._deciding:  # its end and its adapter may land at once: one decision
            with self.connect() as db:
                if db.execute("SELECT 1 FROM decisions WHERE round = ?", (round_id,)).fetchone():
                    return None
            return self._auto_decide(round_id)

    def _auto_decide(self, round_id: str) -> dict:
        try:
            self.promote(round_id, round_id, True, by="auto")
            decision = {"promoted": True, "why": "it passed the gate"}
            line = "hub: promoted automatically; it passed the gate and serves now"
        except Conflict as e:
            decision = {"promoted": False, "why": str(e)}
            line = f"hub: not promoted: {e}"
        with self.transaction() as db:
            db.execute(
                "INSERT INTO notes (round, line, at) VALUES (?, ?, ?)",
                (round_id, line, time.time()),
            )
        return decision

    def _decide(self, round_id: str, promoted: bool, by: str, why: str) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO decisions (round, at, promoted, by, why) VALUES (?, ?, ?, ?, ?)",
                (round_id, time.time(), int(promoted), by, why),
            )

    def decisions(self, last: int = 200) -> list[dict]:
        """The newest promotions and refusals, oldest first: round, when, promoted, by whom
        (owner or auto), why (a refusal's reason starts with its rule), and the round's paper
        and result (what the page draws over time)."""
        with self.connect() as db:
            rows = db.execute(
                "SELECT d.round, d.at, d.promoted, d.by, d.why, r.paper, r.result "
                "FROM decisions d JOIN rounds r ON r.id = d.round ORDER BY d.seq DESC LIMIT ?",
                (last,),
            ).fetchall()
        return [{**dict(r), "promoted": bool(r["promoted"])} for r in reversed(rows)]

    def tools_served(self) -> dict:
        """Per tool, what serves now against what served before it (each as its own round's
        exam had it: right/asked), for the page."""
        with self.connect() as db:
            rows = db.execute(
                "SELECT s.round, r.end_body FROM serving s JOIN rounds r ON r.id = s.round "
                "ORDER BY s.seq DESC LIMIT 2"
            ).fetchall()
        tables = []
        for row in rows:
            body = json.loads(row["end_body"]) if row["end_body"] else {}
            table = body.get("perTool") if isinstance(body, dict) else None
            tables.append(table if isinstance(table, dict) else {})
        now, before = (tables + [{}, {}])[:2]
        out = {}
        for tool in sorted(set(now) | set(before))[:200]:
            a, b = now.get(tool), before.get(tool)
            out[tool] = {
                "now": a.get("after") if isinstance(a, dict) else None,
                "before": b.get("after") if isinstance(b, dict) else None,
            }
        return {"rounds": [r["round"] for r in rows], "tools": out}

    def _promote(self, round_id: str, adapter_name: str, adapter_exists: bool) -> dict:
        with self.transaction() as db:
            row = db.execute("SELECT * FROM rounds WHERE id = ?", (round_id,)).fetchone()
            if row is None:
                raise NotFound(f"no round {round_id}")
            candidate = Candidate(
                round=round_id,
                status=row["status"],
                ended=row["ended"] is not None,
                paper=row["paper"],
                baseline=row["baseline"],
                result=row["result"],
                end_body=json.loads(row["end_body"]) if row["end_body"] else {},
            )
            reason = refusal(candidate, self._serving_on(db, row["paper"]), self.rules)
            if reason:
                raise Conflict(reason)
            if not adapter_exists:
                raise Conflict(f"round {round_id} has no adapter on the hub")
            db.execute(
                "INSERT INTO serving (round, adapter, since) VALUES (?, ?, ?)",
                (round_id, adapter_name, time.time()),
            )
        return self.serving()

    def _serving_on(self, db, paper: str | None) -> Serving | None:
        """What serves now, with its score on `paper`: its own round's result if it sat that
        paper, else a round or trial that started from it there (a trial's result, a round's
        baseline), else a baseline told for it there."""
        now = db.execute(
            "SELECT s.round, s.adapter, r.paper, r.result FROM serving s "
            "JOIN rounds r ON r.id = s.round ORDER BY s.seq DESC LIMIT 1"
        ).fetchone()
        if now is None:
            return None
        if paper and now["paper"] == paper and now["result"] is not None:
            return Serving(now["round"], now["result"], f"its own result on {paper}")
        names = (f"hub:{now['adapter']}", now["adapter"])
        row = db.execute(
            "SELECT id, CASE WHEN json_extract(recipe, '$.trial') THEN result ELSE baseline END "
            "AS score, json_extract(recipe, '$.trial') AS trial FROM rounds "
            "WHERE paper = ? AND status = 'done' AND json_extract(recipe, '$.start') IN (?, ?) "
            "AND score IS NOT NULL ORDER BY ended DESC LIMIT 1",
            (paper, *names),
        ).fetchone()
        if row is not None:
            how = "trial" if row["trial"] else "baseline of round"
            return Serving(now["round"], row["score"], f"{how} {row['id']} on {paper}")
        told = db.execute(
            "SELECT value, by FROM baselines WHERE paper = ? AND base IN (?, ?) "
            "AND value IS NOT NULL ORDER BY claimed DESC LIMIT 1",
            (paper, *names),
        ).fetchone()
        if told is not None:
            return Serving(now["round"], told["value"], f"baseline told by {told['by']} on {paper}")
        return Serving(now["round"], None, None)

    def serving(self) -> dict | None:
        with self.connect() as db:
            row = db.execute(
                "SELECT s.round, s.adapter, s.since, r.baseline, r.result, r.paper FROM serving s "
                "JOIN rounds r ON r.id = s.round ORDER BY s.seq DESC LIMIT 1"
            ).fetchone()
        return dict(row) if row else None
