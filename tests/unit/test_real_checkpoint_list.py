"""The real DeepSeek-V4-Flash tensor list (69,187 tensors), checked on meta tensors: no weights needed."""

import gzip

import torch

from dsv4serve.checkpoint.source import TensorInfo
from dsv4serve.checkpoint.validate import check_tensors, official_view
from dsv4serve.model.args import read_model_args
from dsv4serve.model.schema import SAFETENSORS_DTYPES, TORCH_DTYPES, checkpoint_schema, schema_bytes

REAL_BYTES = 159_609_485_896
REAL_COUNT = 69_187


def _meta_tensors(model_dir):
    with gzip.open(model_dir / "tensors.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    return {
        name: torch.empty(tuple(int(d) for d in shape.split(",")), dtype=TORCH_DTYPES[dtype], device="meta")
        for name, dtype, shape in rows
    }


def test_every_real_tensor_maps_to_a_planned_parameter(real_model_dir):
    meta = _meta_tensors(real_model_dir)
    assert len(meta) == REAL_COUNT
    infos = {n: TensorInfo(SAFETENSORS_DTYPES[t.dtype], tuple(t.shape), "meta") for n, t in meta.items()}
    args = read_model_args(real_model_dir)
    specs = checkpoint_schema(args)
    check_tensors(infos, "official", specs, "DeepSeek-V4-Flash tensor list")  # raises on any mismatch
    view, unknown = official_view(infos, "official")
    assert not unknown and set(view) == {s.name for s in specs}
    assert sum(t.numel() * t.element_size() for t in meta.values()) == REAL_BYTES
    assert schema_bytes(specs) == REAL_BYTES


def test_real_config_is_read_as_documented(real_model_dir):
    a = read_model_args(real_model_dir)
    assert (a.dim, a.n_layers, a.n_heads, a.head_dim, a.rope_head_dim) == (4096, 43, 64, 512, 64)
    assert a.n_mtp_layers == 1 and a.expert_dtype == "fp4" and a.dtype == "fp8"
    assert a.layer_kinds[:4] == ("swa", "swa", "csa", "hca") and a.layer_kinds[42:] == ("csa", "swa")
    assert a.kind(43) == "swa" and not a.is_hash_layer(43)
    assert [i for i in range(a.n_layers) if a.is_hash_layer(i)] == [0, 1, 2]
    assert (a.rope_factor, a.original_seq_len, a.compress_rope_theta) == (16.0, 65536, 160000.0)


def test_probe_finds_fp4_experts_without_inference_config(real_model_dir, tmp_path):
    # root config.json alone does not declare the expert format; the I8 tensors do
    (tmp_path / "config.json").write_bytes((real_model_dir / "config.json").read_bytes())
    import pytest

    from dsv4serve.model.args import ModelConfigError

    with pytest.raises(ModelConfigError, match="expert_dtype"):
        read_model_args(tmp_path)
    assert read_model_args(tmp_path, expert_dtype_hint="fp4").expert_dtype == "fp4"
