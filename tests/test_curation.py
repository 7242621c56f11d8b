"""Curation under the contract's selection rules; held-out items never reach a training set."""

from __future__ import annotations

from pathlib import Path

from pipeline.contract import load_contract
from pipeline.curation import Candidate, prompt_key, save_dataset, select_examples
from pipeline.training import dataset_sha256

CONTRACT = load_contract(Path(__file__).resolve().parent.parent / "contracts" / "demo.yaml")


def _cand(i, q, a, score, specialist="chat", **kw):
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": q},
        {"role": "assistant", "content": a},
    ]
    return Candidate(
        experience_id=i,
        specialist=specialist,
        score=score,
        messages=msgs,
        metadata=kw.pop("metadata", {}),
        feedback=kw.pop("feedback", None),
        source=kw.pop("source", "simulation"),
    )


def test_threshold_dedup_and_best_kept():
    cands = [
        _cand(1, "1+1", "2", 1.0),
        _cand(2, "1+1", "2", 0.9),
        _cand(3, "2+2", "5", 0.1),
        _cand(4, "3+3", "6", 0.85),
        _cand(5, "3+3", "6!", 0.95),
    ]
    by_prompt = _with_selection(dedup="prompt")
    result = select_examples(cands, contract=by_prompt, heldout_prompts=set())
    chat = result.examples["chat"]
    assert [e["experience_id"] for e in chat] == [1, 5]
    assert result.dropped["below threshold"] == 1 and result.dropped["duplicate"] == 2
    # `content` drops exact repeats only; `none` keeps every attempt above the threshold
    content = select_examples(cands, contract=_with_selection(dedup="content"), heldout_prompts=set())
    assert [e["experience_id"] for e in content.examples["chat"]] == [1, 4, 5]
    everything = select_examples(cands, contract=_with_selection(dedup="none"), heldout_prompts=set())
    assert [e["experience_id"] for e in everything.examples["chat"]] == [1, 2, 4, 5]


def _with_selection(**changes):
    return CONTRACT.model_copy(update={"selection": CONTRACT.selection.model_copy(update=changes)})


def test_heldout_never_reaches_training():
    heldout = _cand(9, "7+8", "15", 1.0)
    cands = [
        heldout,
        _cand(10, "9+9", "18", 1.0, metadata={"split": "heldout"}),
        _cand(11, "4+4", "8", 1.0, source="evaluation"),
        _cand(12, "5+5", "10", 1.0),
        # a held-out prompt with a user correction still stays out
        _cand(13, "7+8", "14", 0.0, feedback={"rating": 1, "correction": "15"}),
    ]
    result = select_examples(cands, contract=CONTRACT, heldout_prompts={prompt_key(heldout.messages)})
    assert [e["experience_id"] for e in result.examples["chat"]] == [12]
    assert result.dropped["held-out"] == 4


def test_corrections_become_examples_and_caps_apply():
    cands = [_cand(1, "6+6", "11", 0.0, feedback={"rating": 1, "correction": "12"})]
    cands += [_cand(100 + i, f"{i}+0", str(i), 0.9 + i / 1000, specialist="agent") for i in range(5)]
    contract = CONTRACT.model_copy(
        update={"selection": CONTRACT.selection.model_copy(update={"max_examples": {"agent": 2}})}
    )
    result = select_examples(cands, contract=contract, heldout_prompts=set())
    assert result.examples["chat"][0]["messages"][-1] == {"role": "assistant", "content": "12"}
    assert [e["experience_id"] for e in result.examples["agent"]] == [103, 104]  # the two best
    assert result.dropped["over cap"] == 3


def test_saved_dataset_is_hashed(tmp_path):
    examples = [
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "score": 1.0,
            "experience_id": 1,
        }
    ]
    digest, n = save_dataset(examples, tmp_path / "ds")
    from datasets import load_from_disk

    saved = load_from_disk(str(tmp_path / "ds")).to_list()
    assert n == 1 and digest == dataset_sha256(saved) and len(digest) == 64
    assert saved[0]["experience_id"] == 1 and saved[0]["messages"][1]["content"] == "yo"
