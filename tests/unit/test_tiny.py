"""dsv4-tiny: every layer kind, the real tokenizer, and the same bytes on every machine."""

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.tiny.builder import MANIFEST, ensure_tiny, tiny_folder
from dsv4serve.tiny.spec import TINY_CONFIG

# sha256 of the built files; a change here means every cached dsv4-tiny is different: bump TINY_VERSION
GOLDEN_SHA256 = {
    "model-00001-of-00003.safetensors": "c9b9d2fc1800b34578bc46dc689850ad93e8ce951a3493c938758a4113a53087",
    "model-00002-of-00003.safetensors": "b2ca41a23d1228de170d195997abfe58aff2c2527fc646717b8b887e6766df74",
    "model-00003-of-00003.safetensors": "09bef10517218c8ee52769f2539ebaf889cec0ebe26b488954f7493ff0998c48",
    "model.safetensors.index.json": "d523a1e06bdae2fe3ac248a03064b0288c289dc6a3b1b47e722f917c1fbc602d",
}


def test_covers_every_layer_kind(tiny_dir):
    ckpt = open_checkpoint(tiny_dir)
    a = ckpt.args
    assert ckpt.layout == "official" and a.dtype == "fp8" and a.expert_dtype == "fp4"
    assert set(a.layer_kinds[: a.n_layers]) == {"swa", "csa", "hca"}
    assert a.n_mtp_layers == 1 and a.hc_mult == 4 and a.vocab_size == 129280
    hash_layers = [i for i in range(a.n_layers) if a.is_hash_layer(i)]
    assert hash_layers and len(hash_layers) < a.n_layers
    roles = {s.role for s in ckpt.specs}
    assert {"fp8_weight", "fp8_scale", "fp4_weight", "fp4_scale", "index"} <= roles
    names = {s.name for s in ckpt.specs}
    assert "layers.1.attn.indexer.wq_b.weight" in names and "mtp.0.e_proj.weight" in names
    assert "layers.2.attn.compressor.ape" in names and "layers.2.attn.indexer.wq_b.weight" not in names


def test_real_tokenizer(tiny_dir):
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.get_vocab_size() <= TINY_CONFIG["vocab_size"]
    for text, token_id in [
        ("<｜begin▁of▁sentence｜>", 0),
        ("<｜end▁of▁sentence｜>", 1),
        ("<｜User｜>", 128803),
        ("<｜Assistant｜>", 128804),
        ("<think>", 128821),
        ("</think>", 128822),
    ]:
        assert tok.token_to_id(text) == token_id
    ids = tok.encode("Hello, world").ids
    assert tok.decode(ids) == "Hello, world"


def test_identical_bytes(tiny_dir):
    manifest = json.loads((tiny_dir / MANIFEST).read_text())["sha256"]
    for name, digest in manifest.items():
        assert hashlib.sha256((tiny_dir / name).read_bytes()).hexdigest() == digest, name
    for name, digest in GOLDEN_SHA256.items():
        assert manifest[name] == digest, f"{name} differs from the golden build"


def test_build_is_atomic_and_reused(tiny_cache, monkeypatch):
    import dsv4serve.tiny.builder as builder

    def fail(_):
        raise AssertionError("must not rebuild a complete cache")

    monkeypatch.setattr(builder, "write_tiny", fail)
    assert ensure_tiny(tiny_cache) == tiny_folder(tiny_cache)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    import dsv4serve.tiny.builder as builder

    def boom(folder, config=None):
        (folder / "partial").write_text("x")
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "write_tiny", boom)
    with pytest.raises(KeyboardInterrupt):
        ensure_tiny(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_configs_preset_matches_spec():
    assert json.loads((Path(__file__).resolve().parents[2] / "configs" / "dsv4-tiny.json").read_text()) == TINY_CONFIG


def test_transformers_reads_the_tiny_config(tiny_dir):
    """HF tools (AutoConfig, AutoTokenizer; load generators that use them) must accept the folder."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(tiny_dir)
    ours = open_checkpoint(tiny_dir).args
    kinds = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert tuple(kinds[t] for t in hf.layer_types) == ours.layer_kinds[: ours.n_layers]
    assert hf.compress_rates["heavily_compressed_attention"] == ours.compress_ratios[2]
    assert hf.mlp_layer_types.count("hash_moe") == ours.n_hash_layers
