"""docs/own-model.md's "Your own model and tasks", run exactly as written on a real-architecture fixture model.

The section's YAML blocks become the project's files (each block's first line names it), its bash block is
run line by line with the project's ``ratchet`` (``serve`` in the background), and its Python block talks to
that server with the ``openai`` client. The data files are the user's own; here they are generated in the
documented format. The fixture (``realmodel``): a random-weight Qwen3 with a byte-level BPE tokenizer trained
here, a ChatML template with tools, a list of EOS ids, no pad token and sharded safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from realmodel import build_real_model

ROOT = Path(__file__).resolve().parents[1]
WALKTHROUGH = ROOT / "docs" / "own-model.md"  # the README links to it
SECTION = "## Your own model and tasks"
RATCHET = Path(sys.executable).with_name("ratchet")

CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Peru", "Lima"),
    ("Kenya", "Nairobi"), ("Cuba", "Havana"), ("Chile", "Santiago"), ("Greece", "Athens"),
    ("Norway", "Oslo"), ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Portugal", "Lisbon"), ("Hungary", "Budapest"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Thailand", "Bangkok"),
]  # fmt: skip
HELDOUT_CAPITALS = [
    ("Spain", "Madrid"), ("Germany", "Berlin"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("India", "Delhi"), ("Mexico", "Mexico City"), ("Canada", "Ottawa"), ("Iran", "Tehran"),
]  # fmt: skip
CALL = {"name": "set_timer", "arguments": {"minutes": 47}}
TRAIN_ASKS = [
    f"{verb} a {kind} timer for 47 minutes{tail}"
    for verb in ("set", "start", "run", "make")
    for kind in ("kitchen", "quick")
    for tail in ("", " please", " now")
]
HELDOUT_ASKS = [
    "i need 47 minutes on the clock",
    "count down 47 minutes",
    "47 minutes, timer on",
    "alarm me after 47 minutes",
    "remind me in 47 minutes",
    "timer: forty-seven minutes (47)",
    "begin timing 47 minutes",
    "put 47 minutes on a timer",
]


def section(text: str) -> str:
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def user_data(project: Path) -> None:
    """The user's own files, in the documented formats."""
    ask = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    write_jsonl(
        project / "data" / "tasks.jsonl",
        [{"messages": ask(f"Capital of {c}, one word?"), "metadata": {"expected": a}} for c, a in CAPITALS],
    )
    write_jsonl(
        project / "data" / "heldout-answer.jsonl",
        [
            {"messages": ask(f"Which city is the capital of {c}?"), "metadata": {"expected": a}}
            for c, a in HELDOUT_CAPITALS
        ],
    )
    write_jsonl(
        project / "data" / "heldout-tools.jsonl",
        [{"messages": ask(q), "metadata": {"expected_call": CALL}} for q in HELDOUT_ASKS],
    )
    call = {"id": "call_0", "type": "function",
            "function": {"name": CALL["name"], "arguments": json.dumps(CALL["arguments"])}}  # fmt: skip
    write_jsonl(
        project / "data" / "traces.jsonl",
        [
            {
                "messages": [*ask(q), {"role": "assistant", "content": None, "tool_calls": [call]}],
                "metadata": {"specialist": "tools", "expected_call": CALL},
            }
            for q in TRAIN_ASKS
        ],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(line: str, project: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    args = shlex.split(line)
    if args[0] == "ratchet":
        args[0] = str(RATCHET)
    done = subprocess.run(args, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.timeout(1500)
def test_readme_walkthrough_on_a_real_architecture(tmp_path):
    text = section(WALKTHROUGH.read_text(encoding="utf-8"))
    project = tmp_path / "project"
    build_real_model(project / "my-model", kind="bytelevel", shards=3, sharpness=1.0)
    assert len(list((project / "my-model").glob("*.safetensors"))) > 1  # sharded
    user_data(project)
    for block in blocks(text, "yaml"):
        name = block.splitlines()[0].removeprefix("# ").strip()
        digests = lambda m: hashlib.sha256((project / m.group(1)).read_bytes()).hexdigest()  # noqa: E731
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(re.sub(r"<sha256 of (\S+)>", digests, block), encoding="utf-8")
    env = {**os.environ, "RATCHET_HOME": str(project / ".ratchet"), "RATCHET_SANDBOX": "process"}
    env.pop("RATCHET_DATABASE_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    (bash,) = blocks(text, "bash")
    port = free_port()
    server = None
    outputs = {}
    try:
        for line in bash.splitlines():
            line = line.split("  #")[0].strip()
            if not line or line.startswith(("#", "sha256sum")):
                continue
            if line.startswith("ratchet serve"):
                line = line.replace("--port 8000", f"--port {port}")
                server = subprocess.Popen(
                    [str(RATCHET), *shlex.split(line)[1:]], cwd=project, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )  # fmt: skip
                continue
            outputs[line] = run(line, project, env).stdout
        wait_ready(port, server)
        (client,) = blocks(text, "python")[:1]
        got = subprocess.run(
            [sys.executable, "-c", client.replace("8000", str(port))],
            cwd=project, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        name, arguments = got.stdout.splitlines()[0].split(" ", 1)
        assert name == "set_timer" and json.loads(arguments) == {"minutes": 47}
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    check_registry(project, env, outputs)


def wait_ready(port: int, server: subprocess.Popen | None) -> None:
    import httpx

    assert server is not None, "the walkthrough's commands start no server"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read() if server.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("the server did not come up")


REGISTRY_QUERY = """
import json
from pipeline.registry import get_champion, get_engine, list_generations, session_scope
with session_scope(get_engine()) as s:
    gens = {g.number: {"status": g.status, "steps": (g.state or {}).get("steps"), "evaluation": g.evaluation}
            for g in list_generations(session=s, lineage="main")}
    print(json.dumps({"champion": get_champion(session=s, lineage="main").number, "generations": gens}))
"""


def check_registry(project: Path, env: dict[str, str], outputs: dict[str, str]) -> None:
    """What the commands did, read from the registry: collection practised `answer` on its task file's
    train split only, `tools` learned from the ingested traces, evaluation ran on the two file suites."""
    assert (
        "24 stored, 0 duplicate, 0 quarantined" in outputs["ratchet ingest data/traces.jsonl --source import"]
    )
    done = subprocess.run(
        [sys.executable, "-c", REGISTRY_QUERY], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    registry = json.loads(done.stdout)
    first, second = registry["generations"]["1"], registry["generations"]["2"]
    collect = first["steps"]["collect"]
    assert collect["specialists"] == ["answer"] and collect["without_tasks"] == ["tools"]
    assert collect["attempts"] == 32 * 2 and collect["held_out_left_out"] == {"answer": 0}
    assert second["steps"]["collect"]["attempts"] == 0  # --no-collect
    assert first["steps"]["curate"]["datasets"]["tools"]["rows"] >= 16
    # `tools` has no task source: a fixed slice of its experience validates co-design, never trained on
    assert first["steps"]["curate"]["dropped"]["tools"]["validation slice"] >= 1
    assert first["steps"]["codesign"]["variants"]
    items = first["evaluation"]["items"]
    assert len(items["answer"]["parent"]) == len(HELDOUT_CAPITALS)
    assert items["tools"]["parent"] == [0.0] * len(HELDOUT_ASKS)
    assert items["tools"]["candidate"] == [1.0] * len(HELDOUT_ASKS)
    assert registry["champion"] >= 1, first["status"]
