"""kt-kernel's copy and the expert bank share host RAM (--moe-backend hybrid): the host memory plan and the worker's
bank take the copy of the first `kt_layers` MoE layers only (memory/decode_choice.best_kt_layers chooses how many),
and leave the bank the rest. Pure arithmetic, no kt-kernel needed."""

from __future__ import annotations

import pytest

from dsv4serve.experts import attach
from dsv4serve.memory.chunk_planner import MemorySnapshot
from dsv4serve.memory.host_plan import HOST_MARGIN_BYTES, KT_COPY_FACTOR, host_split, kt_layers_copy_bytes
from dsv4serve.memory.plan import Machine
from dsv4serve.model.schema import TensorSpec

GIB = 2**30
LAYER = 3 * GIB  # one MoE layer's packed experts
BANK = 10 * LAYER


def test_the_copy_of_k_layers_is_k_layers_worth():
    assert kt_layers_copy_bytes(BANK, LAYER, None) == int(BANK * KT_COPY_FACTOR)  # None: every layer
    assert kt_layers_copy_bytes(BANK, LAYER, 4) == int(4 * LAYER * KT_COPY_FACTOR)
    assert kt_layers_copy_bytes(BANK, LAYER, 99) == int(BANK * KT_COPY_FACTOR)  # never more than the bank


def test_fewer_kt_layers_leave_the_bank_more_ram():
    machine = Machine(32 * GIB, 48 * GIB, "native")  # room 40 GiB: the bank (30) fits alone, not beside the copy
    every = host_split(BANK, machine, [], [], True, LAYER)
    two = host_split(BANK, machine, [], [], True, LAYER, kt_layers=2)
    # the copy of every layer (39 GiB) leaves 1 GiB, less than one layer's staging area: the bank all on disk
    assert every.kt_copy_bytes == int(BANK * KT_COPY_FACTOR) and every.ram_bytes == 0
    assert two.kt_copy_bytes == int(2 * LAYER * KT_COPY_FACTOR)
    assert two.ram_bytes == BANK and two.pin_estimate_bytes == BANK  # the whole bank beside it, pinned
    decisions: list[str] = []
    host_split(BANK, machine, decisions, [], True, LAYER, kt_layers=2)
    assert "kt-kernel's copy of the first 2 of 10 MoE layers" in decisions[0]


def test_the_worker_s_bank_fills_the_ram_beside_k_layers(monkeypatch: pytest.MonkeyPatch):
    free = 64 * GIB
    monkeypatch.setattr(attach, "host_snapshot", lambda: MemorySnapshot(free, 2 * free, "native"))
    specs = [
        TensorSpec(f"layers.{i}.ffn.experts", "U8", (LAYER,), "fp4_weight", "routed_experts", i) for i in range(10)
    ]
    left = free - HOST_MARGIN_BYTES
    assert attach.bank_ram_beside_kt(specs) == max(0, left - int(BANK * KT_COPY_FACTOR))
    assert attach.bank_ram_beside_kt(specs, 10, 3) == left - int(3 * LAYER * KT_COPY_FACTOR)
