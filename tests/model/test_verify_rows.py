"""Equal short rows (a verify step's: every row T tokens, T <= the smallest compress ratio) run as T decode
sub-steps over all rows (`BatchLayout.substeps`, `Attention` with `vector`) instead of row by row. The oracle
is the per-row path itself (`Attention.max_substeps = 0` forces it, with the numerics otherwise unchanged):
the same rows from the same pool give the same logits and leave the same pool state (window ring, compressor
carry, compressed entries and indexer keys below each row's count).

Rows sit at different positions in one batch, chosen so that the T tokens close a window of every ratio of the
configs (4, 8, 16) and wrap the window ring (6, 8). The two paths differ in summation order only (masked keys,
batched pooling), in fp32 (numerics OFF) within the decode-path tests' tolerance (test_decode_paths.py: a few
fp32 ulps of the scale); layer 0's ring and carry come from the embeddings through the same ops: bitwise.
On the Triton backends (the interpreter) the attention and indexer kernels are the same launch on both paths,
the compressor runs compressor_decode against compressor_pool + compressed_entry."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before any kernel module is imported

import collections
import contextlib
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.batch import build_layout
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import NUMERICS_OFF
from dsv4serve.model.transformer import BatchRow

PREFIXES = (2, 5, 13, 30)  # first window; ring wrap + ratio-8 close; ratio-16 close at 15; at 31
REL_TOL = 1e-5  # of the compared tensor's scale: test_decode_paths.py's fp32 tolerance
VECTOR = dataclasses.replace(NUMERICS_OFF, batch_invariant=False)
TRITON = dataclasses.replace(
    VECTOR, backends=KernelBackends(attention="triton", indexer="triton", compressor="triton", token_ops="triton")
)


@contextlib.contextmanager
def _per_row(model):
    """The per-row path for multi-token rows, all else unchanged."""
    attns = [layer.attn for layer in model.layers]
    saved = [a.max_substeps for a in attns]
    for a in attns:
        a.max_substeps = 0
    try:
        yield
    finally:
        for a, n in zip(attns, saved):
            a.max_substeps = n


@contextlib.contextmanager
def _no_per_row_update(monkeypatch):
    """The vectorized run must not fall back to the per-row compressor update."""

    def refuse(*args, **kwargs):
        raise AssertionError("equal short rows took the per-row compressor update")

    with monkeypatch.context() as m:
        m.setattr(Compressor, "update", refuse)
        yield


def _verify_step(case, num, tokens: int, per_row: bool, monkeypatch):
    """Rows prefilled to PREFIXES (alone, the same on both paths), then one step of `tokens` tokens per row:
    (logits [B, T, vocab], the readable pool state as a list of (name, tensor))."""
    model, args = case.model, case.args
    ids = [torch.roll(case.token_ids, 7 * b) for b in range(len(PREFIXES))]  # different tokens per row
    pool = KvPool(args, num.compute_dtype, num_pages=32, num_slots=len(PREFIXES) + 1, standalone=True)
    for layer in pool.layers:
        for t in layer.tensors():
            t.zero_()
    pool.new_sequence()  # slot 0 unused: the rows' slots are not their indices
    states = [pool.new_sequence() for _ in PREFIXES]
    for b, (n, st) in enumerate(zip(PREFIXES, states)):
        model([BatchRow(ids[b][:n], st)], num)
    rows = [BatchRow(ids[b][n : n + tokens], st) for b, (n, st) in enumerate(zip(PREFIXES, states))]
    with _per_row(model) if per_row else _no_per_row_update(monkeypatch):
        logits = torch.stack(model(rows, num, all_logits=True).logits)
    return logits, _state(pool, states)


def _state(pool: KvPool, states) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, layer in enumerate(pool.layers[: pool.args.n_layers]):
        for st in states:
            out.append((f"layer {i} ring, slot {st.slot}", layer.swa[st.slot].clone()))
            pages = torch.tensor(st.pages)
            for tier, c in (("comp", layer.comp), ("idx", layer.idx)):
                if c is None:
                    continue
                for name in ("pending_kv", "pending_score", "prev_kv", "prev_score"):
                    t = getattr(c, name)
                    if t is not None:
                        out.append((f"layer {i} {tier} {name}, slot {st.slot}", t[st.slot].clone()))
                entries = c.read(pages, st.num_tokens // c.ratio).clone()
                out.append((f"layer {i} {tier} entries ({entries.shape[0]}), slot {st.slot}", entries))
    return out


def _finite_scale(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _check_close(got, want) -> None:
    g_logits, g_state = got
    w_logits, w_state = want
    scale = w_logits.abs().max()
    gap = (g_logits - w_logits).abs().max()
    assert gap <= REL_TOL * scale, f"max |dlogit| {gap:.3g} of {scale:.3g}"
    assert torch.equal(g_logits.argmax(-1), w_logits.argmax(-1))
    for (name, g), (_, w) in zip(g_state, w_state):
        assert g.shape == w.shape, name
        same_inf = torch.isinf(w)  # -inf scores of a window's missing previous half: exactly where they were
        assert torch.equal(torch.isinf(g), same_inf), name
        if name.startswith("layer 0 ") and "entries" not in name:  # from the embeddings, copies and one add
            assert torch.equal(g, w), name
        diff = (g - w)[~same_inf].abs()
        assert diff.numel() == 0 or diff.max() <= REL_TOL * max(_finite_scale(w), 1e-30), name


@pytest.mark.parametrize("tokens", [2, 4])
@pytest.mark.parametrize("case_name", ["mixed4", "hca_first"])
def test_equal_rows_on_torch_match_the_per_row_path(helpers, monkeypatch, case_name, tokens):
    case = helpers.build_case(case_name)
    vector = _verify_step(case, VECTOR, tokens, per_row=False, monkeypatch=monkeypatch)
    per_row = _verify_step(case, VECTOR, tokens, per_row=True, monkeypatch=monkeypatch)
    _check_close(vector, per_row)


@pytest.mark.slow  # the interpreter runs attention, indexer, compressor and token kernels of two forwards
@pytest.mark.parametrize("case_name", ["mixed4"])  # the torch tests cover hca_first; one config keeps CI short
def test_equal_rows_on_triton_match_the_per_row_path(helpers, monkeypatch, case_name):
    case = helpers.build_case(case_name)
    vector = _verify_step(case, TRITON, 4, per_row=False, monkeypatch=monkeypatch)
    per_row = _verify_step(case, TRITON, 4, per_row=True, monkeypatch=monkeypatch)
    _check_close(vector, per_row)


def test_substeps_are_decode_layouts_of_each_token():
    """Token t of every row, at start + t, the rows' slots and pages; unequal rows have none."""
    layout = build_layout([[1, 2, 3], [4, 5, 6]], [5, 9], [3, 1], [[0, 2], [1]], torch.device("cpu"))
    assert layout.tokens_per_row == 3
    steps = layout.substeps
    assert [s.positions.tolist() for s in steps] == [[5, 9], [6, 10], [7, 11]]
    assert [s.token_ids.tolist() for s in steps] == [[1, 4], [2, 5], [3, 6]]
    assert all(s.is_decode and s.seq_slot.tolist() == [3, 1] and s.max_end == layout.max_end for s in steps)
    assert all(torch.equal(s.block_table, layout.block_table) and s.cu_seqlens.tolist() == [0, 1, 2] for s in steps)
    assert [sp.start_pos for sp in steps[2].spans] == [7, 11]
    ragged = build_layout([[1, 2], [3]], [0, 0], [0, 1], [[0], [1]], torch.device("cpu"))
    assert ragged.tokens_per_row == 0
    with pytest.raises(ValueError):
        _ = ragged.substeps


# ---- the census ratchet (issue 19): a verify step's launches per layer do not grow with the batch ----

CENSUS_CONTEXT = 40  # tokens before the step (row b at CENSUS_CONTEXT + 3 b: rows at different positions)


@pytest.fixture(scope="module")
def kernel_model(tiny_dir):
    """dsv4-tiny packed as the CUDA worker holds it, every kernel on Triton (bench/census/engine.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.census`
    from bench.census.engine import cuda_worker_numerics
    from dsv4serve.checkpoint.loader import open_checkpoint
    from dsv4serve.model.packed_load import load_packed

    ckpt = open_checkpoint(tiny_dir)
    num = cuda_worker_numerics(ckpt.args)
    model, _ = load_packed(ckpt, num.backends, torch.device("cpu"), False, progress=False)
    model.use_kernels(num.backends)
    return model, num


def _verify_launches_per_layer(model, num, batch: int, tokens: int) -> tuple[dict, int]:
    """Launches of one verify forward (B rows of `tokens` tokens, all positions' logits), counted as
    bench/bench_spec_verify.py counts them: (layer -> launches, total). The pool's contents play no part in
    the counts (the vectorized paths' shapes depend on the rows and static bounds only)."""
    from bench.census.attribution import Attributor
    from bench.census.counter import StepCounter
    from bench.census.stand_ins import stand_ins

    args = model.args
    pool = KvPool(args, num.compute_dtype, num_pages=batch * 8, num_slots=batch, standalone=True)
    states = [pool.new_sequence() for _ in range(batch)]
    starts = [CENSUS_CONTEXT + 3 * b for b in range(batch)]
    for st, start in zip(states, starts):
        pool.reserve(st, start + tokens)
    token_lists = [[1000 + 7 * b + t for t in range(tokens)] for b in range(batch)]
    cpu = torch.device("cpu")
    with stand_ins():
        layout = build_layout(token_lists, starts, [st.slot for st in states], [st.pages for st in states], cpu)
        model.run(layout, pool, num, all_logits=True)  # first: imports and per-process caches
        layout = build_layout(token_lists, starts, [st.slot for st in states], [st.pages for st in states], cpu)
        with StepCounter(Attributor(model)) as seen:
            model.run(layout, pool, num, all_logits=True)
    per_layer = collections.Counter(launch.layer for launch in seen.launches if launch.layer is not None)
    return dict(per_layer), seen.count()


@pytest.mark.slow  # ~2 min: four verify forwards of dsv4-tiny in the interpreter
@pytest.mark.parametrize("tokens", [4])  # N = 3: a window closes inside the row (T = 2 took another minute of CI)
def test_verify_launches_per_layer_do_not_grow_with_the_batch(kernel_model, tokens):
    model, num = kernel_model
    one, one_total = _verify_launches_per_layer(model, num, 1, tokens)
    # 3 rows: a per-row path launches 3x what 1 row does; bench/bench_spec_verify.py shows B=8 (RESULTS.md)
    three, three_total = _verify_launches_per_layer(model, num, 3, tokens)
    assert len(one) == model.args.n_layers
    assert three == one, f"launches per layer, B=3 {three} against B=1 {one}"
    assert three_total == one_total
