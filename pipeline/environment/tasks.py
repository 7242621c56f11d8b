"""The simulated deployment: four task families with verifiable outcomes and a disjoint held-out split.

Every item is an addition problem ``a+b`` (10 <= a, b <= 99) wrapped in one family's format; the sum is
the hard, learnable part, the format is easy. Formats are short so a ~1M-parameter char-level model can
produce them (user prompt -> assistant answer):

============  ==========================  ==========================================================
family        prompt                      answer (checked by)
============  ==========================  ==========================================================
``chat``      ``12+35=?``                 ``47`` (exact match on ``metadata.expected``)
``agent``     ``timer 12+35`` /           ``set_timer(minutes=47)`` / ``add_item(name=egg,qty=47)``
              ``add 12+35 egg``           (compact tool call, see ``toolcalls``: JSON schema of the
                                          tool + the resulting state of the action substrate)
``coding``    ``f adds 12 35``            ``def f(x):return x+47`` (``metadata.tests`` run on the code)
``genui``     ``counter 12+35`` /         ``{"type":"counter","value":47}`` (``metadata.schema``,
              ``progress 12+35``          a JSON Schema whose ``const`` pins the value)
============  ==========================  ==========================================================

Split: the canonical problem is the unordered pair ``{a, b}``; ``split_of(a, b)`` puts ~20% of all pairs
in ``heldout`` by a hash of ``"min+max"``, for every family at once, so no held-out sum is ever practised
in any format or in either order (``b+a`` is the same problem as ``a+b``), and ~8% of the rest in
``validation`` (what co-design chooses harness variants on: never practised by collection). Collection
(``sample_prompts``) draws train pairs only; the tiny base's pretraining corpus (``training_corpus``) draws
train and validation pairs (it is built once, before any generation, and never sees a held-out pair).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from typing import Any

from pipeline.environment.toolbox import TOOLS, format_compact_call
from pipeline.experience.toolcalls import answered_trace

FAMILIES: tuple[str, ...] = ("chat", "agent", "coding", "genui")
LOW, HIGH = 10, 99
HELDOUT_PER_256 = 52  # ~20% of the 8,100 pairs
VALIDATION_PER_256 = 20  # ~8% of the rest
SPLITS = ("train", "validation", "heldout")
ITEMS = ("egg", "milk", "tea", "rice", "salt", "jam")
WIDGETS = ("counter", "progress")
WIDGET_KEY = {"counter": "value", "progress": "percent"}


def split_of(a: int, b: int) -> str:
    """``heldout``, ``validation`` or ``train`` for the problem ``a+b`` (a pure function of the unordered
    pair: ``b+a`` is on the same side)."""
    low, high = min(a, b), max(a, b)
    digest = hashlib.sha256(f"{low}+{high}".encode()).digest()
    if digest[0] < HELDOUT_PER_256:
        return "heldout"
    return "validation" if digest[1] < VALIDATION_PER_256 else "train"


@functools.cache
def _pairs(split: str) -> tuple[tuple[int, int], ...]:
    return tuple(
        (a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1) if split_of(a, b) == split
    )


def is_heldout(task_id: str) -> bool:
    """Whether an environment task id (``family:...:a+b``) belongs to the held-out split."""
    try:
        a, b = (int(x) for x in task_id.rsplit(":", 1)[1].split("+"))
    except (ValueError, IndexError):
        raise ValueError(f"not an environment task id: {task_id!r}") from None
    return split_of(a, b) == "heldout"


def make_item(family: str, a: int, b: int, variant: int = 0) -> dict[str, Any]:
    """The task item (a trace without the assistant turn) for ``a+b`` in ``family``; ``variant`` picks
    the tool / item name / widget where the family has several."""
    total = a + b
    meta: dict[str, Any] = {"task": family, "specialist": family, "split": split_of(a, b)}
    if family == "chat":
        prompt, task_id = f"{a}+{b}=?", f"chat:{a}+{b}"
        meta["expected"] = str(total)
    elif family == "agent":
        if variant % 2 == 0:
            prompt, call = f"timer {a}+{b}", {"name": "set_timer", "arguments": {"minutes": total}}
            task_id = f"agent:set_timer:{a}+{b}"
        else:
            name = ITEMS[(variant // 2) % len(ITEMS)]
            prompt, call = (
                f"add {a}+{b} {name}",
                {"name": "add_item", "arguments": {"name": name, "qty": total}},
            )
            task_id = f"agent:add_item:{name}:{a}+{b}"
        meta["expected_call"] = call
        meta["expected"] = format_compact_call(call["name"], call["arguments"])
        meta["tools"] = TOOLS
    elif family == "coding":
        prompt, task_id = f"f adds {a} {b}", f"coding:{a}+{b}"
        meta["expected"] = f"def f(x):return x+{total}"
        meta["tests"] = f"assert f(0)=={total}\nassert f(7)=={total + 7}\n"
    elif family == "genui":
        widget = WIDGETS[variant % len(WIDGETS)]
        key = WIDGET_KEY[widget]
        prompt, task_id = f"{widget} {a}+{b}", f"genui:{widget}:{a}+{b}"
        meta["expected"] = json.dumps({"type": widget, key: total}, separators=(",", ":"))
        meta["schema"] = {
            "type": "object",
            "properties": {"type": {"const": widget}, key: {"type": "integer", "const": total}},
            "required": ["type", key],
            "additionalProperties": False,
        }
    else:
        raise ValueError(f"unknown task family {family!r}; expected one of {', '.join(FAMILIES)}")
    meta["task_id"] = task_id
    return {"messages": [{"role": "user", "content": prompt}], "metadata": meta, "feedback": None}


def reference_answer(item: dict[str, Any]) -> str:
    """The correct completion text (the model-facing form) for an item."""
    return item["metadata"]["expected"]


def completion_trace(item: dict[str, Any], completion_text: str) -> dict[str, Any]:
    """The full trace of ``item`` answered with ``completion_text`` (the tiny model writes compact calls)."""

    return answered_trace(item, completion_text, fmt="compact")


def _draw(rng: random.Random, pairs: tuple[tuple[int, int], ...], family: str) -> dict[str, Any]:
    a, b = rng.choice(pairs)
    return make_item(family, a, b, variant=rng.randrange(12))


def sample_prompts(family: str, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``n`` task items of ``family`` from ``split`` (``train`` or ``validation``; with repeats),
    deterministic by seed."""
    if split not in ("train", "validation"):
        raise ValueError(f"sample_prompts draws train or validation items, not {split!r}")
    rng = random.Random(f"prompts:{family}:{seed}" if split == "train" else f"{split}:{family}:{seed}")
    pairs = _pairs(split)
    return [_draw(rng, pairs, family) for _ in range(n)]


def heldout_suite(family: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` held-out items of ``family``, each a distinct problem (all held-out problems when ``n`` exceeds
    them)."""
    rng = random.Random(f"heldout:{family}:{seed}")
    pairs = _pairs("heldout")
    chosen = rng.sample(pairs, min(n, len(pairs)))
    variants = [rng.randrange(12) for _ in chosen]
    # ``a+b`` and ``b+a`` are one problem, and a suite holding both would count it twice (``ratchet init``
    # refuses repeated held-out items, ``pipeline.gates.suites``): a repeat is replaced by a problem not drawn, from
    # a stream of its own, so every other item stays what this seed has always drawn
    drawn = {(min(a, b), max(a, b)) for a, b in chosen}
    spare = random.Random(f"heldout-spare:{family}:{seed}")
    unused = [p for p in pairs if p[0] <= p[1] and p not in drawn]
    spare.shuffle(unused)
    seen: set[tuple[int, int]] = set()
    out = []
    for (a, b), variant in zip(chosen, variants, strict=True):
        if (min(a, b), max(a, b)) in seen:
            if not unused:  # every held-out problem is in the suite already
                continue
            low, high = unused.pop()
            a, b = (high, low) if spare.random() < 0.5 else (low, high)
        seen.add((min(a, b), max(a, b)))
        out.append(make_item(family, a, b, variant=variant))
    return out


def training_corpus(n: int, seed: int, families: tuple[str, ...] = FAMILIES) -> list[dict[str, Any]]:
    """``n`` complete traces (prompt + reference answer) from the training split, families interleaved;
    used for bootstrap pre-training of the tiny base model."""
    rng = random.Random(f"corpus:{seed}")
    pairs = _pairs("train") + _pairs("validation")
    out = []
    for i in range(n):
        item = _draw(rng, pairs, families[i % len(families)])
        out.append(completion_trace(item, reference_answer(item)))
    return out


def perturbed_items(family: str, items: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """Up to ``n`` distinct variants of ``family``'s training ``items`` (their ``task_id`` names the problem):
    the operands moved by up to 9 each, swapped, or posed with another tool, item or widget. Only
    training-split problems come out (a perturbation never lands on a held-out or validation pair), none
    equal to an item given, each with its reference answer and checks (``make_item``)."""
    rng = random.Random(f"variants:{family}:{seed}")
    seen = {item["metadata"]["task_id"] for item in items if "task_id" in (item.get("metadata") or {})}
    out: list[dict[str, Any]] = []
    tries = 0
    while items and len(out) < n and tries < 20 * n:
        tries += 1
        source = rng.choice(items)["metadata"].get("task_id", "")
        try:
            a, b = (int(x) for x in source.rsplit(":", 1)[1].split("+"))
        except (ValueError, IndexError):
            continue
        move = rng.randrange(3)
        if move == 0:
            a, b = a + rng.randint(-9, 9), b + rng.randint(-9, 9)
        elif move == 1:
            a, b = b, a
        if not (LOW <= a <= HIGH and LOW <= b <= HIGH) or split_of(a, b) != "train":
            continue
        variant = make_item(family, a, b, variant=rng.randrange(12))
        if variant["metadata"]["task_id"] in seen:
            continue
        seen.add(variant["metadata"]["task_id"])
        out.append(variant)
    return out
