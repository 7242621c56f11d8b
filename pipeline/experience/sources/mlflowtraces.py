"""MLflow Tracing -> turns: ``ratchet ingest --from mlflow --experiment NAME|ID [--filter ...]``.

Traces are paged through ``MlflowClient.search_traces`` (oldest first; ``--filter`` is MLflow's own filter
string, e.g. ``trace.timestamp_ms > 1764000000000``). Each outermost chat span of a trace (span type
``CHAT_MODEL`` or ``LLM``; ``mlflow.openai.autolog`` writes one per ``chat.completions.create``) is one turn:
its inputs' ``messages`` plus the answer in its outputs (a ``ChatCompletion``, or a message; a Responses API
call's items, ``responsesapi``), the ``tools``
it was offered (inputs, else the ``mlflow.chat.tools`` attribute), and the trace's session
(``mlflow.trace.session`` metadata) as the conversation.

Assessments (valid ones, oldest first; one bound to a chat span belongs to that turn, any other to the
trace's last turn): a feedback with a number or a bool is the turn's rating (the newest wins; true is 1, false
0), one named ``correction`` with text its corrected answer; an expectation is verification material
(``expected_response`` -> ``metadata.expected``, ``intake.EXPECTED_KEYS``). They count only as the command
line's principal may make them count (``intake``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.ingest import TraceError
from pipeline.experience.sources.intake import (
    CORRECTION_NAMES,
    Assessments,
    Origin,
    Turn,
    chat_message,
    chat_tools,
    conversation_key,
    failed,
    record_bytes,
)
from pipeline.experience.sources.responsesapi import responses_messages

CHAT_SPANS = frozenset({"CHAT_MODEL", "LLM"})
SESSION_KEY = "mlflow.trace.session"  # mlflow.tracing.constant.TraceMetadataKey.TRACE_SESSION
TOOLS_KEY = "mlflow.chat.tools"  # mlflow.tracing.constant.SpanAttributeKey.CHAT_TOOLS
PAGE = 100


def answer_of(outputs: Any) -> dict[str, Any]:
    """The assistant message in a chat span's outputs: a ``ChatCompletion`` (its first choice), a message,
    or text."""
    if isinstance(outputs, str):
        return {"role": "assistant", "content": outputs}
    if isinstance(outputs, dict):
        choices = outputs.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            return chat_message(choices[0].get("message"))
        if outputs.get("role") == "assistant":
            return chat_message(outputs)
    raise TraceError("outputs: expected a ChatCompletion, an assistant message or text")


def span_messages(inputs: Any, outputs: Any) -> list[dict[str, Any]]:
    """The conversation of one chat span: its input messages, then its answer (a Responses API call: its
    instructions, input items and output items, ``responsesapi``)."""
    if isinstance(inputs, dict) and "messages" not in inputs and "input" in inputs:
        return responses_messages(inputs, outputs)
    messages = inputs.get("messages") if isinstance(inputs, dict) else None
    if not isinstance(messages, list) or not messages:
        raise TraceError("inputs: expected OpenAI chat 'messages' (a non-empty list)")
    return [*(chat_message(m) for m in messages), answer_of(outputs)]


def _assessments(trace: Any, chat_ids: list[str]) -> dict[str, Assessments]:
    """Per chat span id, what the trace's valid assessments say about it (oldest first, newest wins)."""
    from mlflow.entities import Expectation, Feedback

    found = {sid: Assessments() for sid in chat_ids}
    items = [a for a in (trace.info.assessments or []) if a.valid is not False]
    for a in sorted(items, key=lambda a: a.create_time_ms or 0):
        target = found.get(a.span_id) or found[chat_ids[-1]]
        if isinstance(a, Expectation):
            target.expectations[a.name] = a.value
        elif isinstance(a, Feedback) and a.error is None:
            value = a.value
            if isinstance(value, bool | int | float):
                target.rating = float(value)
            elif isinstance(value, str) and a.name in CORRECTION_NAMES:
                target.correction = value
            else:
                target.others[a.name] = value
    return found


def trace_turns(trace: Any, number: int, experiment_id: str) -> Iterator[Turn]:
    """The turns of one MLflow trace (its outermost chat spans), or its one quarantined record."""
    trace_id = trace.info.trace_id
    spans = list(trace.data.spans) if trace.data is not None else []
    chat = {s.span_id for s in spans if s.span_type in CHAT_SPANS}
    parents = {s.span_id: s.parent_id for s in spans}

    def outermost(span: Any) -> bool:
        parent, seen = parents.get(span.span_id), {span.span_id}
        while parent is not None and parent not in seen:  # parents are the logger's word: a cycle ends here
            if parent in chat:
                return False
            seen.add(parent)
            parent = parents.get(parent)
        return True

    turns = [s for s in spans if s.span_id in chat and outermost(s)]
    if not turns:
        yield failed(number, {"trace_id": trace_id}, f"no chat span (CHAT_MODEL or LLM) in trace {trace_id}")
        return
    judged = _assessments(trace, [s.span_id for s in turns])
    conversation = conversation_key((trace.info.trace_metadata or {}).get(SESSION_KEY))
    for span in turns:
        found = judged[span.span_id]
        record = {"trace_id": trace_id, "span_id": span.span_id}
        try:
            record.update(inputs=span.inputs, outputs=span.outputs, tools=span.get_attribute(TOOLS_KEY))
            raw = record_bytes(record)
            inputs = span.inputs if isinstance(span.inputs, dict) else {}
            origin = Origin(system="mlflow", trace=trace_id, span=span.span_id, experiment=experiment_id)
            yield Turn(
                number=number,
                raw=raw,
                messages=span_messages(span.inputs, span.outputs),
                metadata={"origin": origin.model_dump(exclude_none=True), "model": inputs.get("model")},
                tools=chat_tools(inputs.get("tools") or span.get_attribute(TOOLS_KEY)),
                conversation_id=conversation,
                assessments=found,
            )
        except TraceError as exc:
            yield failed(number, record, f"wrong shape: {exc} (span {span.span_id})")


def experiment_id(client: Any, experiment: str) -> str:
    """The id of the experiment named (or numbered) ``experiment``; ``NotFoundError`` naming it."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_experiment_by_name(experiment)
        if found is None and experiment.isdigit():
            found = client.get_experiment(experiment)
    except MlflowException as exc:
        if experiment.isdigit() and "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code):
            found = None
        else:
            raise RatchetError(f"--experiment {experiment}: {exc.message}") from None
    if found is None:
        raise NotFoundError(f"--experiment: no MLflow experiment named or numbered {experiment!r}")
    return found.experiment_id


def mlflow_turns(experiment: str, *, filter_string: str | None, tracking_uri: str | None) -> Iterator[Turn]:
    """Every turn of the experiment's traces that match ``filter_string``, oldest trace first."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp_id = experiment_id(client, experiment)
    token, number = None, 0
    while True:
        try:
            page = client.search_traces(
                locations=[exp_id],
                filter_string=filter_string,
                max_results=PAGE,
                order_by=["timestamp_ms ASC"],
                page_token=token,
            )
        except MlflowException as exc:
            where = f"--filter {filter_string!r}" if filter_string else f"--experiment {experiment}"
            raise RatchetError(f"{where}: {exc.message}") from None
        for trace in page:
            number += 1
            yield from trace_turns(trace, number, exp_id)
        token = page.token
        if not token:
            return
