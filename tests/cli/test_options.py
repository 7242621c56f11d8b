"""Command options generated from config classes (``pipeline.cli.options``): every field of ``ServeConfig``
is an option of ``ratchet serve`` and every field of ``AdvanceConfig`` one of ``ratchet advance`` and
``ratchet demo``, with the field's description as help and the class's default; the values given build
the class the command gets, the class's bounds refuse others."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import typer
from typer.testing import CliRunner

from pipeline.cli.app import app
from pipeline.cli.options import knobs, with_config
from pipeline.knobs import described
from pipeline.loop.candidate import AdvanceConfig
from pipeline.serving.served import SETTINGS_FIELDS, ServeConfig
from pipeline.settings import Settings


def _command(name: str, module: str):
    importlib.import_module(module)  # it adds its commands to ``app``
    return typer.main.get_group(app).commands[name]


def _cli_default(value):
    return tuple(value) if isinstance(value, list) else value


def _check_options(command, cls, *, skip=()):
    params = {p.name: p for p in command.params}
    for field in dataclasses.fields(cls):
        if field.name in skip:
            assert field.name not in params, field.name
            continue
        assert field.name in params, f"{cls.__name__}.{field.name} is no option of `ratchet {command.name}`"
        param = params[field.name]
        assert param.help == field.metadata["description"], field.name
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        assert _cli_default(param.default) in (default, None if default == () else default), field.name


def test_every_serve_config_field_is_an_option_of_serve_with_its_description_and_default():
    _check_options(_command("serve", "pipeline.cli.serve"), ServeConfig, skip=SETTINGS_FIELDS)
    assert set(SETTINGS_FIELDS) <= set(Settings.model_fields) | {"registry_url"}
    assert "registry_url" in dir(Settings)  # a property of the settings (RATCHET_DATABASE_URL)


@pytest.mark.parametrize("name", ["advance", "demo"])
def test_every_advance_config_field_is_an_option_of_advance_and_demo(name):
    _check_options(_command(name, "pipeline.cli.advance"), AdvanceConfig)


def test_every_stack_config_field_is_an_option_of_up():
    from pipeline.cli.stack import StackConfig

    _check_options(_command("up", "pipeline.cli.up"), StackConfig)


def test_the_options_keep_their_names():
    flags = {flag for p in _command("serve", "pipeline.cli.serve").params for flag in p.opts}
    assert {"--engine-model", "--adapter-root", "--max-lora-rank", "--poll-seconds", "--threads"} <= flags
    assert {"--prompts", "--samples", "--no-collect", "--seed"} <= {
        flag
        for p in _command("advance", "pipeline.cli.advance").params
        for flag in (*p.opts, *p.secondary_opts)
    }
    assert "--startup-timeout" in {flag for p in _command("up", "pipeline.cli.up").params for flag in p.opts}


@dataclasses.dataclass(frozen=True)
class Toy:
    name: str = described("x", "A name.")
    count: int = described(3, "How many.", ge=1, le=9)
    ratio: float = described(0.5, "A ratio.")
    fast: bool = described(False, "Go fast.")
    roots: tuple[str, ...] = described(("a",), "Roots (repeatable).")
    mode: str | None = described(None, "A mode.")


def _toy_app(seen: list):
    toy = typer.Typer()

    @toy.command()
    @with_config(Toy, names={"roots": "--root"})
    def run(config: Toy, times: int = 1) -> None:
        """Run the toy."""
        seen.append((config, times))

    return toy


def test_the_options_build_the_config_the_command_gets():
    seen: list = []
    runner = CliRunner()
    result = runner.invoke(_toy_app(seen), [])
    assert result.exit_code == 0, result.output
    assert seen[-1] == (Toy(), 1)
    args = [
        "--name",
        "y",
        "--count",
        "9",
        "--ratio",
        "0.25",
        "--fast",
        "--root",
        "p",
        "--root",
        "q",
        "--mode",
        "m",
    ]
    result = runner.invoke(_toy_app(seen), [*args, "--times", "2"])
    assert result.exit_code == 0, result.output
    assert seen[-1] == (Toy(name="y", count=9, ratio=0.25, fast=True, roots=("p", "q"), mode="m"), 2)


def test_the_class_bounds_refuse_a_value():
    seen: list = []
    result = CliRunner().invoke(_toy_app(seen), ["--count", "10"])
    assert result.exit_code == 2 and not seen
    assert "--count" in result.output and "less than or equal to 9" in " ".join(result.output.split())


def test_a_field_without_a_description_is_refused():
    @dataclasses.dataclass
    class Bare:
        n: int = 1

    with pytest.raises(TypeError, match="Bare.n has no description"):
        knobs(Bare)


def test_a_pydantic_model_gives_options_too_and_its_own_checks_are_one_line():
    from pydantic import BaseModel, ConfigDict, Field

    from pipeline.errors import RatchetError

    class Model(BaseModel):
        model_config = ConfigDict(extra="forbid")

        steps: int = Field(default=4, ge=1, description="Steps.")
        rate: float = Field(default=0.5, gt=0, description="A rate.")

    seen: list = []
    toy = typer.Typer()

    @toy.command()
    @with_config(Model)
    def run(config: Model) -> None:
        seen.append(config)

    runner = CliRunner()
    assert runner.invoke(toy, ["--steps", "6", "--rate", "0.25"]).exit_code == 0
    assert seen == [Model(steps=6, rate=0.25)]
    assert runner.invoke(toy, ["--steps", "0"]).exit_code == 2  # the bound, as the option's range
    result = runner.invoke(toy, ["--rate", "0"])  # gt: the class's own check
    assert isinstance(result.exception, RatchetError) and "\n" not in str(result.exception)
    assert str(result.exception) == "--rate: Input should be greater than 0" and len(seen) == 1
