"""``ratchet ingest --from openai``: stored completions built from the ``openai`` SDK's own types (the
``ChatCompletion``s a real ``ratchet serve`` returned, ``ChatCompletionStoreMessage`` inputs)."""

from __future__ import annotations

import json

from conftest import run_cli

from experience.support import quarantined, stored_rows


def test_openai_stored_completions_from_the_sdk_types(served, tmp_path, capsys):
    from openai.types.chat import ChatCompletionStoreMessage

    path = tmp_path / "stored.jsonl"
    lines = []
    for n, (completion, given) in enumerate(
        [(served["plain"], [{"role": "user", "content": "12+35=?"}]), (served["follow"], served["convo"])]
    ):
        stored = completion.model_copy(update={"metadata": {"conversation_id": "oa-conv", "n": str(n)}})
        messages = [
            ChatCompletionStoreMessage.model_construct(id=f"m{n}-{i}", **m) for i, m in enumerate(given)
        ]
        lines.append(
            json.dumps({**stored.model_dump(mode="json"), "messages": [m.model_dump() for m in messages]})
        )
    lines.append(json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "choices": [], "messages": []}))
    lines.append("{not json")
    path.write_text("\n".join(lines) + "\n")
    assert run_cli(["ingest", "--from", "openai", str(path)]) == 0
    assert "4 turns: 2 stored, 0 duplicate, 2 quarantined" in capsys.readouterr().out
    rows = stored_rows()
    assert [r.conversation_id for r in rows] == ["oa-conv", "oa-conv"]
    assert rows[1].messages[:-1] == served["convo"]
    assert rows[1].messages[-1]["content"] == served["follow"].choices[0].message.content
    assert rows[0].meta["origin"] == {"system": "openai", "trace": served["plain"].id}
    assert run_cli(["ingest", "--from", "openai", str(path)]) == 0
    assert "2 duplicate, 2 quarantined" in capsys.readouterr().out
    assert len(stored_rows()) == 2 and len(quarantined()) == 2  # a rerun quarantines nothing twice
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert run_cli(["ingest", "--from", "openai", str(plain)]) == 1
    assert "not OpenAI stored completions" in capsys.readouterr().err
