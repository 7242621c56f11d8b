"""Conversations on the dashboard: the turns a ``conversation_id`` links (inserted through the registry's insert
path, as the server and the importers record them) show as one conversation, in order, each turn with only what
it added, on SQLite and PostgreSQL; the experience list filters by conversation and marks each turn with its
conversation; a trace page shows the tools its client offered (escaped) and the token ids it was served (their
counts). Conversation ids are client text: one with markup in it is shown inert, and odd characters in one do
not break its page's links."""

from __future__ import annotations

import hashlib
import html
import json
import re
from urllib.parse import quote

import httpx
import pytest
from markupsafe import escape
from serving.support import ServerThread
from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.dashboard import create_app, trace
from pipeline.dashboard.conversation import ConversationDetail, conversation_detail
from pipeline.dashboard.experience import ExperienceQuery, list_experience
from pipeline.errors import NotFoundError
from pipeline.registry import (
    Experience,
    ScoreRow,
    TraceRow,
    create_generation,
    get_engine,
    insert_scores,
    insert_traces,
    register_base_model,
    register_contract,
    register_harness,
    session_scope,
    upgrade_db,
)
from pipeline.settings import Settings

HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
HOSTILE_ID = '<script>window.__pwned=3</script>"&amp;/?#%20'
ODD_IDS = ["a/b c?d=e#f%2F&g", "..", "Ünïcode ✓ id", " spaced "]
TOKENIZER = "ab" * 32


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}
# the same call as a client sends it back: other spacing, another id field order, content null
CALL_AGAIN = {
    "type": "function",
    "id": "call_1",
    "function": {"arguments": '{"b": 2, "a": 1}', "name": "add"},
}
TURN1 = [_user("add 1 and 2"), {"role": "assistant", "content": "", "tool_calls": [CALL]}]
TURN2 = [
    _user("add 1 and 2"),
    {"role": "assistant", "content": None, "tool_calls": [CALL_AGAIN]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    _assistant("it is 3"),
]
TURN3 = [*TURN2, _user("and times 4?"), _assistant("12")]
TURN4 = [*TURN2[:2], _user("a different history"), _assistant("rewritten")]  # the client rewrote turn 2
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": HOSTILE, "parameters": {"type": "object"}},
    },
    {"type": "function", "function": {"name": HOSTILE_ID, "description": "a name with markup"}},
    {"type": "web_search"},
    "not a tool",
]


def _row(messages: list[dict], conversation: str | None, **extra) -> TraceRow:
    body = json.dumps([messages, conversation, extra], sort_keys=True, default=str)
    return TraceRow(
        content_hash=hashlib.sha256(body.encode()).hexdigest(),
        messages=json.dumps(messages, sort_keys=True),
        metadata="{}",
        feedback=None,
        routes="[]",
        specialist=extra.pop("specialist", "chat"),
        source="deployment",
        principal=extra.pop("principal", "crm"),
        conversation_id=conversation,
        **extra,
    )


def _seed(session: Session) -> dict[str, list[int]]:
    """Conversations ``A`` (four turns, the last rewriting history) and ``B`` (two), interleaved with traces of
    no conversation; ``A``'s second turn passed under the champion's contract. Returns each one's ids."""
    base = register_base_model(session=session, name="b", path="/nowhere", spec={})
    harness = register_harness(session=session, name="h", version="1", spec={})
    contract = register_contract(session=session, name="c", version="1", spec={})
    gen = create_generation(session=session, base_model_id=base.id, harness_version_id=harness.id,
                            contract_version_id=contract.id, specialists=["chat"], status="promoted")  # fmt: skip
    served = {"3": {"tokenizer": TOKENIZER, "prompt_ids": [5, 6, 7, 8, 9], "completion_ids": [10, 11]}}
    plan = [
        ("A", TURN1, {"generation_id": gen.id}),
        ("B", [_user("hello"), _assistant("hi")], {"principal": "anonymous"}),
        (None, [_user("no conversation")], {}),
        (
            "A",
            TURN2,
            {"tools": json.dumps(TOOLS), "served_tokens": json.dumps(served), "specialist": "agent"},
        ),
        ("B", [_user("hello"), _assistant("hi"), _user("bye"), _assistant("bye")], {}),
        ("A", TURN3, {}),
        (None, [_user("still none")], {}),
        ("A", TURN4, {}),
    ]
    for conversation, messages, extra in plan:  # one by one: ids in the order the turns were recorded
        assert insert_traces(session=session, rows=[_row(messages, conversation, **extra)]) == 1
    ids: dict[str, list[int]] = {"A": [], "B": [], "": []}
    for i, c in session.execute(select(Experience.id, Experience.conversation_id).order_by(Experience.id)):
        ids[c or ""].append(i)
    final = {"turn": 3, "verified_by": ["exact_match"], "failed": []}
    insert_scores(session=session, rows=[ScoreRow(ids["A"][1], contract.id, "final", 0.75, final, verified=True,
                                                  specialist="agent")])  # fmt: skip
    return ids


def _texts(turn) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in turn.added]


def test_a_conversation_lists_its_turns_in_order_and_only_its_turns(engine):
    with Session(engine) as s, s.begin():
        ids = _seed(s)
    with Session(engine) as s:
        page = conversation_detail(session=s, conversation_id="A", lineage="main")
        other = conversation_detail(session=s, conversation_id="B", lineage="main")
        with pytest.raises(NotFoundError):
            conversation_detail(session=s, conversation_id="a", lineage="main")
    assert [t.id for t in page.turns] == ids["A"] and [t.id for t in other.turns] == ids["B"]
    assert (page.first_id, page.last_id, page.previous, page.next) == (ids["A"][0], ids["A"][-1], None, None)
    first, second, third, fourth = page.turns
    assert (first.shared, first.dropped, first.messages) == (0, 0, 2)
    assert [m.role for m in first.added] == ["user", "assistant"] and first.added[1].tool_calls == [CALL]
    # the client sent the call back spelled otherwise: still the same message, so not repeated
    assert (second.shared, second.dropped) == (2, 0)
    assert _texts(second) == [("tool", "3"), ("assistant", "it is 3")]
    assert [m.index for m in second.added] == [2, 3] and second.added[0].tool_call_id == "call_1"
    assert (third.shared, third.dropped, _texts(third)) == (
        4,
        0,
        [("user", "and times 4?"), ("assistant", "12")],
    )
    assert (fourth.shared, fourth.dropped) == (2, 4)  # rewrote the history after the tool call
    assert _texts(fourth) == [("user", "a different history"), ("assistant", "rewritten")]
    assert (second.status, second.score, second.failed) == ("passed", 0.75, [])
    assert {t.status for t in (first, third, fourth)} == {"not scored"}
    assert (first.generation, first.generation_lineage, second.generation) == (0, "main", None)
    assert (first.specialist, second.specialist, first.principal) == ("chat", "agent", "crm")
    assert [t.principal for t in other.turns] == ["anonymous", "crm"]
    assert _texts(other.turns[1]) == [("user", "bye"), ("assistant", "bye")]


def test_long_conversations_come_in_keyset_pages(engine):
    """Each page starts where the last ended, going forward or back, and a page's first turn still shows only
    what it added (the turn before it, on the previous page, is read for its prefix)."""
    messages: list[dict] = []
    with Session(engine) as s, s.begin():
        for k in range(45):
            messages = [*messages, _user(f"q{k}"), _assistant(f"a{k}")]
            insert_traces(session=s, rows=[_row(messages, "long"), _row([_user(f"x{k}")], None)])
        ids = list(
            s.scalars(
                select(Experience.id).where(Experience.conversation_id == "long").order_by(Experience.id)
            )
        )
    pages: list[ConversationDetail] = []
    after = None
    with Session(engine) as s:
        while True:
            pages.append(
                conversation_detail(session=s, conversation_id="long", lineage="main", after=after, limit=20)
            )
            if (after := pages[-1].next) is None:
                break
        back = conversation_detail(
            session=s, conversation_id="long", lineage="main", before=pages[-1].previous, limit=20
        )
    assert [len(p.turns) for p in pages] == [20, 20, 5]
    turns = [t for p in pages for t in p.turns]
    assert [t.id for t in turns] == ids
    assert [(t.shared, t.dropped, _texts(t)) for t in turns] == [
        (2 * k, 0, [("user", f"q{k}"), ("assistant", f"a{k}")]) for k in range(45)
    ]
    assert [p.previous for p in pages] == [None, ids[20], ids[40]]  # `before` the page's first turn
    assert back.model_dump() == pages[1].model_dump()


@pytest.mark.parametrize(
    "query, keep",
    [
        ({"conversation": "A"}, "A"),
        ({"conversation": "B"}, "B"),
        ({"conversation": "A", "specialist": "chat"}, "A-chat"),  # two indexed filters: the windowed scan
        ({"conversation": "nobody"}, None),
    ],
)
def test_the_experience_list_filters_by_conversation(engine, query, keep):
    with Session(engine) as s, s.begin():
        ids = _seed(s)
    expected = {"A": ids["A"], "B": ids["B"], "A-chat": [i for i in ids["A"] if i != ids["A"][1]], None: []}[
        keep
    ]
    with Session(engine) as s:
        page = list_experience(session=s, lineage="main", query=ExperienceQuery(**query, limit=3))
        seen = [t.id for t in page.traces]
        while page.older is not None:
            page = list_experience(
                session=s, lineage="main", query=ExperienceQuery(**query, before=page.older, limit=3)
            )
            seen += [t.id for t in page.traces]
        everything = list_experience(session=s, lineage="main", query=ExperienceQuery(limit=200)).traces
    assert seen == sorted(expected, reverse=True)
    marked = {t.id: t.conversation_id for t in everything}
    assert marked == {
        **dict.fromkeys(ids["A"], "A"),
        **dict.fromkeys(ids["B"], "B"),
        **dict.fromkeys(ids[""]),
    }


def test_a_trace_shows_its_conversation_tools_and_served_token_counts(engine):
    with Session(engine) as s, s.begin():
        ids = _seed(s)
    a = ids["A"]
    with Session(engine) as s:
        detail = trace.trace_detail(session=s, experience_id=a[1], lineage="main")
        with_ids = trace.trace_detail(session=s, experience_id=a[1], lineage="main", token_ids=True)
        first = trace.trace_detail(session=s, experience_id=a[0], lineage="main")
        loose = trace.trace_detail(session=s, experience_id=ids[""][0], lineage="main")
    assert (detail.conversation_id, detail.conversation_previous, detail.conversation_next) == (
        "A",
        a[0],
        a[2],
    )
    assert (first.conversation_previous, first.conversation_next) == (None, a[1])
    assert (loose.conversation_id, loose.conversation_previous, loose.tools) == (None, None, None)
    assert [(t.type, t.name, t.description) for t in detail.tools] == [
        ("function", "add", HOSTILE),
        ("function", HOSTILE_ID, "a name with markup"),
        ("web_search", "web_search", ""),
        ("?", "not a tool", ""),
    ]
    assert detail.tools[0].parameters == {"type": "object"} and first.tools is None
    tokens = {t.index: t.tokens for t in detail.turns if t.tokens is not None}
    assert list(tokens) == [3]
    assert (tokens[3].tokenizer, tokens[3].prompt_tokens, tokens[3].completion_tokens) == (TOKENIZER, 5, 2)
    assert tokens[3].prompt_ids is None and tokens[3].completion_ids is None  # counts only, by default
    full = next(t.tokens for t in with_ids.turns if t.index == 3)
    assert (full.prompt_ids, full.completion_ids) == ([5, 6, 7, 8, 9], [10, 11])


# ---------------------------------------------------------------------------------------------- the pages
@pytest.fixture
def pages(tmp_path):
    """A real server of the web app (uvicorn decodes a path once, as in production) over a registry holding
    ``_seed``'s conversations and a turn of each odd id (the hostile one with two turns)."""
    settings = Settings(home=tmp_path)
    upgrade_db(settings.registry_url)
    with session_scope(get_engine(settings.registry_url)) as s:
        ids = _seed(s)
        for k, cid in enumerate([HOSTILE_ID, HOSTILE_ID, *ODD_IDS]):
            insert_traces(session=s, rows=[_row([_user(f"{HOSTILE} {k}"), _assistant(HOSTILE)], cid)])
    with ServerThread(create_app(settings)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c, ids


def _inert(page: str) -> None:
    """Nothing a client sent runs: the markup is there as text only."""
    assert "<script>window" not in page and "<img src=x" not in page and "&lt;script&gt;window" in page


def test_every_odd_conversation_id_has_a_working_page_and_is_shown_inert(pages):
    c, _ = pages
    listing = c.get("/experience", params={"limit": 200})
    assert listing.status_code == 200
    _inert(listing.text)
    links = [html.unescape(h) for h in re.findall(r'<a class="conversation" href="([^"]+)"', listing.text)]
    assert len(links) == 4 + 2 + 2 + len(ODD_IDS)  # every turn with a conversation is marked
    assert f"/conversations/{quote(HOSTILE_ID, safe='')}?lineage=main" in links
    for cid in [HOSTILE_ID, *ODD_IDS]:
        link = next(h for h in links if _decoded(h) == cid)
        page = c.get(link)
        assert page.status_code == 200, (cid, link, page.text[:300])
        _inert(page.text)
        assert str(escape(cid)) in page.text
        api = c.get(f"/api/conversations/{_path(cid)}")
        assert api.status_code == 200, (cid, api.text)
        assert api.json()["conversation_id"] == cid
        assert len(api.json()["turns"]) == (2 if cid == HOSTILE_ID else 1)
        listed = c.get("/api/experience", params={"conversation": cid}).json()["traces"]
        assert [t["id"] for t in listed] == sorted((t["id"] for t in api.json()["turns"]), reverse=True)
    assert c.get(f"/api/conversations/{quote('no such', safe='')}").status_code == 404
    assert c.get("/conversations/" + quote(HOSTILE_ID + "x", safe="")).status_code == 404
    assert c.get("/api/conversations/" + "x" * 101).status_code == 422


def _path(cid: str) -> str:
    """``cid`` as one path segment: every character quoted, dots too (a client would resolve ``..`` away)."""
    return quote(cid, safe="").replace(".", "%2E")


def _decoded(link: str) -> str:
    from urllib.parse import parse_qs, unquote, urlsplit

    parts = urlsplit(link)
    if parts.path.startswith("/conversations/"):
        return unquote(parts.path.removeprefix("/conversations/"))
    return parse_qs(parts.query)["conversation"][0]


def test_the_conversation_page_links_each_turn_and_shows_what_it_added(pages):
    c, ids = pages
    page = c.get("/conversations/A")
    assert page.status_code == 200
    for i in ids["A"]:
        assert f'href="/experience/{i}?lineage=main"' in page.text
    assert page.text.index("add 1 and 2") < page.text.index("it is 3") < page.text.index("and times 4?")
    assert page.text.count("add 1 and 2") == 1  # the shared prefix is not repeated
    assert "4 of the turn before's messages not repeated" in page.text
    api = c.get("/api/conversations/A", params={"limit": 2}).json()
    assert [t["id"] for t in api["turns"]] == ids["A"][:2] and api["next"] == ids["A"][1]
    later = c.get("/conversations/A", params={"limit": 2, "after": api["next"]})
    assert f"/experience/{ids['A'][2]}?" in later.text and f"/experience/{ids['A'][0]}?" not in later.text
    assert f'href="/conversations/A?lineage=main&before={ids["A"][2]}"' in later.text


def test_the_trace_page_shows_tools_escaped_and_token_counts(pages):
    c, ids = pages
    page = c.get(f"/experience/{ids['A'][1]}")
    assert page.status_code == 200
    _inert(page.text)
    tools = page.text[page.text.index('id="tools"') :]
    assert str(escape(HOSTILE)) in tools and "web_search" in tools and "not a tool" in tools
    assert "5 prompt + 2 completion" in page.text and TOKENIZER[:16] in page.text
    assert "5 6 7 8 9" not in page.text  # the ids themselves only when asked for
    assert "prompt: 5 6 7 8 9" in c.get(f"/experience/{ids['A'][1]}", params={"token_ids": "true"}).text
    assert 'href="/conversations/A?lineage=main"' in page.text
    assert f'href="/experience/{ids["A"][0]}?lineage=main" rel="prev"' in page.text
    hostile = c.get(f"/api/experience?conversation={quote(HOSTILE_ID, safe='')}").json()["traces"][0]["id"]
    shown = c.get(f"/experience/{hostile}")
    _inert(shown.text)
    assert f'href="/conversations/{quote(HOSTILE_ID, safe="")}?lineage=main"' in shown.text
