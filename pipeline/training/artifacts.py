"""Writing training artifacts so that a reader sees a complete directory or none at all.

``atomic_directory(final)`` yields a temporary sibling to write into; when the block finishes, every file
in it is fsynced and the directory is renamed to ``final`` (replacing an older one). When the block fails,
the temporary directory is removed and ``final`` is left as it was. A write the storage refuses (full,
read-only, a file where a directory should be) becomes an ``ArtifactStoreError``: one line naming where
and why, instead of a traceback.

``stored_dataset_sha256`` is the one content hash of a training set: of the dataset as stored
(``save_to_disk``) and loaded back (``load_from_disk``), which curation records in the registry and every job
logs with its adapter. Arrow gives every row of a column the same fields (a message without tool calls gets
``tool_calls: None`` once any message has them), so rows hashed before saving would not be the rows trained on.

``save_adapter`` writes the adapter's model card (``README.md``, ``pipeline.training.cards``) over peft's
empty one, from the same record as ``lineage.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError
from pipeline.registry.tracking import identity_tags
from pipeline.specs.loading import file_sha256
from pipeline.training.cards import write_model_card


class ArtifactStoreError(RatchetError):
    """The artifact store refused a write: it is full or not writable."""


def storage_failure(exc: BaseException) -> str | None:
    """Why ``exc`` is the storage refusing a write, in a few words; None when it is something else."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    # safetensors reports its writes' I/O errors as its own exception type, not OSError
    if type(exc).__name__ == "SafetensorError" and "I/O error" in str(exc):
        return str(exc).split("I/O error:", 1)[1].strip()
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root``, and ``root`` itself, to the disk."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            _fsync(path)
    _fsync(root)


@contextmanager
def atomic_directory(final: Path, *, what: str) -> Iterator[Path]:
    """Write ``final`` through a temporary sibling (see the module doc); ``what`` names it in errors."""
    final = Path(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        fsync_tree(tmp)
        if final.exists():  # a directory cannot be replaced in one rename: move the old one aside first
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():  # failed between the two renames: put the old one back
            os.replace(old, final)
        reason = storage_failure(exc)
        if reason is None:
            raise
        raise ArtifactStoreError(
            f"{final}: cannot write the {what} ({reason}): the artifact store is full or not writable"
        ) from exc


def conversations_sha256(conversations: Iterable[Any]) -> str:
    """sha256 over conversations, one canonical JSON line each (key order and file layout do not matter)."""
    digest = hashlib.sha256()
    for conversation in conversations:
        digest.update(json.dumps(conversation, sort_keys=True, separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()


SERVED_COLUMNS = ("served_tokens", "rejected_served_tokens")  # each side's served ids (JSON text; "": none)


def hashed_row(row: dict[str, Any]) -> Any:
    """What of one training row its dataset's hash covers: its conversation (``messages``; a preference
    row's ``[messages, rejected]``) and, when any side has them, the ids its replies were served with --
    they are what is trained on. A row without served ids hashes as before they were stored."""
    conversation = [row["messages"], row["rejected"]] if "rejected" in row else row["messages"]
    served = [row.get(column) or "" for column in SERVED_COLUMNS if column in row]
    if not any(served):
        return conversation
    return {"conversation": conversation, "served_tokens": served}


def stored_dataset_sha256(dataset: Any) -> str:
    """The content hash of a stored training set: ``dataset`` is the directory ``save_to_disk`` wrote, or
    the ``datasets.Dataset`` ``load_from_disk`` read from it. Its rows are hashed as loaded (``hashed_row``:
    the conversations, and the served ids where there are any), so curation, which hashes what it saved,
    and training, which hashes what it loaded, record the same value."""
    if isinstance(dataset, str | Path):
        from datasets import load_from_disk

        dataset = load_from_disk(str(dataset))
    wanted = ["messages", "rejected", *SERVED_COLUMNS]
    columns = [c for c in wanted if c in dataset.column_names]

    def rows() -> Iterator[Any]:
        for batch in dataset.select_columns(columns).iter(batch_size=1000):
            for values in zip(*(batch[c] for c in columns), strict=True):
                yield hashed_row(dict(zip(columns, values, strict=True)))

    return conversations_sha256(rows())


def save_adapter(
    model: Any, output_dir: Path, *, record: dict[str, Any], tracker: Any = None
) -> tuple[Path, str]:
    """Save a job's peft ``model`` as ``output_dir/adapter`` (peft's config, ``adapter_model.safetensors`` and
    ``lineage.json``: ``record`` plus the weights' sha256; ``README.md``: its model card), atomically, and copy
    it into the tracker's run, whose tags then name its lineage, generation, specialist and method; returns
    the directory and the sha256. A store that refuses the write is an ``ArtifactStoreError``."""

    adapter_dir = Path(output_dir) / "adapter"
    with atomic_directory(adapter_dir, what="adapter") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        adapter_sha = file_sha256(tmp / "adapter_model.safetensors")
        record = {**record, "adapter_sha256": adapter_sha}
        (tmp / "lineage.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        write_model_card(tmp, record=record)  # over peft's empty card
    if tracker:
        tracker.log_params({"adapter_sha256": adapter_sha})
        tracker.set_tags(identity_tags(record))
        try:
            tracker.log_artifact(adapter_dir, artifact_path="adapter")
        except Exception as exc:  # a local (file) MLflow artifact store that is full or read-only
            reason = storage_failure(exc)
            if reason is None:
                raise
            raise ArtifactStoreError(
                f"{adapter_dir}: cannot copy the adapter into MLflow's artifact store ({reason}): "
                "it is full or not writable"
            ) from exc
    return adapter_dir, adapter_sha
