"""One typed settings object per server, from command-line flags over ``SFS_*`` environment variables over the defaults.

A chapter composes :class:`ServerSettings` with its parts' option groups. A refused value, or a :class:`SettingsError` under
:func:`refused_flags_exit`, ends the process with one line per problem and exit status 2, as argparse does."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, TypeVar

import torch
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from shared.schemas import ContractLimits

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SFS_", cli_kebab_case=True, cli_implicit_flags=True, cli_avoid_json=True, extra="ignore"
    )

    host: str = Field("127.0.0.1", description="address to bind; loopback unless you mean to expose it")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    weights: str = Field("default", description="default | smollm2 | dummy | path to .gguf or .safetensors | Hugging Face GPT-2 or Llama directory")
    preset: str = Field("tiny", description="model shape for --weights dummy: tiny | gpt2")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    context: int = Field(0, ge=0, description="longest sequence served, prompt + new tokens (0: the model's own, at most 512)")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="weights and activations")
    torch_threads: int = Field(0, ge=0, description="intra-op threads for the model (0: leave torch's default)")
    max_new_tokens_limit: int = Field(256, ge=1, description="largest max_new_tokens a request may ask for")
    max_body_bytes: int = Field(1_000_000, ge=1, description="larger request bodies get 413")
    log_level: str = Field("info", description="debug | info | warning | error")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def limits(self, vocab_size: int, n_ctx: int) -> ContractLimits:
        return ContractLimits(
            vocab_size=vocab_size, n_ctx=n_ctx, max_new_tokens=self.max_new_tokens_limit, max_body_bytes=self.max_body_bytes
        )


SettingsT = TypeVar("SettingsT", bound=ServerSettings)


def parse_settings(cls: type[SettingsT], argv: list[str] | None = None, prog: str | None = None) -> SettingsT:
    """Build ``cls`` from ``argv`` (default: ``sys.argv[1:]``) and the environment."""
    argv = sys.argv[1:] if argv is None else argv
    prog = prog or cls.__module__
    cls.model_config["cli_prog_name"] = prog
    try:
        return CliApp.run(cls, cli_args=argv)
    except ValidationError as exc:
        for problem in exc.errors(include_url=False):
            where = "".join(f"--{str(part).replace('_', '-')}: " for part in problem["loc"][:1])
            message = problem["msg"].removeprefix("Value error, ")
            print(f"{prog}: error: {where}{message}", file=sys.stderr)
        raise SystemExit(2) from None


class SettingsError(ValueError):
    """A flag's value refused once the model is known (a pool too small for the model's context)."""


@contextmanager
def refused_flags_exit(prog: str) -> Iterator[None]:
    """Turn a :class:`SettingsError` raised while building the server into one line and exit status 2."""
    try:
        yield
    except SettingsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
