"""Paired comparison statistics of two pairs on the same held-out items."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from pipeline.loop.evaluation import Comparison, compare_scores

ROOT = Path(__file__).resolve().parents[1]


def _scores(p, n, seed):
    rng = random.Random(seed)
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


def test_paired_means_deltas_and_standard_errors():
    champ = {"chat": [1.0, 0.0, 0.0, 1.0], "agent": [0.0, 0.0, 1.0, 1.0]}
    cand = {"chat": [1.0, 1.0, 0.0, 1.0], "agent": [0.0, 1.0, 1.0, 0.0]}
    c = compare_scores(champ, cand)
    assert c.specialists["chat"].delta == pytest.approx(0.25) and c.specialists["agent"].delta == 0.0
    # chat differences [0, 1, 0, 0]: sample variance 0.25, SE sqrt(0.25 / 4)
    assert c.specialists["chat"].se == pytest.approx(0.25)
    assert c.delta == pytest.approx(0.125) and c.candidate_overall - c.champion_overall == pytest.approx(
        0.125
    )
    # overall SE: sqrt(se_chat^2 + se_agent^2) / 2 specialists
    agent_se = c.specialists["agent"].se
    assert c.se == pytest.approx(math.sqrt(0.25**2 + agent_se**2) / 2)
    assert Comparison.from_dict(c.to_dict()) == c


def test_identical_results_have_no_variance_and_mismatched_items_are_refused():
    same = {"chat": _scores(0.4, 50, 1)}
    c = compare_scores(same, same)
    assert c.delta == 0.0 and c.se == 0.0 and math.isinf(c.df)
    with pytest.raises(ValueError, match="specialists differ"):
        compare_scores({"chat": [1.0]}, {"agent": [1.0]})
    with pytest.raises(ValueError, match="3 champion items vs 2"):
        compare_scores({"chat": [1.0] * 3}, {"chat": [1.0] * 2})


# ---- scoring both pairs: interleaved, final turn, unscored items left out (issue 21) ------------------------
class _FlakyJudge:
    """A real OpenAI-compatible judge on loopback that answers "8" except for the requests numbered in
    ``down`` (counted from 0), which get HTTP 503 (with ``retry=False``, marked not to be retried, so one
    failed request is one failed grade)."""

    def __init__(self, down: range, *, retry: bool = True):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen, self.down = 0, down
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                self.rfile.read(int(self.headers["Content-Length"]))
                n, judge.seen = judge.seen, judge.seen + 1
                status = 503 if n in judge.down else 200
                body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "8"}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if not retry:
                    self.send_header("x-should-retry", "false")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _judged_contract(url: str):
    from pipeline.specs.contract import ContractSpec

    return ContractSpec.model_validate({
        "name": "judged", "version": "1", "default_specialist": "chat",
        "protocol": {"context_budget": {"max_tokens": 512}},
        "specialists": {"chat": {"scorers": [
            {"kind": "judge", "base_url": url, "model": "g", "model_version": "1", "rubric": "r", "timeout_s": 5}
        ]}},
    })  # fmt: skip


def _answers(n: int) -> list[dict]:
    return [
        {
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
            "metadata": {},
        }
        for i in range(n)
    ]


def test_a_judge_outage_hits_both_pairs_of_the_same_items():
    """Found on main: each pair was scored whole, the champion first, and an unreachable judge scored 0: a judge
    down for the champion's half and back for the candidate's promoted identical answers at +0.600. Now both
    pairs are scored item by item, interleaved; an item unscored on either side is left out and counted, and
    past `promotion.max_unscored_share` the step fails with one line."""
    from pipeline.errors import RatchetError
    from pipeline.loop.evaluation import ItemScore, check_unscored, paired_values, score_both
    from pipeline.specs.harness import load_harness

    harness = load_harness(ROOT / "harnesses" / "demo.yaml")
    same = _answers(50)
    judge = _FlakyJudge(down=range(0, 2))  # the champion's item 0 fails (its request and the client's retry)
    try:
        contract = _judged_contract(judge.url)
        scored = score_both(contract, (harness, {"chat": same}), (harness, {"chat": same}))
    finally:
        judge.close()
    champ, cand, unscored = paired_values(scored)
    assert unscored == {"chat": [0]} and len(champ["chat"]) == len(cand["chat"]) == 49
    assert compare_scores(champ, cand).delta == 0.0  # identical answers are identical
    assert "judge request failed" in scored["chat"][0][0].error
    with pytest.raises(RatchetError, match=r"1 of 50 held-out items \(2\.0%\).*max_unscored_share 0\.01"):
        check_unscored(scored, unscored, 0.01)
    check_unscored(scored, unscored, 0.02)  # at the default share: within it, the item left out
    many_lines = {"chat": [(ItemScore(None, "tests:\n  line 2\n  line 3"), ItemScore(1.0))]}
    with pytest.raises(RatchetError) as one_line:
        check_unscored(many_lines, {"chat": [0]}, 0.02)
    assert str(one_line.value).endswith("(over promotion.max_unscored_share 0.02): tests: line 2 line 3")


def test_an_item_is_scored_on_its_final_turn():
    from pipeline.loop.evaluation import item_score
    from pipeline.specs.contract import load_contract
    from pipeline.specs.harness import load_harness

    contract = load_contract(ROOT / "contracts" / "demo.yaml")
    harness = load_harness(ROOT / "harnesses" / "demo.yaml")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 3
    trace = {"messages": [*messages, {"role": "user", "content": "40+44=?"}, {"role": "assistant", "content": "99"}],
             "metadata": {"expected": "84"}}  # fmt: skip
    scored = item_score(contract, trace, harness=harness, specialist="chat")
    assert scored.value < 0.2  # the wrong final answer, not the mean over the greetings (0.79)


def test_an_item_is_unscored_only_when_a_scorer_that_applies_could_not_give_a_verdict():
    from pipeline.loop.evaluation import item_score
    from pipeline.specs.contract import load_contract
    from pipeline.specs.harness import load_harness

    contract = load_contract(ROOT / "contracts" / "demo.yaml")
    harness = load_harness(ROOT / "harnesses" / "demo.yaml")

    def score(specialist, answer, metadata):
        trace = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}],
                 "metadata": metadata}  # fmt: skip
        return item_score(contract, trace, harness=harness, specialist=specialist)

    # the schema in the item cannot be read: json_schema applied and reached no verdict
    broken = score("genui", '{"type": "button"}', {"schema": "not a schema"})
    assert broken.value is None and broken.error.startswith(
        "json_schema: metadata.schema is not a JSON Schema"
    )
    # a wrong answer is a score (0 from the gate), not a gap
    assert score("genui", "no json", {"schema": {"type": "object"}}).value == 0.0
    # feedback does not apply to an item (no rating): the others score it
    assert score("chat", "84", {"expected": "84"}).value == pytest.approx(1.0)
    # a note that the specialist was scored as the contract's default is not a scorer without a verdict
    assert score("support", "84", {"expected": "84"}).value == pytest.approx(1.0)
    # no assistant turn at all
    empty = item_score(
        contract, {"messages": [{"role": "user", "content": "q"}]}, harness=harness, specialist="chat"
    )
    assert empty.value is None and empty.error == "no scorer applies to the final turn"


def test_a_judge_down_for_the_champions_half_fails_the_evaluation_step(small_base, tmp_path):
    """The finding through ``evaluate_step``: a champion and a candidate that are the same pair, under a
    contract whose only scorer is a judge, and a judge that is down for the first 100 requests -- on main the
    champion's 100 items (scored first, whole) -- then back. On main the candidate's identical answers scored
    +0.800 and the step went on to the verdict. Now half of each pair's items are unscored, and the step fails
    with one line; rerun with a one-request blip, the item is left out of both sides, counted, and the delta
    is 0."""
    import yaml
    from conftest import write_specs
    from sqlalchemy import func, select

    from pipeline.cli.advance import lineage_rows
    from pipeline.errors import RatchetError
    from pipeline.loop.advance import begin_candidate
    from pipeline.loop.candidate import AdvanceConfig, load_generation, mark_step
    from pipeline.loop.evaluation import evaluate_step
    from pipeline.loop.founding import init_lineage
    from pipeline.registry import EvaluationItem, get_engine, session_scope

    judge = _FlakyJudge(down=range(0, 100), retry=False)
    try:
        specs = write_specs(tmp_path, small_base, heldout_size=25)  # 4 specialists: 100 items per pair
        contract = yaml.safe_load(specs["contract"].read_text())
        for entry in contract["specialists"].values():
            entry["scorers"] = [{"kind": "judge", "base_url": judge.url, "model": "g", "model_version": "1",
                                 "rubric": "r", "timeout_s": 5}]  # fmt: skip
        specs["contract"].write_text(yaml.safe_dump(contract))
        init_lineage(contract_path=specs["contract"], harness_path=ROOT / "harnesses" / "demo.yaml",
                     model_path=specs["model"])  # fmt: skip
        config = AdvanceConfig(seed=1)
        gen_id = begin_candidate(config=config, owner="test")  # the champion's adapters: the same pair
        with session_scope(get_engine()) as s:
            gen = load_generation(s, gen_id)
            for step in ("collect", "score", "curate", "train", "codesign"):
                mark_step(s, gen, step, {"skipped": "the candidate is the champion's pair"})
        with pytest.raises(RatchetError) as failed:
            evaluate_step(generation_id=gen_id, config=config)
        assert str(failed.value).startswith(
            "evaluation: 50 of 100 held-out items (50.0%) could not be scored on both pairs (over "
            "promotion.max_unscored_share 0.02): judge: judge request failed: "
        ) and "\n" not in str(failed.value)
        judge.seen, judge.down = 0, range(0, 1)  # back, but for one request: the champion's first item
        evaluation = evaluate_step(generation_id=gen_id, config=config)
    finally:
        judge.close()
    assert evaluation["comparison"]["delta"] == 0.0 and evaluation["overall"] == pytest.approx(0.8)
    ((specialist, left_out),) = evaluation["unscored"].items()
    assert left_out == 1 and "judge request failed" in evaluation["unscored_errors"][specialist]
    assert evaluation["comparison"]["specialists"][specialist]["n"] == 24
    with session_scope(get_engine()) as s:  # the dashboard's items: the 99 compared, never a 0 for the gap
        assert s.scalar(select(func.count()).select_from(EvaluationItem)) == 99
    assert lineage_rows("main")[-1]["unscored"] == {specialist: 1}


def test_scoring_a_pairs_answers_counts_as_contract_scoring():
    """``score_pair``'s scoring (co-design's variants, evaluation's discovered variants) is contract scoring:
    ``bench/overhead.py`` counted it as overhead. The scores are each answer's final-turn score."""
    from pipeline.environment import sample_prompts
    from pipeline.gates.answers import item_score, score_answers
    from pipeline.loop.clock import CLOCK
    from pipeline.specs.contract import load_contract
    from pipeline.specs.harness import load_harness

    contract = load_contract(ROOT / "contracts" / "demo.yaml")
    harness = load_harness(ROOT / "harnesses" / "demo.yaml")
    answered = {}
    for s in ("chat", "coding"):
        items = sample_prompts(s, 4, seed=2)
        replies = [it["metadata"]["expected"] if k % 2 else "no idea" for k, it in enumerate(items)]
        answered[s] = [{**it, "messages": [*it["messages"], {"role": "assistant", "content": r}]}
                       for it, r in zip(items, replies, strict=True)]  # fmt: skip
    CLOCK.reset()
    scores = score_answers(contract, harness, answered)
    assert CLOCK.total("score") > 0
    assert scores == {
        s: [item_score(contract, t, harness=harness, specialist=s).value or 0.0 for t in traces]
        for s, traces in answered.items()
    }
    assert any(v > 0.5 for v in scores["chat"]) and any(v < 0.5 for v in scores["chat"])
