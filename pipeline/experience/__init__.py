"""Experience: traces as Ratchet stores them, who sent them, and what of them may be learned.

- ``ingest``: a JSONL file of traces streamed into the registry (bad lines quarantined).
- ``principals``: who sent what, and the scopes that let a principal make something count.
- ``texts`` and ``toolcalls``: the one reader of a message's text, and tool calls as model text and as OpenAI
  ``tool_calls``.
- ``eligibility``: the one gate every consumer of scored experience passes through.
- ``preferences``: preference pairs (what ``method: dpo`` learns from).
"""
