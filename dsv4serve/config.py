"""The server's settings: one frozen config, every value a Setting(value, source).

Each option is declared once, as a field with its flag, help and parser; the command line is built
from these declarations and `resolve.py` fills them in one pass. Nothing writes to a config after
resolution: a child process receives a copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Source(str, Enum):
    DEFAULT = "default"
    ENV = "env"
    CLI = "cli"
    MODEL_RULE = "model-rule"
    MEASURED = "measured"

    @property
    def explicit(self) -> bool:
        """The user chose this value; rules and measurements may not change it."""
        return self in (Source.ENV, Source.CLI)


@dataclass(frozen=True)
class Setting(Generic[T]):
    value: T
    source: Source
    note: str = ""  # why the value is what it is, when a rule or measurement set or checked it

    @classmethod
    def from_wire(cls, sourced: Any) -> Setting[Any]:
        """A setting as it crossed to the worker (ipc.messages.Sourced: `.value`, `.source` text)."""
        return cls(sourced.value, Source(sourced.source))


class ConfigError(ValueError):
    """A setting that cannot be honoured; the message names the flag, the limit and why."""


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"must be a TCP port 1-65535, got {value}")
    return value


def ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"must be in (0, 1], got {value}")
    return value


def kernel_spec(text: str) -> str:
    """'auto' or a per-kernel backend list ("all=triton,fp4_moe=torch"), checked by the model's parser."""
    if text.strip() == "auto":
        return "auto"
    from dsv4serve.model.backends import parse_backends  # imports torch: only when the option is given

    parse_backends(text)
    return text.strip()


def on_off(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("on", "off"):
        raise ValueError(f"must be on or off, got {text!r}")
    return lowered == "on"


@dataclass(frozen=True)
class Option:
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    secret: bool = False  # shown as 'set' / 'not set' in reports

    def flag(self, name: str) -> str:
        return "--" + name.replace("_", "-")


def option(help: str, **kwargs: Any) -> Any:
    return field(metadata={"option": Option(help=help, **kwargs)})


@dataclass(frozen=True)
class ServeConfig:
    model: Setting[str] = option("model folder, Hugging Face repo id, DeepSeek-V4-Flash, or dsv4-tiny", metavar="MODEL")
    served_model_name: Setting[str] = option(
        "the id in /v1/models and the only accepted `model` value [folder name / alias]", metavar="NAME"
    )
    host: Setting[str] = option("bind address", default="127.0.0.1")
    port: Setting[int] = option("bind port", parse=port_number, default=8000)
    device: Setting[str] = option(
        "where the model runs; cpu runs the PyTorch reference path", default="auto", choices=("auto", "cuda", "cpu")
    )
    max_model_len: Setting[int | None] = option(
        "context limit, prompt + output [model limit, capped by KV capacity]", parse=positive_int, metavar="L"
    )
    max_num_seqs: Setting[int] = option("requests running at once", parse=positive_int, default=32, metavar="S")
    max_queued_requests: Setting[int] = option(
        "waiting requests beyond the running ones; past it: 503", parse=positive_int, default=256, metavar="Q"
    )
    max_prefill_length: Setting[int | None] = option(
        "prefill chunk cap in tokens; an explicit value is always honoured, or startup stops and says why "
        "[auto: the largest chunk that fits the free memory measured after start-up]",
        parse=positive_int,
        metavar="N",
    )
    memory_ratio: Setting[float] = option(
        "share of GPU memory the server may use", parse=ratio, default=0.9, metavar="R"
    )
    moe_cache_size: Setting[int | None] = option(
        "GPU expert slots [auto: from the memory plan]", parse=positive_int, metavar="N"
    )
    num_tokens: Setting[int | None] = option(
        "KV capacity in tokens [auto: from the memory plan]", parse=positive_int, metavar="T"
    )
    kernels: Setting[str] = option(
        "Triton or torch per kernel (attention, indexer, compressor, fp8_gemm, "
        "fp4_moe, head): auto = Triton on CUDA, torch on CPU; e.g. all=triton,fp4_moe=torch",
        parse=kernel_spec,
        default="auto",
        metavar="SPEC",
    )
    api_key: Setting[str | None] = option(
        "Bearer token required on /v1/*, /tokenize, /detokenize", metavar="K", secret=True
    )
    default_thinking: Setting[bool] = option(
        "thinking mode when a request does not say", parse=on_off, default=True, choices=("on", "off")
    )
    log_level: Setting[str] = option("log verbosity", default="info", choices=("debug", "info", "warning", "error"))


def options() -> dict[str, Option]:
    """Option declarations by field name, in declaration order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(ServeConfig)}


def display(name: str, setting: Setting[Any]) -> str:
    opt = options()[name]
    if opt.secret:
        return "set" if setting.value else "not set"
    if setting.value is None:
        return "auto"
    if isinstance(setting.value, bool) and opt.choices == ("on", "off"):
        return "on" if setting.value else "off"
    return str(setting.value)
