"""The hub's HTTP face (SPEC §8): the paths devices already speak, bearer-token auth, a status page.

Everything a device sends is untrusted. A request is judged from its headers before a byte of its
body is read (a caller without a valid token: 401; a body over its path's limit: 413); every field
is then bounded, every number finite, every string text that UTF-8 can hold; a round is written
only by the token that registered it (or an owner). Errors are 4xx with a one-line reason. Uploads
are checked off the event loop. Never imports torch. Plain `def` endpoints run in FastAPI's thread
pool, and the store opens a connection per call.
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as InPath
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from gbray.hub.adapters import AdapterStore, Refused, safe_name
from gbray.hub.gate import GateRules
from gbray.hub.store import TOKEN_SECONDS, Caller, Conflict, Forbidden, NotFound, Store

log = logging.getLogger(__name__)
PAGE = Path(__file__).parent / "page" / "index.html"
SCRIPT = Path(__file__).parent / "page" / "page.js"
# The page's script comes from the hub itself, never inline: device text that slipped into markup
# would be blocked, not run.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' "
    "'unsafe-inline'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
JSON_LIMIT = 1024 * 1024  # a JSON body: an end with its per-tool table is a few kB
MOST = 10**9  # integers a device may send (steps, turns, seeds)


@dataclass(frozen=True)
class HubSettings:
    db: Path
    store: Path
    host: str = "127.0.0.1"
    port: int = 8600
    claim_timeout: float = 600.0  # seconds a baseline claim survives its device's silence
    size_limit: int = 512 * 1024 * 1024
    gate: GateRules = field(default_factory=GateRules)
    auto_promote: bool = False  # put every round that ends done to the gate as it ends
    ssl_certfile: Path | None = None  # TLS: uvicorn's own, given both
    ssl_keyfile: Path | None = None


# -- what a device may send ----------------------------------------------------------------------


def check_json(value: Any, depth: int = 0) -> Any:
    """Every value a JSON body holds, checked: finite numbers, integers SQLite and JSON readers
    can hold, text UTF-8 can encode (no lone surrogates), bounded strings and nesting. The fields
    a model names are bounded again by their own types."""
    if depth > 8:
        raise ValueError("nested more than 8 deep")
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
    elif isinstance(value, int):
        if abs(value) > 2**53:
            raise ValueError("integers must lie within ±2^53")
    elif isinstance(value, str):
        if len(value) > 10_000:
            raise ValueError("strings hold at most 10000 characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError("text must be valid Unicode (no lone surrogates)") from e
    elif isinstance(value, list):
        if len(value) > 2_000:
            raise ValueError("lists hold at most 2000 items")
        for item in value:
            check_json(item, depth + 1)
    elif isinstance(value, dict):
        if len(value) > 2_000:
            raise ValueError("objects hold at most 2000 keys")
        for key, item in value.items():
            check_json(key, depth + 1)
            check_json(item, depth + 1)
    return value


class Body(BaseModel):
    """A device's JSON body: the named fields typed and bounded, more fields allowed but checked."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _whole_body(cls, data):
        return check_json(data)


Finite = Annotated[float, Field(allow_inf_nan=False, ge=-1e12, le=1e12)]
Count = Annotated[int, Field(ge=0, le=MOST)]
Short = Annotated[str, Field(max_length=200)]


class RegisterBody(Body):
    device: Short = "unknown"
    base: Short = ""
    turns: Count = 0
    recipe: dict = {}


class NoteBody(Body):
    line: Annotated[str, Field(max_length=4000)]


class CheckBody(Body):
    step: Count | None = None
    turns: Count | None = None
    valLoss: Finite | None = None
    trainLoss: Finite | None = None
    best: bool | None = None  # whether this point is the best so far
    lr: Finite | None = None
    # gbray's devices add these; the field's omit them.
    valAgreement: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    phase: Literal["warm-up", "stable", "cool-down", "cosine"] | None = None


class ExamBody(Body):
    """An exam result as the field sends it: `agreement_pct` and `turns`, more fields allowed."""

    agreement_pct: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]
    turns: Count | None = None
    # One "1"/"0" per paper turn: what pairs a baseline with a result.
    marks: Annotated[str, Field(max_length=10_000, pattern=r"^[01]*$")] | None = None


class ToolRow(Body):
    asked: Count | str | None = None
    before: Annotated[str, Field(max_length=200)] | None = None
    after: Annotated[str, Field(max_length=200)] | None = None
    answered_before: Count | None = None
    answered_after: Count | None = None


class NewToolsBody(Body):
    tools: Annotated[list[Short], Field(max_length=1000)] = []
    asked: Count | None = None
    before: Count | None = None
    after: Count | None = None
    before_pct: Annotated[float, Field(ge=0, le=100)] | None = None
    after_pct: Annotated[float, Field(ge=0, le=100)] | None = None


class EndBody(Body):
    status: Literal["done", "failed", "stopped"] = "done"
    baseline: ExamBody | None = None
    result: ExamBody | None = None
    adapter: Annotated[str, Field(max_length=2000)] | None = None
    paper: Short | None = None
    why: Annotated[str, Field(max_length=4000)] | None = None
    trained: Count | None = 0
    drawSeed: Annotated[int, Field(ge=-(2**53), le=2**53)] | None = None
    perTool: Annotated[dict[Short, ToolRow], Field(max_length=1000)] | None = None
    newTools: NewToolsBody | None = None


class BaselineBody(Body):
    scope: Short
    base: Short
    paper: Short
    turns: Count
    answer: Count
    student: Short
    baseline: ExamBody


QShort = Annotated[str, Query(max_length=200)]
QCount = Annotated[int, Query(ge=0, le=MOST)]
RoundId = Annotated[str, InPath(max_length=200)]


# -- the gate: judged from the headers, before the body -----------------------------------------


def _bearer(headers: list[tuple[bytes, bytes]]) -> str:
    for key, value in headers:
        if key == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text.lower().startswith("bearer ") else ""
    return ""


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


class Gate:
    """ASGI middleware: a caller of the API without a valid token gets 401, and a body whose
    Content-Length is over its path's limit 413, before the body is read. The caller found here
    is handed to the endpoints in the request's state."""

    def __init__(self, app, store: Store, size_limit: int, piece: int):
        self.app, self.store = app, store
        self.size_limit, self.piece = size_limit, piece
        self.known: dict[str, tuple[float, Caller | None]] = {}

    async def who(self, token: str) -> Caller | None:
        """The token's caller, from the store at most every few seconds: one thread hop less per
        request, which under load was a note's wait."""
        now = time.monotonic()
        cached = self.known.get(token)
        if cached is None or now - cached[0] > TOKEN_SECONDS:
            if len(self.known) > 10_000:  # wrong tokens must not grow it without bound
                self.known.clear()
            cached = (now, await run_in_threadpool(self.store.who, token))
            self.known[token] = cached
        return cached[1]

    def limit(self, method: str, path: str, query: bytes) -> int:
        if method == "PUT" and path.endswith("/adapter"):
            return self.piece if b"chunk=" in query else self.size_limit
        return JSON_LIMIT

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        token = _bearer(headers)
        who = await self.who(token) if token else None
        if who is None:
            headers = {"WWW-Authenticate": "Bearer"}
            return await _answer(scope, send, 401, "missing or wrong bearer token", headers)
        length = _content_length(headers)
        path, query = scope["path"], scope.get("query_string", b"")
        limit = self.limit(scope["method"], path, query)
        if length is not None and not 0 <= length <= limit:
            return await _answer(scope, send, 413, f"a body here holds at most {limit} bytes")
        chunked = any(k == b"transfer-encoding" for k, _ in headers)
        if length is None and chunked and limit == JSON_LIMIT:
            # An adapter may stream; a JSON body says its size first.
            return await _answer(scope, send, 411, "a JSON body needs a Content-Length")
        scope.setdefault("state", {})["who"] = who
        await self.app(scope, receive, send)


async def _answer(scope, send, status: int, detail: str, headers: dict | None = None) -> None:
    response = JSONResponse({"detail": detail}, status_code=status, headers=headers)
    # Close the connection: the body the client may still be sending is never read.
    response.headers["Connection"] = "close"
    await response(scope, None, send)


def caller(request: Request) -> Caller:
    return request.state.who


def owner(who: Caller = Depends(caller)) -> Caller:
    if not who[1]:
        raise Forbidden("this needs an owner token")
    return who


class RedactTokens(logging.Filter):
    """Keeps tokens out of the access log (`/?token=...` opens the page)."""

    PATTERN = re.compile(r"(token=)[^&\s\"]+", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.args = tuple(
                self.PATTERN.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        return True


def one_line(error: RequestValidationError) -> str:
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in first.get("loc", ()))
    more = len(error.errors()) - 1
    text = f"{where}: {first.get('msg')}" + (f" (and {more} more)" if more > 0 else "")
    return " ".join(text.split())[:300]


def create_app(settings: HubSettings) -> FastAPI:
    store = Store(settings.db, claim_timeout=settings.claim_timeout, rules=settings.gate)
    adapters = AdapterStore(settings.store, size_limit=settings.size_limit)
    app = FastAPI(
        title="gbray hub",
        description="Hands out slices and papers, caches baselines, keeps rounds, "
        "their curves and adapters, and promotes only rounds that beat their own baseline and "
        "what serves on the same paper.",
    )
    app.state.store, app.state.adapters = store, adapters
    app.add_middleware(Gate, store=store, size_limit=adapters.size_limit, piece=adapters.piece)

    # Uploads take their turn: eight 40 MB adapters landing at once kept the CPUs from notes.
    uploads = anyio.Semaphore(1)

    def stop_answer(stop: bool) -> dict:
        return {"stop": True} if stop else {}

    for kind, status in ((NotFound, 404), (Conflict, 409), (Forbidden, 403)):
        app.add_exception_handler(
            kind, lambda _r, exc, status=status: JSONResponse({"detail": str(exc)}, status)
        )

    @app.exception_handler(Refused)
    def refused(_request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    def invalid(_request, exc):
        return JSONResponse({"detail": one_line(exc)}, status_code=422)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page():
        return HTMLResponse(PAGE.read_text(), headers=PAGE_HEADERS)

    @app.get("/page.js", include_in_schema=False)
    def page_script():
        return Response(SCRIPT.read_text(), media_type="text/javascript", headers=PAGE_HEADERS)

    @app.post("/v1/training/rounds")
    def register(body: RegisterBody, who: Caller = Depends(caller)):
        return {
            "id": store.register(body.device or who[0], body.base, body.turns, body.recipe, who)
        }

    @app.post("/v1/training/rounds/{round_id}/note")
    def note(round_id: RoundId, body: NoteBody, who: Caller = Depends(caller)):
        return stop_answer(store.note(round_id, body.line, who))

    @app.post("/v1/training/rounds/{round_id}/check")
    def check(round_id: RoundId, body: CheckBody, who: Caller = Depends(caller)):
        return stop_answer(store.check(round_id, body.model_dump(), who))

    @app.get("/v1/training/rounds/{round_id}")
    def round_detail(round_id: RoundId, _who: Caller = Depends(caller)):
        """The round with its notes and curve, and whether it was asked to stop."""
        return {**store.round(round_id), **stop_answer(store.stopping(round_id))}

    @app.post("/v1/training/rounds/{round_id}/end")
    def end(round_id: RoundId, body: EndBody, who: Caller = Depends(caller)):
        if store.end(round_id, body.model_dump(), who):
            auto_promote(round_id)
        return {}

    @app.get("/v1/training/slice", response_class=PlainTextResponse)
    def slice_(
        turns: Annotated[int, Query(ge=1, le=100_000)],
        device: QShort = "unknown",
        _who: Caller = Depends(caller),
    ):
        lines = store.take_slice(turns, device, seed=random.randrange(2**31))
        return PlainTextResponse(
            "\n".join(lines) + ("\n" if lines else ""), media_type="application/jsonl"
        )

    @app.get("/v1/training/evalslice", response_class=PlainTextResponse)
    def evalslice(
        turns: Annotated[int, Query(ge=1, le=100_000)],
        device: QShort = "unknown",
        _who: Caller = Depends(caller),
    ):
        lines, paper, scope = store.paper(turns)
        return PlainTextResponse(
            "\n".join(lines) + ("\n" if lines else ""),
            media_type="application/jsonl",
            headers={"X-Exam-Paper": paper, "X-Exam-Scope": scope},
        )

    @app.get("/v1/training/baseline")
    def ask_baseline(
        scope: QShort,
        base: QShort,
        paper: QShort,
        turns: QCount,
        answer: QCount,
        student: QShort,
        device: QShort = "unknown",
        _who: Caller = Depends(caller),
    ):
        return store.ask_baseline((scope, base, paper, turns, answer, student), device)

    @app.post("/v1/training/baseline")
    def tell_baseline(body: BaselineBody, who: Caller = Depends(caller)):
        key = (body.scope, body.base, body.paper, body.turns, body.answer, body.student)
        device = getattr(body, "device", None)
        by = device if isinstance(device, str) and 0 < len(device) <= 200 else who[0]
        store.tell_baseline(key, body.baseline.model_dump(exclude_unset=True), by)
        return {}

    def auto_promote(round_id: str) -> None:
        """With --auto-promote, a round is put to the gate once it has both ended and its adapter
        (whichever comes last: field clients end before they upload)."""
        if settings.auto_promote and adapters.exists(round_id):
            store.auto_promote(round_id)

    @app.put("/v1/training/rounds/{round_id}/adapter")
    async def put_adapter(
        round_id: RoundId,
        request: Request,
        part: Literal["last"] | None = None,
        chunk: Annotated[int, Query(ge=0, le=10_000)] | None = None,
        of: Annotated[int, Query(ge=1, le=10_000)] | None = None,
        who: Caller = Depends(caller),
    ):
        # Judged before a byte of the body is read: the round exists and is this token's.
        await run_in_threadpool(store.writable, round_id, who)
        name = safe_name(round_id + ("-last" if part == "last" else ""))
        if (chunk is None) != (of is None):
            raise Refused(400, "chunk and of go together")
        async with uploads:
            if chunk is None:
                tmp = await _receive_to_file(request, adapters)
                size = await run_in_threadpool(adapters.keep, tmp, name)
                stored = {"size": size, "complete": True}
            else:
                body = await _read_limited(request, adapters.piece)
                stored = await run_in_threadpool(adapters.put_piece, name, chunk, of, body, who[0])
        if stored["complete"] and name == round_id:
            await run_in_threadpool(auto_promote, round_id)
        return {"name": name, **stored}

    @app.get("/v1/training/adapters/{name}")
    def get_adapter(name: Annotated[str, InPath(max_length=200)], _who: Caller = Depends(caller)):
        if not adapters.exists(name):
            raise NotFound(f"no adapter {name}")
        return FileResponse(
            adapters.path(name), media_type="application/gzip", filename=f"{name}.tgz"
        )

    @app.get("/v1/training/state")
    def state(_who: Caller = Depends(caller)):
        return store.state()

    @app.post("/v1/training/rounds/{round_id}/stop")
    def stop(round_id: RoundId, _who: Caller = Depends(owner)):
        store.request_stop(round_id)
        return {"stopping": round_id}

    @app.post("/v1/training/rounds/{round_id}/promote")
    def promote(round_id: RoundId, _who: Caller = Depends(owner)):
        return {"serving": store.promote(round_id, round_id, adapters.exists(round_id))}

    @app.get("/v1/training/serving")
    def serving(_who: Caller = Depends(caller)):
        return {"serving": store.serving()}

    @app.get("/v1/whoami", include_in_schema=False)
    def whoami(who: Caller = Depends(caller)):
        return {"name": who[0], "owner": who[1]}

    return app


async def _receive_to_file(request: Request, adapters: AdapterStore) -> Path:
    """A whole adapter body streamed to a temporary file; refused past the limit without
    reading on."""
    fd, tmp = adapters.new_upload()
    size = 0
    try:
        with open(fd, "wb") as f:
            async for piece in request.stream():
                size += len(piece)
                if size > adapters.size_limit:
                    raise Refused(
                        413, f"adapter body over the limit of {adapters.size_limit} bytes"
                    )
                f.write(piece)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


async def _read_limited(request: Request, limit: int) -> bytes:
    data = bytearray()
    async for piece in request.stream():
        data.extend(piece)
        if len(data) > limit:
            raise Refused(413, f"a piece holds at most {limit} bytes")
    return bytes(data)


def serve(settings: HubSettings) -> None:
    import uvicorn

    logging.getLogger("uvicorn.access").addFilter(RedactTokens())
    tls = {}
    if settings.ssl_certfile:
        tls = {"ssl_certfile": str(settings.ssl_certfile), "ssl_keyfile": str(settings.ssl_keyfile)}
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level="info", **tls
    )


class EmbeddedHub:
    """A hub served from a thread of this process (the demo's): uvicorn on a loopback port."""

    def __init__(self, settings: HubSettings):
        import uvicorn

        self.settings = settings
        self.url = f"http://{settings.host}:{settings.port}"
        logging.getLogger("uvicorn.access").addFilter(RedactTokens())
        config = uvicorn.Config(
            create_app(settings), host=settings.host, port=settings.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = None

    def start(self) -> EmbeddedHub:
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, name="gbray-hub", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the embedded hub did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
