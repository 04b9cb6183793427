"""The paged KV pool: sizes agree with the memory plan, slots copy, a standalone pool grows, and
reference-counted ids come back exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4serve.memory.kv_geometry import kv_geometry
from dsv4serve.model.args import args_from_dicts, read_model_args
from dsv4serve.model.kv_pool import KvPool, SequenceState
from dsv4serve.paging import IdAllocator, OutOfIds
from dsv4serve.tiny.spec import TINY_CONFIG

REAL_CONFIG = Path(__file__).resolve().parents[1] / "data/DeepSeek-V4-Flash/config.json"


def tiny_args():
    return args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_pool_bytes_are_what_the_memory_plan_counts(which):
    if which == "real":
        args = read_model_args(REAL_CONFIG.parent)
        pool_args = dict(num_pages=2, num_slots=1, device="meta")  # the real geometry, no memory
    else:
        args, pool_args = tiny_args(), dict(num_pages=5, num_slots=3)
    pool = KvPool(args, torch.bfloat16, **pool_args)
    geo = kv_geometry(args)
    assert pool.page_tokens == (128 if which == "real" else 16)
    assert pool.page_bytes == geo.bytes_per_token * pool.page_tokens
    assert pool.num_bytes == pool.page_bytes * pool.num_pages + geo.seq_state_bytes * pool.num_slots


def test_copy_slot_copies_ring_and_carry_only():
    pool = KvPool(tiny_args(), torch.float32, num_pages=2, num_slots=3)
    for layer in pool.layers:
        layer.swa[1].normal_()
        for c in (layer.comp, layer.idx):
            if c is not None:
                c.pending_kv[1].normal_()
                c.entries.normal_()
    entries = [l.comp.entries.clone() for l in pool.layers if l.comp is not None]
    pool.copy_slot(1, 2)
    for layer in pool.layers:
        assert torch.equal(layer.swa[2], layer.swa[1]) and not layer.swa[0].any()
        if layer.comp is not None:
            assert torch.equal(layer.comp.pending_kv[2], layer.comp.pending_kv[1])
    assert all(torch.equal(a, l.comp.entries) for a, l in zip(entries, [l for l in pool.layers if l.comp]))


def test_paged_entries_are_addressed_through_the_page_table():
    pool = KvPool(tiny_args(), torch.float32, num_pages=4, num_slots=1)
    comp = pool.layers[1].comp  # CSA, ratio 4: 4 entries per 16-token page
    pages = torch.tensor([3, 0])  # logical page 0 -> physical 3, 1 -> 0
    values = torch.arange(6 * comp.entries.shape[-1], dtype=torch.float32).view(6, -1)
    comp.write(pages, 0, values)
    assert torch.equal(comp.entries[3], values[:4]) and torch.equal(comp.entries[0, :2], values[4:])
    assert torch.equal(comp.read(pages, 6), values)


def test_a_standalone_pool_grows_and_gives_ids_back():
    pool = KvPool(tiny_args(), torch.float32, num_pages=1, num_slots=1, standalone=True)
    a, b = pool.new_sequence(), pool.new_sequence()  # the second slot needs growth
    assert (a.slot, b.slot) == (0, 1) and pool.num_slots == 2
    pool.reserve(a, 40)  # 3 pages of 16 tokens
    assert a.pages == [0, 1, 2] and pool.num_pages >= 3
    assert all(l.comp is None or l.comp.entries.shape[0] == pool.num_pages for l in pool.layers)
    pool.release(a)
    assert pool.new_sequence().slot == 0


def test_an_engine_pool_never_takes_pages_itself():
    pool = KvPool(tiny_args(), torch.float32, num_pages=4, num_slots=1)

    seq = SequenceState(pool, 0, pages=[2])
    pool.reserve(seq, 16)  # covered
    with pytest.raises(RuntimeError, match="scheduler did not assign"):
        pool.reserve(seq, 17)


def test_ids_are_shared_and_freed_by_the_last_reference():
    ids = IdAllocator(3)
    a = ids.take(2)
    assert a == [0, 1] and ids.num_free == 1
    shared = ids.share(a)
    ids.release(a)
    assert ids.num_free == 1 and ids.refs(0) == 1
    ids.release(shared)
    assert ids.num_free == 3
    with pytest.raises(ValueError):
        ids.release([0])
    with pytest.raises(OutOfIds):
        ids.take(4)
