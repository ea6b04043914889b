"""The synthetic corpus: turns in the format of the real one, with a tool that follows from the page.

Every tool has a kind of page it is the right call for: a kind phrase in the title (most of the
time) and signature elements in the numbered element list (always). The rest of the page, the
job and the earlier observations are shared noise. Silver turns carry some wrong labels, as the
agent's own reports do. Jobs are cut whole into train or eval, never both.

`hard` turns (`gbray synth --hard`) need the page, the task and the history together: the page
lists 22 tools' cues under eleven headings, the task names the heading's way of working, and the
history says which of the tools under it was already used (the page still shows it).
See `make_hard_turn`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# (tool, share of the corpus in percent, kind of page it is right for, signature elements)
DEFAULT_TOOLS: list[tuple[str, float, str, tuple[str, ...]]] = [
    (
        "open",
        18.7,
        "search results",
        ('link "Result"', 'link "More results"', 'text "About 1,200 results"'),
    ),
    (
        "save_keywords",
        9.5,
        "glossary",
        ('list "Key terms"', 'text "Definition"', 'link "Index of terms"'),
    ),
    (
        "read",
        8.0,
        "article",
        ('heading "Introduction"', 'text "Reading time 6 min"', 'link "Continue reading"'),
    ),
    ("look", 6.5, "image gallery", ('image "Figure"', 'button "Enlarge"', 'text "Photo credit"')),
    ("search", 6.0, "home page", ('input "Search"', 'button "Go"', 'link "Popular topics"')),
    (
        "scroll",
        5.0,
        "long listing",
        ('text "Showing 1-20 of 400"', 'link "Load more"', 'text "Scroll for more"'),
    ),
    (
        "back",
        4.0,
        "not found",
        ('text "Error 404"', 'link "Return to previous page"', 'text "Page missing"'),
    ),
    (
        "sweep",
        3.5,
        "site directory",
        ('link "Section A"', 'link "Section B"', 'text "All sections"'),
    ),
    ("click", 3.2, "menu", ('button "Open menu"', 'link "Submenu"', 'button "Expand"')),
    (
        "finish",
        3.0,
        "answer summary",
        ('text "All questions answered"', 'text "Summary complete"', 'button "Done"'),
    ),
    (
        "accept_cookies",
        2.6,
        "cookie notice",
        ('button "Accept all cookies"', 'text "We use cookies"', 'button "Reject"'),
    ),
    (
        "close_popup",
        2.4,
        "newsletter popup",
        ('button "Close"', 'text "Subscribe to our newsletter"', 'input "Email"'),
    ),
    ("login", 2.2, "sign in", ('input "Username"', 'input "Password"', 'button "Sign in"')),
    (
        "download",
        2.0,
        "file download",
        ('link "Download PDF"', 'text "File size 2.4 MB"', 'button "Save file"'),
    ),
    (
        "next_page",
        1.9,
        "paged results",
        ('link "Next page"', 'text "Page 1 of 9"', 'link "Page 2"'),
    ),
    (
        "extract_table",
        1.8,
        "data table",
        ('table "Statistics"', 'text "Rows 1-50"', 'button "Export CSV"'),
    ),
    (
        "translate",
        1.7,
        "foreign language",
        ('text "Dieser Artikel"', 'button "Translate page"', 'text "Language German"'),
    ),
    (
        "fill_form",
        1.6,
        "contact form",
        ('input "Name"', 'input "Message"', 'text "Required field"'),
    ),
    (
        "submit",
        1.5,
        "filled form",
        ('button "Submit"', 'text "All fields complete"', 'button "Send"'),
    ),
    ("wait", 1.4, "loading screen", ('text "Loading"', 'text "Please wait"', 'image "Spinner"')),
    (
        "refresh",
        1.3,
        "stale page",
        ('text "Content may be out of date"', 'button "Reload"', 'text "Connection lost"'),
    ),
    ("cite", 1.2, "reference list", ('text "References"', 'link "doi"', 'text "Cited by 40"')),
    (
        "compare",
        1.2,
        "comparison",
        ('table "Product A vs Product B"', 'text "Versus"', 'button "Compare"'),
    ),
    (
        "summarize",
        1.1,
        "long report",
        ('heading "Executive summary"', 'text "Chapter 7"', 'text "120 pages"'),
    ),
    ("select", 1.0, "dropdown", ('select "Choose a year"', 'option "2019"', 'option "2020"')),
    (
        "type",
        1.0,
        "empty search box",
        ('input "Type your query"', 'text "Enter keywords"', 'button "Clear"'),
    ),
    ("zoom", 0.9, "map", ('image "Map"', 'button "Zoom in"', 'text "Scale 1 km"')),
    (
        "filter",
        0.9,
        "catalogue",
        ('checkbox "In stock"', 'select "Price range"', 'button "Apply filters"'),
    ),
    ("sort", 0.8, "unsorted list", ('select "Sort by"', 'option "Newest"', 'option "Relevance"')),
    (
        "expand",
        0.8,
        "collapsed thread",
        ('button "Show replies"', 'text "12 hidden comments"', 'link "Expand all"'),
    ),
    (
        "bookmark",
        0.7,
        "key source",
        ('text "Official statistics"', 'button "Bookmark"', 'text "Primary source"'),
    ),
    ("copy_text", 0.7, "quotation", ('text "Quote"', 'button "Copy"', 'text "Said the minister"')),
    ("screenshot", 0.6, "chart", ('image "Chart"', 'text "Figure 3"', 'text "Source data"')),
    (
        "follow_link",
        0.6,
        "redirect notice",
        ('link "Click here if not redirected"', 'text "Moved permanently"', 'text "Redirecting"'),
    ),
    (
        "prev_page",
        0.6,
        "last page",
        ('link "Previous page"', 'text "Page 9 of 9"', 'text "End of results"'),
    ),
    (
        "report_error",
        0.5,
        "server error",
        ('text "Error 500"', 'text "Internal server error"', 'text "Try later"'),
    ),
    (
        "ask_user",
        0.5,
        "paywall",
        ('text "Subscribe to read"', 'button "Buy access"', 'text "Members only"'),
    ),
    (
        "collapse",
        0.5,
        "expanded panel",
        ('button "Hide details"', 'text "Details shown"', 'button "Collapse"'),
    ),
    ("share", 0.4, "share dialog", ('button "Share"', 'link "Copy link"', 'text "Share with"')),
    ("save_note", 0.4, "notes panel", ('input "Note"', 'text "Your notes"', 'button "Save note"')),
]

TOPICS = (
    "solar panels",
    "river pollution",
    "vaccine trials",
    "coffee prices",
    "railway strikes",
    "coral reefs",
    "housing costs",
    "election turnout",
    "wheat harvest",
    "battery recycling",
    "tidal energy",
    "museum funding",
    "bird migration",
    "chip shortages",
    "forest fires",
    "school meals",
    "ocean plastics",
    "wind farms",
    "drought relief",
    "city cycling",
    "copper mining",
    "flood defences",
    "rare diseases",
    "space debris",
    "water tariffs",
    "language apps",
    "noise limits",
    "tea exports",
    "bee decline",
    "port congestion",
)
FILLER = (
    "the report notes",
    "figures for last year",
    "according to officials",
    "in several regions",
    "a recent survey",
    "experts disagree",
    "the data suggest",
    "local groups say",
    "prices rose",
    "a slow decline",
    "new rules apply",
    "the committee met",
    "most respondents",
    "early results",
    "costs were higher",
    "the study found",
    "critics argue",
    "supporters claim",
    "since the change",
)
GENERIC_ELEMENTS = (
    'link "Home"',
    'link "About"',
    'link "Contact"',
    'button "Menu"',
    'link "Privacy"',
    'link "Help"',
    'image "Logo"',
    'link "Terms"',
    'text "Follow us"',
    'link "Careers"',
    'link "News"',
    'button "Language"',
    'link "Sitemap"',
    'text "Copyright 2024"',
)
SITES = (
    "example.org",
    "news.example.com",
    "data.example.net",
    "wiki.example.org",
    "shop.example.com",
)


@dataclass(frozen=True)
class Wording:
    """How a corpus phrases its prompts; a second wording stands in for a corpus never seen."""

    intro: str
    job: str
    history: str
    page: str
    elements: str
    title: str


WORDINGS = {
    "default": Wording(
        intro="You are a research agent working in a web browser. Pick the next tool call and "
        'answer with one JSON object {"tool": NAME, "args": {...}}.',
        job="Job",
        history="Earlier observations:",
        page="Latest page:",
        elements="Elements:",
        title="Title:",
    ),
    "alt": Wording(
        intro="Assistant for browsing tasks. Reply with exactly one JSON call naming a tool.",
        job="Task",
        history="What happened so far:",
        page="Current view:",
        elements="Interactive items:",
        title="Heading:",
    ),
}

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ren",
    "tu",
    "sa",
    "vor",
    "ne",
    "pi",
    "dal",
    "ko",
    "ber",
    "fi",
    "zu",
)
_KIND_WORDS = (
    "ledger",
    "atlas",
    "forum",
    "bulletin",
    "archive",
    "register",
    "digest",
    "almanac",
    "roster",
    "journal",
    "gazette",
    "chronicle",
    "index",
    "manual",
    "brochure",
)
_KIND_ADJ = (
    "blue",
    "quiet",
    "narrow",
    "public",
    "annual",
    "private",
    "open",
    "sealed",
    "old",
    "broad",
    "local",
    "shared",
)
_ELEMENT_TYPES = ("button", "link", "text", "input", "image", "select")


@dataclass(frozen=True)
class SynthSettings:
    out: Path
    turns: int = 3000
    eval_turns: int = 300
    seed: int = 0
    prompt_tokens: int = 300
    tools: int = 40
    wording: str = "default"
    silver_share: float = 0.35
    silver_wrong: float = 0.25
    generic_title_share: float = 0.25
    # A system prompt of about this many tokens (0: the short catalogue), as a real agent's
    # catalogue is: every tool with a description and an argument schema, then usage rules.
    system_tokens: int = 0
    hard: bool = False
    # Tools never a label in train.jsonl: still in the catalogue (described), and 30% of the
    # eval turns, so a 150-turn paper holds more than 30 of them.
    new_tools: int = 0

    def validate(self) -> None:
        if self.system_tokens < 0:
            raise ValueError("--system-tokens must be >= 0")
        if self.turns < 10 or self.eval_turns < 1:
            raise ValueError("synth needs --turns >= 10 and --eval-turns >= 1")
        if not 2 <= self.tools <= len(DEFAULT_TOOLS):
            raise ValueError(f"--tools must be between 2 and {len(DEFAULT_TOOLS)}")
        if self.wording not in WORDINGS:
            raise ValueError(f"--wording must be one of {sorted(WORDINGS)}")
        if self.prompt_tokens < 80:
            raise ValueError("--prompt-tokens must be at least 80")
        if self.hard and self.tools < HARD_SECTIONS * HARD_SECTION_TOOLS + 4:
            raise ValueError("--hard needs --tools >= 26 (a page offers 22 tools)")
        if not 0 <= self.new_tools <= self.tools // 4:
            raise ValueError("--new-tools must be between 0 and a quarter of --tools")


def tool_table(
    settings: SynthSettings, rng: random.Random
) -> list[tuple[str, float, str, tuple[str, ...]]]:
    """The tools of this corpus: the default forty, or invented names and pages for 'alt'."""
    table = DEFAULT_TOOLS[: settings.tools]
    if settings.wording == "default":
        return table
    invented, used = [], set()
    for _, share, _, _ in table:
        name = ""
        while not name or name in used:
            name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
            name += rng.choice(("", "_it", "_all", "_up"))
        used.add(name)
        kind = f"{rng.choice(_KIND_ADJ)} {rng.choice(_KIND_WORDS)}"
        signature = tuple(
            f'{rng.choice(_ELEMENT_TYPES)} "{rng.choice(_KIND_ADJ).title()} {rng.choice(_KIND_WORDS)} {i}"'
            for i in range(3)
        )
        invented.append((name, share * rng.uniform(0.6, 1.4), kind, signature))
    return invented


def catalogue(wording: Wording, table, with_descriptions: bool) -> str:
    lines = [wording.intro, "Tools:"]
    for name, _, kind, _ in table:
        lines.append(f"- {name}: use on a {kind} page" if with_descriptions else f"- {name}")
    return "\n".join(lines)


def long_catalogue(wording: Wording, table, tokens: int, rng: random.Random) -> str:
    """A catalogue of about `tokens` tokens (3.6 characters a token): each tool described with
    its argument schema, then numbered usage rules until the size is reached."""
    lines = [wording.intro, "Tools:"]
    for name, _, kind, signature in table:
        args = {"n": "integer: the numbered element", "text": f"string, e.g. {rng.choice(TOPICS)}"}
        lines.append(
            f"- {name}: use on a {kind} page, usually the one showing {signature[0]}. "
            f"Arguments: {json.dumps(args)}"
        )
    lines.append("Rules:")
    rule = 0
    while len("\n".join(lines)) < tokens * 3.6:
        rule += 1
        tool, _, kind, _ = rng.choice(table)
        lines.append(
            f"{rule}. On a {kind} page about {rng.choice(TOPICS)}, prefer {tool} after "
            f"{rng.choice(FILLER)}; never call a tool the page does not offer."
        )
    return "\n".join(lines)


def _answer(tool: str, index: int, n: int, topic: str) -> str:
    style = index % 3
    if style == 0:
        args: dict = {"n": n}
    elif style == 1:
        args = {"text": topic}
    else:
        args = {}
    return json.dumps({"tool": tool, "args": args}, separators=(",", ":"))


def _filler(rng, topic: str, chars: float) -> list[str]:
    """Lines of the page's text that tell nothing, about `chars` characters of them."""
    text: list[str] = []
    size = 0
    while size < chars:
        line = f"{rng.choice(FILLER).capitalize()} on {topic}, {rng.choice(FILLER)}."
        text.append(line)
        size += len(line) + 1
    return text


def _page(rng, wording, table, index, topic, chars_wanted, generic_title_share):
    _, _, kind, signature = table[index]
    site = rng.choice(SITES)
    if rng.random() < generic_title_share:
        title = f"{topic.title()} | {site}"
    else:
        title = f"{kind.title()}: {topic}"
    elements = rng.sample(signature, 2) + rng.sample(GENERIC_ELEMENTS, rng.randint(3, 7))
    rng.shuffle(elements)
    numbered = [f"[{i + 1}] {e}" for i, e in enumerate(elements)]
    signature_at = next(i + 1 for i, e in enumerate(elements) if e in signature)
    text = _filler(rng, topic, chars_wanted)
    lines = [
        wording.page,
        f"URL: https://{site}/{kind.replace(' ', '-')}/{rng.randint(10, 9999)}",
        f"{wording.title} {title}",
        *text,
        wording.elements,
        *numbered,
    ]
    return "\n".join(lines), signature_at


def make_turn(rng, settings, wording, table, weights, system, job, topic) -> dict:
    """A default turn: the tool drawn by `weights` (a tool of weight 0 is never the label)."""
    index = rng.choices(range(len(table)), weights=weights)[0]
    history = [
        f"- {rng.choice(table)[0]}: {rng.choice(FILLER)} on {rng.choice(TOPICS)}"
        for _ in range(rng.randint(0, 5))
    ]
    head = f"{wording.job} {job}: find out about {topic}."
    fixed = len(system) + len(head) + sum(len(h) + 1 for h in history) + 260
    # About 3.6 characters a token under a BPE trained on this corpus.
    page, n = _page(
        rng,
        wording,
        table,
        index,
        topic,
        max(0, settings.prompt_tokens * 3.6 - fixed),
        settings.generic_title_share,
    )
    user = "\n\n".join([head, "\n".join([wording.history, *history]) if history else "", page])
    return _turn(rng, settings, table, weights, job, system, user.replace("\n\n\n", "\n\n"),
                 index, n, topic)  # fmt: skip


def _turn(rng, settings, table, weights, job, system, user, index, n, topic) -> dict:
    """The turn as the corpus holds it; a silver turn is sometimes labelled with another tool,
    as the agent's own reports are."""
    tool = table[index][0]
    tier = "gold" if rng.random() >= settings.silver_share else "silver"
    if tier == "silver" and rng.random() < settings.silver_wrong:
        tool = rng.choice(_labels(table, weights))[0]
    return {
        "job": job,
        "tier": tier,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
            {"role": "assistant", "content": _answer(tool, index, n, topic)},
        ],
    }


# Hard turns: a task names a way of doing it, and the page's elements sit under headings, one
# per way of working.
WAYS = (
    ("and keep a copy for later", "without keeping anything", "and pass it on"),
    ("for the whole team", "just for yourself", "for a client"),
    ("before the deadline today", "whenever there is time", "within the hour"),
    ("with the exact figures", "in plain words", "with pictures"),
)
# Eleven headings of two tools each: a page offers 22 of the 40 (the page alone: 1 in 22, under
# twice chance), and under the task's heading the one tool not used yet sits beside one that was.
HARD_SECTIONS, HARD_SECTION_TOOLS = 11, 2
# A real agent's prompt states its rules; the student still has to apply them.
HARD_RULES = (
    "\nRules: a page lists its elements in sections, one for each way of working. Use the "
    "section of the way the task names. A tool the earlier observations used on this page is "
    "done, though its element still shows. Call the one tool left in that section."
)


def _labels(table, weights) -> list:
    """The tools a turn may be labelled with (a silver turn's wrong label too)."""
    return [row for row, w in zip(table, weights, strict=True) if w > 0] if 0 in weights else table


def make_hard_turn(rng, settings, wording, table, weights, system, job, topic) -> dict:
    """A turn no one field decides. The task names a way of doing it; the page lists its
    elements under eleven headings, one per way of working, each over two tools' cues (one
    signature element each, in any order); the history says which of them were already used on
    this page, by name and element number (their cues still show: a banner closed, a dialog
    dismissed), among steps on earlier pages. Under every heading one tool was used and one was
    not: under the task's heading the one not used is the target, the used one its near miss.
    So the page alone leaves 22 tools open, the task alone all 40, the history alone about 29;
    the right call is the tool under the task's heading not used yet. Which tools a page shows,
    and under which heading, is drawn afresh for each turn: nothing is to be remembered but
    which cues are which tool's."""
    n_tools = len(table)
    target = rng.choices(range(n_tools), weights=weights)[0]
    ways = [phrase for split in WAYS for phrase in split]
    headings = rng.sample(ways, HARD_SECTIONS)
    way = rng.randrange(HARD_SECTIONS)
    size = HARD_SECTION_TOOLS
    others = rng.sample([i for i in range(n_tools) if i != target], HARD_SECTIONS * size)
    sections = [others[k * size : (k + 1) * size] for k in range(HARD_SECTIONS)]
    sections[way][0] = target  # under the task's heading the target is the tool not used yet
    used = [i for tools in sections for i in tools[1:]]
    # Earlier pages' steps name tools not used on this one, the target as often as any other:
    # a tool is spent only on the page it was used on.
    unused = [i for i in range(n_tools) if i not in used]
    earlier = rng.sample(unused, rng.randint(2, 5))
    cues = {i: rng.choice(table[i][3]) for tools in sections for i in tools}
    generic = rng.sample(GENERIC_ELEMENTS, min(len(GENERIC_ELEMENTS), HARD_SECTIONS))
    elements = []
    for k, tools in enumerate(sections):
        block = [cues[i] for i in tools] + generic[k : k + rng.randint(0, 1)]
        rng.shuffle(block)
        elements.append([f'section "{headings[k].capitalize()}"', *block])
    rng.shuffle(elements)
    listed = [e for section in elements for e in section]
    number = {e: n + 1 for n, e in enumerate(listed)}
    history = [f"- {table[i][0]} [{number[cues[i]]}]: used on this page" for i in used]
    history += [f"- {table[i][0]}: used on an earlier page" for i in earlier]
    rng.shuffle(history)
    phrase = headings[way]
    head = (
        f"{wording.job} {job}: find out about {topic}, {phrase}."
        if rng.random() < 0.5
        else f"{wording.job} {job}: {phrase}, find out about {topic}."
    )
    fixed = len(head) + sum(len(h) + 1 for h in history) + sum(len(e) + 6 for e in listed) + 260
    text = _filler(rng, topic, max(0, settings.prompt_tokens * 3.6 - fixed))
    site = rng.choice(SITES)
    page = [
        wording.page, f"URL: https://{site}/{topic.replace(' ', '-')}/{rng.randint(10, 9999)}",
        f"{wording.title} {topic.title()} | {site}", *text, wording.elements,
        *(f"[{n + 1}] {e}" for n, e in enumerate(listed)),
    ]  # fmt: skip
    user = "\n\n".join([head, "\n".join([wording.history, *history]), "\n".join(page)])
    return _turn(rng, settings, table, weights, job, system, user, target,
                 number[cues[target]], topic)  # fmt: skip


NEW_TOOLS_EVAL_SHARE = 0.3


def new_tool_indices(tools: int, k: int, seed: int) -> set[int]:
    """The K tools kept out of training, drawn by the corpus' seed."""
    return set(random.Random(seed + 3).sample(range(tools), k)) if k else set()


def part_weights(shares: list[float], new: set[int], part: str) -> list[float]:
    """How often each tool is a turn's label in `part`: training never holds a new tool; the
    eval turns hold the new tools 30% of the time, in their own proportions."""
    if not new:
        return shares
    if part == "train":
        return [0.0 if i in new else s for i, s in enumerate(shares)]
    old = sum(s for i, s in enumerate(shares) if i not in new)
    fresh = sum(shares[i] for i in new)
    scale = NEW_TOOLS_EVAL_SHARE / (1 - NEW_TOOLS_EVAL_SHARE) * old / fresh
    return [s * scale if i in new else s for i, s in enumerate(shares)]


def described_catalogue(wording: Wording, table) -> str:
    """Every tool with what tells its turns: its kind of page and its cues. A corpus with tools
    never trained on needs it to name them, and a hard page's cues are read through it."""
    lines = [wording.intro, "Tools:"]
    for name, _, kind, signature in table:
        shows = ", ".join(signature[:-1]) + f" or {signature[-1]}"
        lines.append(f"- {name}: for {kind} pages, which show {shows}")
    return "\n".join(lines)


def write_corpus(settings: SynthSettings) -> dict:
    """Write train.jsonl and eval.jsonl under settings.out; returns counts."""
    settings.validate()
    rng = random.Random(settings.seed)
    wording = WORDINGS[settings.wording]
    table = tool_table(settings, rng)
    shares = [1.0] * len(table) if settings.hard else [share for _, share, _, _ in table]
    new = new_tool_indices(len(table), settings.new_tools, settings.seed)
    weights = {part: part_weights(shares, new, part) for part in ("eval", "train")}
    if settings.system_tokens:
        system = long_catalogue(
            wording, table, settings.system_tokens, random.Random(settings.seed + 1)
        )
    elif new or settings.hard:
        system = described_catalogue(wording, table) + (HARD_RULES if settings.hard else "")
    else:
        system = catalogue(wording, table, with_descriptions=settings.prompt_tokens >= 1200)
    settings.out.mkdir(parents=True, exist_ok=True)
    counts = {}
    job_no = 0
    for name, want in (("eval", settings.eval_turns), ("train", settings.turns)):
        written = 0
        with open(settings.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            while written < want:
                job_no += 1
                job = f"j-{job_no:05d}"
                topic = rng.choice(TOPICS)
                for _ in range(min(rng.randint(3, 10), want - written)):
                    w = weights[name]
                    if settings.hard:
                        turn = make_hard_turn(rng, settings, wording, table, w, system, job, topic)
                    else:
                        turn = make_turn(rng, settings, wording, table, w, system, job, topic)
                    f.write(json.dumps(turn, ensure_ascii=False) + "\n")
                    written += 1
        counts[name] = written
    counts["tools"] = len(table)
    if new:
        counts["new_tools"] = [table[i][0] for i in sorted(new)]
    return counts
