"""An adapter is registered only from the artifact store, as a checked safetensors LoRA: any other source
(a URL, a missing directory, a path or link leading outside, pickled weights, no peft config, another
sha256) is refused when it is registered, in one line, and nothing is recorded."""

from __future__ import annotations

import shutil

import pytest
from registry.adapter_files import stored_adapter
from sqlalchemy import func, select

from pipeline.errors import RatchetError
from pipeline.registry import Adapter, create_adapter, register_base_model, session_scope
from pipeline.settings import get_settings


def _register(engine, **source):
    with session_scope(engine) as s:
        base = register_base_model(session=s, name="tiny", path="/models/tiny", spec={})
        row = create_adapter(
            session=s, specialist="chat", base_model_id=base.id, rank=4, alpha=8,
            target_modules=["q_proj"], **source,
        )  # fmt: skip
        return row.artifact_uri


def _count(engine) -> int:
    with session_scope(engine) as s:
        return s.scalar(select(func.count()).select_from(Adapter))


def test_only_checked_adapters_inside_the_artifact_store_are_registered(engine, tmp_path):
    store = get_settings().artifacts_dir
    good = stored_adapter(store / "main" / "gen-0001" / "adapters" / "chat")
    sha = good["sha256"]
    outside = stored_adapter(tmp_path / "other-run" / "adapter")
    (store / "main" / "link").symlink_to(tmp_path / "other-run", target_is_directory=True)
    pickled = store / "pickled"
    shutil.copytree(good["artifact_uri"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    no_config = store / "no-config"
    shutil.copytree(good["artifact_uri"], no_config)
    (no_config / "adapter_config.json").unlink()
    not_lora = store / "not-lora"
    shutil.copytree(good["artifact_uri"], not_lora)
    (not_lora / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    refused = {
        "file:///etc": ("file:///etc", sha),
        "URL": ("http://203.0.113.9/adapter", sha),
        "relative": ("../../other-run/adapter", outside["sha256"]),
        "missing": (str(store / "main" / "missing"), sha),
        "outside": (outside["artifact_uri"], outside["sha256"]),
        "dot-dot": (f"{store}/main/../../../other-run/adapter", outside["sha256"]),
        "link": (str(store / "main" / "link" / "adapter"), outside["sha256"]),
        "pickled": (str(pickled), sha),
        "no config": (str(no_config), sha),
        "not LoRA": (str(not_lora), sha),
        "sha256": (good["artifact_uri"], "0" * 64),
        "/etc": ("/etc", sha),
        "NUL": (good["artifact_uri"] + "\x00", sha),
        "newline": (good["artifact_uri"] + "\n/etc", sha),
    }
    for why, (uri, digest) in refused.items():
        with pytest.raises(RatchetError) as info:
            _register(engine, artifact_uri=uri, sha256=digest)
        message = str(info.value)
        assert "\n" not in message and "adapter source" in message, (why, message)
    assert _count(engine) == 0
    assert _register(engine, **good) == good["artifact_uri"]
    from pipeline.serving.adapters import tree_sha256

    tree = tree_sha256(store / "main" / "gen-0001" / "adapters" / "chat")
    assert _register(engine, artifact_uri=good["artifact_uri"], sha256=tree) == good["artifact_uri"]
    assert _count(engine) == 2


def test_a_refused_source_is_one_line_and_a_non_zero_exit(tmp_path):
    """A RatchetError: the CLI prints it as one line and exits non-zero."""
    from pipeline.registry.adapter_source import AdapterSourceError, check_adapter_source

    with pytest.raises(AdapterSourceError, match="not a URL") as info:
        check_adapter_source(artifact_uri="file:///etc", sha256="0" * 64, artifact_root=tmp_path)
    assert isinstance(info.value, RatchetError) and info.value.exit_code != 0
