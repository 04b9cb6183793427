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


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be 0 or a positive integer, got {value}")
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


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("on", "true", "1", "yes"):
        return True
    if lowered in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"must be on or off, got {text!r}")


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
    switch: bool = False  # a flag without a value (--batch-invariant); its variable takes on/off/true/false/1/0

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
        "fp4_moe, head, hc): auto = Triton on CUDA, torch on CPU; e.g. all=triton,fp4_moe=torch",
        parse=kernel_spec,
        default="auto",
        metavar="SPEC",
    )
    api_key: Setting[str | None] = option(
        "Bearer token required on /v1/*, /tokenize, /detokenize", metavar="K", secret=True
    )
    max_request_bytes: Setting[int | None] = option(
        "largest request body accepted: past it a 413, refused while the body streams in "
        "[auto: 4 MiB + 48 bytes per token of max_model_len]",
        parse=positive_int,
        metavar="B",
    )
    default_thinking: Setting[bool] = option(
        "thinking mode when a request does not say", parse=on_off, default=True, choices=("on", "off")
    )
    batch_invariant: Setting[bool] = option(
        "every row's arithmetic independent of what shares its batch: bitwise-reproducible replies, slower "
        "(projections one token at a time)",
        parse=boolean,
        default=False,
        switch=True,
    )
    enforce_eager: Setting[bool] = option(
        "no CUDA graphs (debugging); by default the decode step is captured per batch size on CUDA",
        parse=boolean,
        default=False,
        switch=True,
    )
    moe_backend: Setting[str] = option(
        "where routed experts run: all on the GPU, GPU slots fed over PCIe, or hybrid (misses computed on "
        "the CPU by kt-kernel) [auto: gpu when every expert fits, else hybrid when kt-kernel is installed, "
        "else offload]",
        default="auto",
        choices=("auto", "gpu", "offload", "hybrid"),
    )
    speculative_tokens: Setting[int] = option(
        "multi-token prediction with the checkpoint's MTP block: N draft tokens verified per step; outputs "
        "unchanged (0 = off)",
        parse=non_negative_int,
        default=0,
        metavar="N",
    )
    tensor_parallel_size: Setting[int] = option(
        "ranks the model is split over, one worker process each (GPUs on CUDA: rank r on cuda:r; NCCL), or CPU "
        "processes over gloo; attention heads, the shared expert, embed and head split, the rest replicated",
        parse=positive_int,
        default=1,
        metavar="N",
    )
    expert_parallel: Setting[bool] = option(
        "with --tensor-parallel-size N > 1: each rank owns 1/N of the routed experts whole, instead of a 1/N "
        "slice of every expert",
        parse=boolean,
        default=False,
        switch=True,
    )
    log_level: Setting[str] = option("log verbosity", default="info", choices=("debug", "info", "warning", "error"))


# --max-request-bytes by default: room for the longest prompt the context holds, at a generous 48 bytes a
# token (a token is ~4 characters of text; JSON escapes write a character as up to 12 bytes, "\ud83d\ude00"),
# plus 4 MiB for tool schemas and the rest of the body: ~4.1 MB at 2K context, ~52 MB at 1M
REQUEST_BYTES_BASE = 4 * 2**20
REQUEST_BYTES_PER_TOKEN = 48


def default_max_request_bytes(max_model_len: int) -> int:
    return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN * max_model_len


def options() -> dict[str, Option]:
    """Option declarations by field name, in declaration order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(ServeConfig)}


def display(name: str, setting: Setting[Any]) -> str:
    opt = options()[name]
    if opt.secret:
        return "set" if setting.value else "not set"
    if setting.value is None:
        return "auto"
    if isinstance(setting.value, bool) and (opt.choices == ("on", "off") or opt.switch):
        return "on" if setting.value else "off"
    return str(setting.value)
