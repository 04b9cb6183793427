"""SamplingParams at the boundaries: `validate` accepts the defaults and names each bad field (the API
layer turns that into a 400), ids beyond the vocabulary are refused (issue #20), and the params survive
the msgpack trip to the worker inside AddRequest."""

from __future__ import annotations

import pytest

from dsv4serve.ipc.sampling import SamplingParams, StructuredOutput


def test_params_cross_the_process_boundary_unchanged() -> None:
    """SamplingParams travel inside AddRequest (msgpack); every field must survive the trip."""
    from dsv4serve.ipc.messages import AddRequest, Codec, ToWorker

    params = SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=11,
        stop_token_ids=(2, 9),
        ignore_eos=True,
        min_tokens=1,
        max_tokens=8,
        logprobs=5,
        logit_bias=((3, -1.5), (7, 100.0)),
        allowed_token_ids=(3, 7, 9),
        structured=StructuredOutput("json_schema", '{"type": "object"}', after_token=4),
    )
    codec = Codec(ToWorker)
    back = codec.decode(codec.encode(AddRequest("r", [1, 2], params)))
    assert back.sampling == params and isinstance(back.sampling.stop_token_ids, tuple)


# ------------------------------------------------------------------------------ validation


def test_defaults_are_valid() -> None:
    SamplingParams().validate()
    SamplingParams(
        temperature=0.0, top_k=0, logprobs=20, seed=-1, min_tokens=4, max_tokens=4, stop_token_ids=(1, 2)
    ).validate(vocab_size=3)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"stop_token_ids": (1, -1)}, "stop_token_ids"),
        ({"stop_token_ids": [1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": ((1, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((1, float("nan")),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (1, -2)}, "allowed_token_ids"),
        ({"structured": StructuredOutput("regex", "a+")}, "structured"),
    ],
)
def test_validate_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_validate_bounds_stop_token_ids_by_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(3,)).validate(vocab_size=3)


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_validate_bounds_token_limits_by_the_vocabulary(field: str) -> None:
    """Issue #20: ids beyond the vocabulary were accepted with a 200."""
    value = ((199_999, 1.0),) if field == "logit_bias" else (1, 199_999)
    with pytest.raises(ValueError, match=rf"{field} must hold token ids in \[0, 129280\), got 199999"):
        SamplingParams(**{field: value}).validate(vocab_size=129_280)


def test_seed_error_reads_as_one_sentence() -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(seed=2**80).validate()
    assert str(err.value).startswith("seed must be an integer in [-9223372036854775808, 9223372036854775807], got")
