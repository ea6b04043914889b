"""Reading turns: the tool read off a raw line, an index of offsets, parsing only what is kept.

A real corpus is 141 MB; parsing all of it into dicts beside a model is what killed early rounds.
So a folder is indexed once on raw bytes (offset, tool, tier, job per line) and only the lines a
slice keeps are parsed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# The assistant content is escaped JSON inside the line: {\"tool\":\"NAME\" ...
_RAW_TOOL = re.compile(rb'\\"tool\\"\s*:\s*\\"([^"\\]+)\\"')
_RAW_TIER = re.compile(rb'"tier"\s*:\s*"([a-z]+)"')
_RAW_JOB = re.compile(rb'"job"\s*:\s*"([^"]*)"')
# An answer's tool: the first complete "tool": "NAME" it contains.
_ANSWER_TOOL = re.compile(r'"tool"\s*:\s*"([^"\\]+)"')


class DataError(Exception):
    """The data cannot be used at all (missing, empty, unreadable): a one-line reason."""


def tool_of_answer(text: str) -> str | None:
    match = _ANSWER_TOOL.search(text)
    return match.group(1) if match else None


def tool_of_raw_line(line: bytes) -> str | None:
    match = _RAW_TOOL.search(line)
    return match.group(1).decode("utf-8", "replace") if match else None


@dataclass
class BadLines:
    """Bad lines by reason; reported, never fatal."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.examples.setdefault(reason, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        return {"total": self.total, "by_reason": dict(self.counts), "first": self.examples}


@dataclass
class TurnIndex:
    """Where each usable line of one JSON Lines file starts, with what the raw line tells."""

    path: Path
    offsets: list[int]
    tools: list[str]
    tiers: list[str]
    jobs: list[str]
    bad: BadLines

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, positions: list[int]) -> list[dict]:
        """Parse the turns at these positions of the index; lines that fail are counted as bad."""
        turns = []
        with open(self.path, "rb") as f:
            for pos in positions:
                f.seek(self.offsets[pos])
                turn = parse_turn(f.readline(), f"{self.path.name}@{self.offsets[pos]}", self.bad)
                if turn is not None:
                    turns.append(turn)
        return turns


def index_file(path: Path) -> TurnIndex:
    """Index a JSON Lines file on raw bytes. Raises DataError if it cannot be read."""
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    offsets, tools, tiers, jobs = [], [], [], []
    bad = BadLines()
    try:
        with open(path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                here = offset
                offset += len(line)
                if not line.strip():
                    continue
                tool = tool_of_raw_line(line)
                if tool is None:
                    bad.add("no tool", f"{path.name}:{number}")
                    continue
                tier = _RAW_TIER.search(line)
                job = _RAW_JOB.search(line)
                offsets.append(here)
                tools.append(tool)
                tiers.append(tier.group(1).decode() if tier else "silver")
                jobs.append(job.group(1).decode("utf-8", "replace") if job else f"line-{number}")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    return TurnIndex(path, offsets, tools, tiers, jobs, bad)


def parse_turn(line: bytes, where: str, bad: BadLines) -> dict | None:
    """One turn as {job, tier, system, user, answer, tool}, or None (counted in bad)."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        bad.add("not JSON", where)
        return None
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        bad.add("no messages", where)
        return None
    by_role: dict[str, str] = {}
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            # The last message of a role wins: the answer is the final assistant message.
            by_role[message.get("role", "")] = message["content"]
    answer = by_role.get("assistant", "").strip()
    if not answer:
        bad.add("empty answer", where)
        return None
    tool = tool_of_answer(answer)
    if tool is None:
        bad.add("no tool", where)
        return None
    if "user" not in by_role:
        bad.add("no messages", where)
        return None
    return {
        "job": str(row.get("job", "")),
        "tier": str(row.get("tier", "silver")),
        "system": by_role.get("system", ""),
        "user": by_role["user"],
        "answer": answer,
        "tool": tool,
    }


def check_folder(folder: Path) -> tuple[Path, Path]:
    """The train and eval files of a data folder, or a DataError that says what is wrong."""
    if not folder.exists():
        raise DataError(f"data folder {folder} does not exist")
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    train, evaluation = folder / "train.jsonl", folder / "eval.jsonl"
    for path in (train, evaluation):
        if not path.is_file():
            raise DataError(
                f"{folder} has no {path.name} (a data folder holds train.jsonl and eval.jsonl)"
            )
    return train, evaluation


def index_folder(folder: Path) -> tuple[TurnIndex, TurnIndex]:
    train_path, eval_path = check_folder(folder)
    train, evaluation = index_file(train_path), index_file(eval_path)
    for index in (train, evaluation):
        if len(index) == 0:
            raise DataError(f"{index.path} has no usable turns ({index.bad.total} bad lines)")
    return train, evaluation
