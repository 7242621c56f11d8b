"""Where an adapter may come from: checked when it is registered (``create_adapter``), not first when it is
loaded. Only a directory inside the artifact store, holding safetensors weights and a LoRA peft config with
the sha256 given, is recorded; a URL, a missing directory, a path or link leading outside is refused with
one line (``AdapterSourceError``)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import RatchetError
from pipeline.serving.adapters import CONFIG, WEIGHTS, tree_sha256
from pipeline.specs.loading import file_sha256

__all__ = ["AdapterSourceError", "check_adapter_source"]


class AdapterSourceError(RatchetError):
    """An adapter's files are not where or not what the registry may record (checked when registered)."""


def check_adapter_source(*, artifact_uri: str, sha256: str, artifact_root: Path) -> Path:
    """The adapter directory ``artifact_uri`` names, resolved (links followed), when it is an absolute path
    to an existing directory inside ``artifact_root`` that holds safetensors weights and a peft config, and
    ``sha256`` is its weights file's (or the whole directory's, ``tree_sha256``); otherwise an
    ``AdapterSourceError`` saying why in one line. URLs (``file://``, ``http://``) are refused."""
    at = f"adapter source {artifact_uri[:300]!r}"
    if "://" in artifact_uri:
        raise AdapterSourceError(f"{at}: expected a directory path inside the artifact store, not a URL")
    if not Path(artifact_uri).is_absolute():
        raise AdapterSourceError(f"{at}: expected an absolute path inside the artifact store {artifact_root}")
    try:
        path = Path(artifact_uri).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a loop of links, a NUL byte
        raise AdapterSourceError(f"{at}: no such directory") from None
    if not path.is_relative_to(Path(artifact_root).resolve()):
        raise AdapterSourceError(f"{at}: outside the artifact store {artifact_root} (links followed)")
    weights = path / WEIGHTS
    if not path.is_dir() or not weights.is_file():
        raise AdapterSourceError(f"{at}: no {WEIGHTS} (adapters are registered as safetensors only)")
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterSourceError(f"{at}: no readable {CONFIG} (not a peft adapter directory?)") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterSourceError(f"{at}: {CONFIG} is not a LoRA adapter's peft config")
    actual = file_sha256(weights)
    if sha256 not in (actual, tree_sha256(path)):
        raise AdapterSourceError(f"{at}: sha256 {sha256[:12]} is not its weights' ({actual[:12]})")
    return path
