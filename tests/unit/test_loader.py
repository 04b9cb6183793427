"""Checkpoint loading: the official layout (dsv4-tiny), the transformers layout, and broken checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4_kernels import formats as quant
from dsv4serve.checkpoint.loader import iter_dense, load_dense_state_dict, open_checkpoint
from dsv4serve.checkpoint.source import CheckpointError


def test_official_layout_loads_and_dequantizes(tiny_dir):
    ckpt = open_checkpoint(tiny_dir)
    assert ckpt.layout == "official" and ckpt.args.expert_dtype == "fp4"
    args, state = load_dense_state_dict(tiny_dir)
    assert not any(name.endswith(".scale") for name in state)
    # independent dequantization from the raw file bytes, with the format rules written out here
    shard = load_file(str(tiny_dir / "model-00001-of-00003.safetensors"))
    w, s = shard["layers.0.attn.wq_a.weight"], shard["layers.0.attn.wq_a.scale"]
    want = w.float() * torch.pow(2.0, s.view(torch.uint8).float() - 127).repeat_interleave(128, 0)[: w.shape[0]]
    assert torch.equal(state["layers.0.attn.wq_a.weight"], want)
    packed = shard["layers.0.ffn.experts.3.w2.weight"].view(torch.uint8)
    scale = shard["layers.0.ffn.experts.3.w2.scale"].view(torch.uint8)
    k = 5  # odd K index: high nibble of byte k // 2
    code = int(packed[7, k // 2]) >> 4
    want_val = quant.E2M1_VALUES[code] * 2.0 ** (int(scale[7, k // 32]) - 127)
    assert float(state["layers.0.ffn.experts.3.w2.weight"][7, k]) == want_val
    assert state["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert state["layers.0.hc_attn_fn"].dtype == torch.float32


def test_a_view_of_a_mapped_tensor_holds_the_bytes_a_read_copies(tiny_dir):
    """SafetensorsFolder.view (the expert bank's disk tier reads experts through it, no copy) against read: the
    same bytes for every tensor, in each dtype the checkpoint stores (FP8, FP4 packed, e8m0 scales, fp32, int64)."""
    source = open_checkpoint(tiny_dir).source
    dtypes = set()
    for name, info in source.infos.items():
        want = source.read(name)
        got = source.view(name)
        assert got.dtype == torch.uint8 and got.numel() == want.numel() * want.element_size(), name
        assert torch.equal(got, want.contiguous().view(torch.uint8).flatten()), name
        dtypes.add(info.dtype)
    assert {"F8_E4M3", "F32", "I64"} <= dtypes, dtypes
    source.close()


def _copy(tiny_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, dst)
    return dst


def _rewrite_shard(folder, file, edit):
    path = folder / file
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    if not (folder / "model.safetensors.index.json").is_file():
        return
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file}
    index["weight_map"].update({n: file for n in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


SHARD1 = "model-00001-of-00003.safetensors"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("layers.1.attn.indexer.wq_b.scale"), "missing 1 tensor.*layers.1.attn.indexer.wq_b.scale"),
        (
            lambda t: t.update({"layers.0.attn.compressor.ape": torch.zeros(4, 256)}),
            "unexpected 1 tensor.*layers.0.attn.compressor.ape",
        ),
        (
            lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(96, 128).to(torch.float8_e4m3fn)}),
            r"layers.0.attn.wkv.weight has shape \[96, 128\], the config implies \[128, 128\]",
        ),
        (
            lambda t: t.update({"layers.1.attn.attn_sink": torch.zeros(4, dtype=torch.bfloat16)}),
            "layers.1.attn.attn_sink has dtype BF16, the config implies F32",
        ),
    ],
)
def test_broken_checkpoints_name_the_tensor(tiny_dir, tmp_path, edit, message):
    folder = _copy(tiny_dir, tmp_path)
    _rewrite_shard(folder, SHARD1, edit)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(folder)


def test_missing_shard_is_reported(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        open_checkpoint(folder)


def test_truncated_shard_is_reported(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path)
    (folder / SHARD1).write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match=f"{SHARD1}: not a readable safetensors file"):
        open_checkpoint(folder)


def test_progress_counts_every_byte(tiny_dir, monkeypatch):
    import dsv4serve.checkpoint.loader as loader

    seen = {}

    class Bar:
        def __init__(self, total, **_):
            seen["total"], seen["done"] = total, 0

        def update(self, n):
            seen["done"] += n

        def close(self):
            pass

    monkeypatch.setattr(loader, "tqdm", Bar)
    ckpt = open_checkpoint(tiny_dir)
    for _ in iter_dense(ckpt):
        pass
    file_bytes = sum(p.stat().st_size for p in tiny_dir.glob("*.safetensors"))
    assert seen["done"] == seen["total"] and 0.99 * file_bytes < seen["total"] <= file_bytes


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(
        vocab_size=300,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        num_hash_layers=1,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    )
    torch.manual_seed(0)
    return transformers.DeepseekV4ForCausalLM(cfg)


def _save_module_names(model, folder):
    """The module-name dialect: the state dict as transformers holds it (experts stacked)."""
    folder.mkdir()
    model.config.to_json_file(str(folder / "config.json"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("dialect", ["save_pretrained", "module_names"])
def test_transformers_layout_matches_transformers_own_weights(hf_model, tmp_path, dialect):
    folder = tmp_path / dialect
    if dialect == "save_pretrained":
        hf_model.save_pretrained(folder)
    else:
        _save_module_names(hf_model, folder)
    args, state = load_dense_state_dict(folder)
    hf = hf_model.state_dict()
    assert args.layer_kinds == ("swa", "csa", "hca") and args.n_mtp_layers == 0 and args.dtype == "fp32"
    assert torch.equal(state["embed.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(state["layers.1.attn.kv_norm.weight"], hf["model.layers.1.self_attn.kv_norm.weight"])
    assert torch.equal(
        state["layers.1.attn.indexer.weights_proj.weight"],
        hf["model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"],
    )
    gate_up, down = hf["model.layers.2.mlp.experts.gate_up_proj"], hf["model.layers.2.mlp.experts.down_proj"]
    assert torch.equal(state["layers.2.ffn.experts.3.w1.weight"], gate_up[3, :32])
    assert torch.equal(state["layers.2.ffn.experts.3.w3.weight"], gate_up[3, 32:])
    assert torch.equal(state["layers.2.ffn.experts.1.w2.weight"], down[1])
    assert torch.equal(state["layers.2.ffn.gate.bias"], hf["model.layers.2.mlp.gate.e_score_correction_bias"])
    # and back: the official names convert to exactly transformers' state dict
    from dsv4serve.checkpoint.hf_names import official_state_dict_to_hf

    back = official_state_dict_to_hf(state, args.n_layers)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_transformers_layout_unknown_tensor(hf_model, tmp_path):
    folder = tmp_path / "hf"
    hf_model.save_pretrained(folder)
    _rewrite_shard(folder, "model.safetensors", lambda t: t.update({"model.mystery.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="unexpected 1 tensor.*model.mystery.weight"):
        open_checkpoint(folder)
