"""Specs: the YAML kinds a user writes and the loader that reads them.

- ``loading``: YAML into pydantic models, every error at once with file:line and field path.
- ``contract``: the HCP contract, the external, versioned definition of "better" (``scorers``: its scorer kinds).
- ``modelspec``: the frozen base model and each specialist's LoRA and training settings.
- ``harness``: prompts, tools, context and routing around the model; ``compatibility``: whether a harness
  satisfies a contract's context protocol.
- ``tasksource``: where a specialist's practice prompts come from; ``heldout``: the contract's held-out suites and
  the one predicate that keeps them out of everything learned.

No module here imports the loop, serving or the registry.
"""
