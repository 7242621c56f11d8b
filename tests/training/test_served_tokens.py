"""Served token ids are what training learns: a reply the server decoded is trained on exactly the ids it was
given and wrote (``Experience.served_tokens``), not on a re-rendering of its stored text -- when the job's
tokenizer is the one that served it, the reply is the served message (not a correction) and it fits.

On the Qwen3 fixture (``realmodel``, ChatML with tools): a two-turn tool episode stored as the server stores
it (one experience row per served turn), whose served ids differ from a re-rendering in both the prompt (a
harness's view) and the completion (a non-canonical BPE segmentation the model sampled). The helpers
``registry_candidates`` / ``sft_examples`` / ``served_sft_examples`` give the exact examples the SFT job
trains on from experience rows in a registry; the end-to-end test with a real server reuses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from datasets import load_from_disk
from realmodel import build_real_model

from pipeline.experience.eligibility import Candidate, Drops
from pipeline.experience.ingest import trace_row
from pipeline.experience.preferences import preference_pairs
from pipeline.loop.curation import save_dataset, select_examples, served_tokens_by_trace, training_rows
from pipeline.modeling.pair import offered_tools
from pipeline.modeling.prompting import render_messages
from pipeline.modeling.templating import (
    IGNORE,
    encode_chat,
    encode_prompt,
    encode_text,
    model_messages,
    tokenizer_fingerprint,
)
from pipeline.registry import Experience, get_engine, session_scope
from pipeline.registry.experience import insert_traces
from pipeline.specs.contract import ContractSpec, load_contract
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.heldout import HeldoutIndex
from pipeline.training.artifacts import conversations_sha256, stored_dataset_sha256
from pipeline.training.dpo import encode_pairs
from pipeline.training.job import EncodedRows, encode_dataset, sequence_limit

ROOT = Path(__file__).resolve().parents[2]
SPECIALIST = "agent"
CALL = {
    "id": "k3Xq9Lm2P",
    "type": "function",
    "function": {"name": "set_timer", "arguments": '{"minutes": 47}'},
}
ASK = {"role": "user", "content": "The quick brown fox wants to wait: count down 47 minutes"}
EPISODE = [
    ASK,
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": '{"ok": true, "minutes": 47}'},
    {"role": "assistant", "content": "The timer is set: 47 minutes."},
]
NO_HELDOUT = HeldoutIndex.build([], ngram=6, threshold=0.5)


def harness() -> HarnessSpec:
    """The demo harness as a Qwen3 agent takes it: structured tool calls (``openai``), one short tool (the
    fixture's 400-token vocabulary spells a schema out in many tokens), a token-sized context."""
    spec = yaml.safe_load((ROOT / "harnesses" / "demo.yaml").read_text())
    timer = {"name": "set_timer", "description": "A timer.",
             "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}}}  # fmt: skip
    spec |= {"tool_call_format": "openai", "tools": [{"type": "function", "function": timer}]}
    spec["specialists"][SPECIALIST]["tools"] = ["set_timer"]
    spec["context"] |= {"max_context_tokens": 512, "max_context_chars": None}
    return HarnessSpec.model_validate(spec)


def contract() -> ContractSpec:
    """The demo contract, every selected row kept (no validation slice, no dedup, no share cap)."""
    spec = load_contract(ROOT / "contracts" / "demo.yaml")
    rules = spec.selection.model_copy(
        update={"validation_share": 0.0, "dedup": "none", "max_share_per_principal": 1.0}
    )
    return spec.model_copy(update={"selection": rules})


# ---------------------------------------------------------------------------------------- helpers (e2e)
def registry_candidates(engine: Any, specialist: str) -> tuple[list[Candidate], dict[int, dict[str, Any]]]:
    """Every experience row of ``engine``'s registry as a verified, passing candidate of ``specialist``
    (scoring is not what these tests test), with the rows' ``served_tokens`` by trace id as curation reads
    them (``curation.served_tokens_by_trace``)."""
    with session_scope(engine) as session:
        rows = session.query(Experience).order_by(Experience.id).all()
        candidates = [
            Candidate(experience_id=r.id, specialist=specialist, score=1.0, messages=r.messages,
                      metadata=r.meta or {}, feedback=r.feedback, source=r.source, verified=True,
                      principal=r.principal, routes=r.routes if isinstance(r.routes, list) else [])
            for r in rows
        ]  # fmt: skip
        served = served_tokens_by_trace(session, [c.experience_id for c in candidates])
    return candidates, served


def sft_examples(
    candidates: list[Candidate],
    served: dict[int, dict[str, Any]],
    *,
    tokenizer: Any,
    harness: HarnessSpec,
    contract: ContractSpec,
    specialist: str,
    out_dir: Path,
    max_len: int,
) -> EncodedRows:
    """The exact examples the SFT job trains on from ``candidates``: curation's selection and rows
    (``select_examples``, ``training_rows``), the dataset saved and loaded back (``save_dataset``), then
    the job's own encoding (``job.encode_dataset``) of the rows it loads."""
    selected = select_examples(candidates, contract=contract, heldout=NO_HELDOUT, specialists=[specialist])
    by_id = {c.experience_id: c for c in candidates}
    rows = training_rows(selected.examples[specialist], harness=harness, specialist=specialist,
                         sources=by_id, dropped=Drops(), served=served)  # fmt: skip
    save_dataset(rows, out_dir)
    loaded = load_from_disk(str(out_dir)).to_list()
    return encode_dataset(tokenizer, loaded, max_len, fmt=harness.tool_call_format, where=str(out_dir))


def served_sft_examples(
    engine: Any,
    *,
    model_dir: Path,
    harness: HarnessSpec,
    contract: ContractSpec,
    specialist: str,
    out_dir: Path,
) -> EncodedRows:
    """What the SFT job on ``model_dir``'s tokenizer and context length trains on from the experience rows
    in ``engine``'s registry (for the end-to-end test: rows a real server stored)."""
    from transformers import AutoTokenizer

    candidates, served = registry_candidates(engine, specialist)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sft_examples(candidates, served, tokenizer=tokenizer, harness=harness, contract=contract,
                        specialist=specialist, out_dir=out_dir, max_len=sequence_limit(model_dir))  # fmt: skip


# ---------------------------------------------------------------------------------------- the episode
def resegmented(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the model may sample it: one character at a time, not BPE's canonical merges."""
    return [i for ch in text for i in encode_text(tokenizer, ch)]


def completion_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The text the model writes for ``messages``' last (assistant) turn, its end token left out."""
    shown = model_messages(messages, "openai")
    before = tokenizer.apply_chat_template(
        shown[:-1], tools=tools, tokenize=False, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(shown, tools=tools, tokenize=False)
    assert full.startswith(before)
    return full[len(before) :].removesuffix("\n").removesuffix("<|im_end|>")


def served_turn(tokenizer: Any, messages: list[dict[str, Any]], *, reshape_prompt: bool) -> dict[str, Any]:
    """The ``ServedTokens`` of ``messages``' last turn as a server decoding it would store them: the
    harness's view as the prompt (with the user's text segmented otherwise where ``reshape_prompt``: a view
    that differs from re-rendering the stored messages), the reply sampled in a non-canonical segmentation,
    then the end token it stopped on."""
    tools = offered_tools(harness(), SPECIALIST)
    view = render_messages(harness(), SPECIALIST, messages[:-1])
    prompt = encode_prompt(tokenizer, view, fmt="openai", tools=tools)
    if reshape_prompt:
        canonical, other = encode_text(tokenizer, ASK["content"]), resegmented(tokenizer, ASK["content"])
        at = next(i for i in range(len(prompt)) if prompt[i : i + len(canonical)] == canonical)
        prompt = [*prompt[:at], *other, *prompt[at + len(canonical) :]]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = [*resegmented(tokenizer, completion_text(tokenizer, messages, tools)), end]
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "prompt_ids": prompt, "completion_ids": completion}


def store_episode(engine: Any, tokenizer: Any, *, fingerprint: str | None = None) -> list[dict[str, Any]]:
    """The two served turns of ``EPISODE`` as the server stores them (one row per turn, the served ids
    under the reply's index); returns the served ids of each turn."""
    turns = [EPISODE[:2], EPISODE]
    served = [served_turn(tokenizer, turn, reshape_prompt=n == 1) for n, turn in enumerate(turns)]
    for entry in served:
        entry["tokenizer"] = fingerprint or entry["tokenizer"]
    rows = [
        trace_row({"messages": turn, "metadata": {"specialist": SPECIALIST}}, source="deployment",
                  principal="ratchet", conversation_id="conv-1", served_tokens={str(len(turn) - 1): entry})
        for turn, entry in zip(turns, served, strict=True)
    ]  # fmt: skip
    with session_scope(engine) as session:
        assert insert_traces(session=session, rows=rows) == 2
    return served


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return build_real_model(tmp_path_factory.mktemp("qwen") / "model", family="chatml", sharpness=1.0)


@pytest.fixture()
def tok(qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen)  # as the server and the job load it


@pytest.fixture()
def engine(tmp_path):
    return get_engine(f"sqlite:///{tmp_path / 'registry.db'}")


def example_of(served: dict[str, Any]) -> tuple[list[int], list[int]]:
    prompt, completion = served["prompt_ids"], served["completion_ids"]
    return prompt + completion, [IGNORE] * len(prompt) + completion


def rerendered(tok: Any, messages: list[dict[str, Any]], max_len: int) -> tuple[list[int], list[int]]:
    """What training did before served ids were stored: the harness's view re-rendered."""
    view = [*render_messages(harness(), SPECIALIST, messages[:-1]), messages[-1]]
    return encode_chat(tok, view, max_len, fmt="openai", tools=offered_tools(harness(), SPECIALIST))


# ---------------------------------------------------------------------------------------- tests
def test_a_served_tool_episode_trains_on_exactly_the_ids_served(qwen, tok, engine, tmp_path):
    served = store_episode(engine, tok)
    max_len = sequence_limit(qwen)
    encoded = served_sft_examples(engine, model_dir=qwen, harness=harness(), contract=contract(),
                                  specialist=SPECIALIST, out_dir=tmp_path / "ds")  # fmt: skip
    assert encoded.examples == [example_of(s) for s in served]  # labels exactly on the completion ids
    assert encoded.dropped == {} and encoded.token_ids == {"served": 2}
    for (ids, labels), entry, turn in zip(encoded.examples, served, [EPISODE[:2], EPISODE], strict=True):
        trained = [t for t in labels if t != IGNORE]
        assert trained == entry["completion_ids"] and trained[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        # the same text, other ids: a re-rendering would have trained on something the model never wrote
        old = rerendered(tok, turn, max_len)
        assert tok.decode(trained) == tok.decode([t for t in old[1] if t != IGNORE]).removesuffix("\n")
        assert (ids, labels) != old and trained != [t for t in old[1] if t != IGNORE][: len(trained)]
    # the second turn's prompt is the harness's view the server gave, not the stored messages re-rendered
    prompt = served[1]["prompt_ids"]
    assert (
        encoded.examples[1][0][: len(prompt)] == prompt != rerendered(tok, EPISODE, max_len)[0][: len(prompt)]
    )


def test_ids_another_tokenizer_served_are_re_rendered(qwen, tok, engine, tmp_path):
    store_episode(engine, tok, fingerprint="0" * 64)
    max_len = sequence_limit(qwen)
    encoded = served_sft_examples(engine, model_dir=qwen, harness=harness(), contract=contract(),
                                  specialist=SPECIALIST, out_dir=tmp_path / "ds")  # fmt: skip
    assert encoded.token_ids == {"re-rendered: other tokenizer": 2}
    assert encoded.examples == [rerendered(tok, EPISODE[:2], max_len), rerendered(tok, EPISODE, max_len)]


def test_a_corrected_reply_is_re_rendered_and_its_served_ids_are_not_learned(qwen, tok, engine, tmp_path):
    served = store_episode(engine, tok)
    candidates, by_trace = registry_candidates(engine, SPECIALIST)
    fix = "Done: a 47 minute timer."
    candidates[1].feedback = {"correction": fix}
    candidates[1].correction = {"total": 1.0, "verified_by": ["tool_call"], "failed": []}
    candidates[1].score = 0.0  # the served reply failed; the user's correction passed
    max_len = sequence_limit(qwen)
    encoded = sft_examples(candidates, by_trace, tokenizer=tok, harness=harness(), contract=contract(),
                           specialist=SPECIALIST, out_dir=tmp_path / "ds", max_len=max_len)  # fmt: skip
    corrected = [*EPISODE[:3], {"role": "assistant", "content": fix}]
    assert encoded.token_ids == {"served": 1, "re-rendered": 1}
    assert encoded.examples == [example_of(served[0]), rerendered(tok, corrected, max_len)]
    assert tok.decode([t for t in encoded.examples[1][1] if t != IGNORE]) == f"{fix}<|im_end|>\n"


def test_served_ids_longer_than_max_seq_len_are_re_rendered_with_old_turns_cut(qwen, tok, engine, tmp_path):
    served = store_episode(engine, tok)
    candidates, by_trace = registry_candidates(engine, SPECIALIST)
    max_len = len(example_of(served[1])[0]) - 1  # the second turn's served ids no longer fit
    assert len(rerendered(tok, EPISODE, 10**6)[0]) <= max_len  # its canonical re-rendering does
    encoded = sft_examples(candidates, by_trace, tokenizer=tok, harness=harness(), contract=contract(),
                           specialist=SPECIALIST, out_dir=tmp_path / "ds", max_len=max_len)  # fmt: skip
    assert encoded.token_ids == {"served": 1, "re-rendered: served ids over max_seq_len": 1}
    assert encoded.examples == [example_of(served[0]), rerendered(tok, EPISODE, max_len)]


def test_dpo_trains_each_side_on_its_served_ids(qwen, tok, engine, tmp_path):
    served = store_episode(engine, tok)
    wrong = [*EPISODE[:3], {"role": "assistant", "content": "No timer for you."}]
    other = served_turn(tok, wrong, reshape_prompt=False)
    with session_scope(engine) as session:
        row = trace_row({"messages": wrong, "metadata": {"specialist": SPECIALIST}}, source="deployment",
                        principal="ratchet", served_tokens={"3": other})  # fmt: skip
        insert_traces(session=session, rows=[row])
    candidates, by_trace = registry_candidates(engine, SPECIALIST)
    candidates = candidates[1:]  # the answer and the wrong answer to the same prompt
    candidates[1].score = 0.0
    spec = contract()
    pairs = preference_pairs(candidates, contract=spec, heldout=NO_HELDOUT, specialists=[SPECIALIST],
                             max_pairs={SPECIALIST: 10}).pairs[SPECIALIST]  # fmt: skip
    assert len(pairs) == 1
    rows = training_rows(pairs, harness=harness(), specialist=SPECIALIST,
                         sources={c.experience_id: c for c in candidates}, dropped=Drops(), served=by_trace)  # fmt: skip
    save_dataset(rows, tmp_path / "dpo")
    loaded = load_from_disk(str(tmp_path / "dpo")).to_list()
    encoded, dropped, token_ids = encode_pairs(tok, loaded, sequence_limit(qwen), fmt="openai", where="test")
    assert dropped == {} and token_ids == {"chosen served": 1, "rejected served": 1}
    assert encoded == [(example_of(served[1]), example_of(other))]
    # another tokenizer's ids: both sides re-rendered (the same rendered context)
    for entry in (served[1], other):
        entry["tokenizer"] = "0" * 64
    stale = [{**r, "served_tokens": json.dumps(served[1]), "rejected_served_tokens": json.dumps(other)}
             for r in loaded]  # fmt: skip
    again, _, token_ids = encode_pairs(tok, stale, sequence_limit(qwen), fmt="openai", where="test")
    assert token_ids == {"chosen re-rendered: other tokenizer": 1, "rejected re-rendered: other tokenizer": 1}
    max_len = sequence_limit(qwen)
    assert again == [(rerendered(tok, EPISODE, max_len), rerendered(tok, wrong, max_len))]


def test_the_served_ids_are_part_of_the_dataset_hash(tok, engine, tmp_path):
    store_episode(engine, tok)
    candidates, by_trace = registry_candidates(engine, SPECIALIST)
    selected = select_examples(candidates, contract=contract(), heldout=NO_HELDOUT, specialists=[SPECIALIST])

    def saved(served: dict[int, dict[str, Any]], name: str) -> str:
        rows = training_rows([dict(e) for e in selected.examples[SPECIALIST]], harness=harness(),
                             specialist=SPECIALIST, sources={c.experience_id: c for c in candidates},
                             dropped=Drops(), served=served)  # fmt: skip
        digest, _ = save_dataset(rows, tmp_path / name)
        assert digest == stored_dataset_sha256(tmp_path / name)  # what the job logs with its adapter
        return digest

    with_ids, without = saved(by_trace, "with"), saved({}, "without")
    other = {k: {i: {**e, "completion_ids": e["completion_ids"][1:]} for i, e in v.items()}
             for k, v in by_trace.items()}  # fmt: skip
    assert len({with_ids, without, saved(other, "other")}) == 3
    # a dataset without served ids hashes as it did before they were stored: its conversations alone
    loaded = load_from_disk(str(tmp_path / "without"))
    assert without == conversations_sha256(loaded["messages"])


def test_the_job_counts_and_records_where_its_ids_came_from(qwen, tok, engine, tmp_path):
    from pipeline.training import TrainConfig, train_lora

    store_episode(engine, tok)
    candidates, by_trace = registry_candidates(engine, SPECIALIST)
    selected = select_examples(candidates, contract=contract(), heldout=NO_HELDOUT, specialists=[SPECIALIST])
    rows = training_rows(selected.examples[SPECIALIST], harness=harness(), specialist=SPECIALIST,
                         sources={c.experience_id: c for c in candidates}, dropped=Drops(), served=by_trace)  # fmt: skip
    rows[0]["served_tokens"] = {**rows[0]["served_tokens"], "tokenizer": "0" * 64}
    save_dataset(rows, tmp_path / "ds")
    config = TrainConfig(rank=2, alpha=4, max_steps=1, batch_size=2, tool_call_format="openai")
    result = train_lora(base_model_dir=qwen, dataset_dir=tmp_path / "ds", output_dir=tmp_path / "job",
                        config=config)  # fmt: skip
    assert result.token_ids == {"served": 1, "re-rendered: other tokenizer": 1}
    record = json.loads((result.adapter_dir / "lineage.json").read_text())
    assert record["token_ids"] == result.token_ids
    assert "| Token ids | 1 of 2 as served" in (result.adapter_dir / "README.md").read_text()


def test_a_served_prompt_whose_client_tools_hold_a_held_out_text_is_not_learned(tok, engine):
    """The served prompt shows the client's tools (``Experience.tools``), which a re-rendering never does: a
    held-out prompt hidden in them keeps the trace's served ids out (it is re-rendered without them)."""
    from pipeline.specs.heldout import heldout_index

    entry = served_turn(tok, EPISODE[:2], reshape_prompt=False)
    tool = {
        "type": "function",
        "function": {"name": "set_timer", "description": "set a timer for 12+35 minutes"},
    }
    with session_scope(engine) as session:
        row = trace_row({"messages": EPISODE[:2], "metadata": {}}, source="deployment", principal="ratchet",
                        tools=[tool], served_tokens={"1": entry})  # fmt: skip
        insert_traces(session=session, rows=[row])
        ids = [i for (i,) in session.query(Experience.id)]
        assert served_tokens_by_trace(session, ids) == {ids[0]: {"1": entry}}
        assert served_tokens_by_trace(session, ids, heldout=heldout_index(contract())) == {}


def test_served_ids_a_job_cannot_read_are_re_rendered(tok):
    """Text that is no JSON, ids outside the vocabulary, an empty prompt or reply: the row is re-rendered
    (and counted), never trained on ids the model cannot take."""
    entry = served_turn(tok, EPISODE[:2], reshape_prompt=False)
    broken = [
        "not json",
        json.dumps({**entry, "completion_ids": [*entry["completion_ids"], len(tok)]}),
        json.dumps({**entry, "prompt_ids": []}),
        json.dumps({**entry, "tokenizer": None}),
    ]
    view = [*render_messages(harness(), SPECIALIST, EPISODE[:1]), EPISODE[1]]
    tools = json.dumps(offered_tools(harness(), SPECIALIST))
    rows = [{"messages": view, "tools": tools, "served_tokens": text} for text in broken]
    encoded = encode_dataset(tok, [*rows, {**rows[0], "served_tokens": json.dumps(entry)}], 512, fmt="openai",
                             where="test")  # fmt: skip
    assert encoded.token_ids == {"re-rendered: served ids unreadable": 4, "served": 1}
    assert encoded.examples == [rerendered(tok, EPISODE[:2], 512)] * 4 + [example_of(entry)]
