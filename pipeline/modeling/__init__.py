"""Models and decoding: a base model with its adapters, its chat template, and how it writes.

- ``placement``: device and dtype; ``templating``: chat templates with inert content (conversation -> token ids);
  ``prompting``: the harness rendered around a conversation; ``probes``: what a template accepts.
- ``packing``: token ids with assistant-only labels, packed batches.
- ``decoding`` and ``detokenization``: batched sampling and greedy decoding, text grown token by token.
- ``pair``: a model-harness pair at work (a generation's specialists answering task items).
"""
