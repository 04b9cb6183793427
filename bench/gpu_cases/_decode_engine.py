"""The engine state behind bench/gpu_cases/decode_step.py: one model, KV pool and set of prefilled rows that
every case shares, and the homes of the routed experts.

    bench = DecodeBench(device, args, rows, context_tokens, extra_tokens)   # builds nothing yet
    bench.setup()                        # random model, pool, prefill, slot cache (once; a failure sticks)
    bench.use("resident" | "slots" | "staged" | "hybrid")   # where the MoE layers read the routed experts
    bench.eager_step(n) / bench.graph_step(mode, n)    # one decode step of rows 0..n-1 -> logits [n, vocab]
    bench.snapshot(n); ...; bench.restore()            # rows 0..n-1 back to where they were

Not a module gpu_check discovers (its name starts with "_").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREFILL_ROWS = 4  # rows per prefill forward (8,192 tokens at the real dimensions: a usual prefill chunk)
SLOT_SHARE = 0.5  # of the routed experts, the share the slot cache's device slots hold
FP4_PARTS = tuple(f"{w}{kind}" for w in ("w1", "w3", "w2") for kind in ("", "_scale"))  # the bank's names


def error_line(exc: BaseException) -> str:
    """An exception as one line of text (kept instead of the exception, whose frames would hold the model)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


@dataclass
class Rows:
    """Row r runs in sequence slot r, on its own pages; tokens[r][p] is its input at position p."""

    tokens: list[list[int]]
    pages: list[list[int]]
    pos: list[int]  # each row's length: the position its next step runs


class DecodeBench:
    def __init__(
        self, device: torch.device, args, rows: int, context_tokens: int, extra_tokens: int, mtp: bool = False
    ):
        self.device, self.args, self.n_rows = device, args, rows
        self.mtp = mtp  # the MTP block and its KV layer too (the speculative cases: gpu_cases/spec_graphs.py)
        self.context, self.max_len = context_tokens, context_tokens + extra_tokens
        self.pages_per_row = -(-self.max_len // args.page_tokens)
        self.graph_len = self.pages_per_row * args.page_tokens  # DecodeGraphs' max_model_len: its static bounds
        self.n_experts = args.n_layers * args.n_routed_experts
        self.n_slots = max(args.n_activated_experts, round(SLOT_SHARE * self.n_experts))
        self.mode = "resident"
        self.hybrid = None  # HybridExperts, made by the first use("hybrid")
        self.staged = None  # a slot cache whose bank holds the last layer pageable: made by the first use("staged")
        self.graphs: dict[str, object] = {}  # mode -> DecodeGraphs, built at first use
        self.graph_errors: dict[str, str] = {}  # mode -> why its DecodeGraphs could not be built
        self.ready = False
        self._error = ""  # why the set-up failed
        self._saved: tuple[int, list[int]] = (0, [])

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        if self._error:
            raise RuntimeError(f"the decode bench's set-up failed earlier: {self._error}")
        if self.ready:
            return
        try:
            self._build()
        except BaseException as exc:  # every later case reports this one failure instead of retrying it
            self._error = error_line(exc)
            raise
        self.ready = True

    def _build(self) -> None:
        from dsv4serve.model.batch import HostStaging
        from dsv4serve.model.kv_pool import KvPool
        from dsv4serve.model.random_init import random_model
        from dsv4serve.worker.model_load import worker_numerics

        args, n = self.args, self.n_rows
        self.num = worker_numerics(args, "auto", self.device)
        self.model = random_model(args, self.device, seed=0, include_mtp=self.mtp)
        self.model.use_kernels(self.num.backends)
        self.moes = [block.ffn for block in self.model.layers]
        self.resident = [self._stacked(moe) for moe in self.moes]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dense experts are gone
        # as worker/engine_setup.py: the pool's last slot and page are the padding rows'; slots n..2n-1: snapshots
        self.pool = KvPool(
            args,
            self.num.compute_dtype,
            num_pages=n * self.pages_per_row + 1,
            num_slots=2 * n + 1,
            include_mtp=self.mtp,
            device=self.device,
        )
        self.staging = HostStaging(self.device)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, args.vocab_size, (n, self.max_len), generator=gen).tolist()
        pages = [list(range(r * self.pages_per_row, (r + 1) * self.pages_per_row)) for r in range(n)]
        self.rows = Rows(tokens, pages, [0] * n)
        self._prefill()
        self.cache = self._slot_cache()

    def _stacked(self, moe) -> tuple[torch.nn.ModuleList, dict[str, torch.Tensor]]:
        """The layer's resident experts (dense modules, for the torch path) and their stacked MXFP4 copies
        (`w1_fp4`, ...: the kernel's, and the bank's source). On the kernel path the dense ones are dropped."""
        if moe.w1_fp4 is None:  # torch backends: use_kernels packed nothing
            moe.pack_fp4()
        stacks = {
            f"{w}_fp4{kind}": getattr(moe, f"{w}_fp4{kind}") for w in ("w1", "w3", "w2") for kind in ("", "_scale")
        }
        if self.num.backends.fp4_moe == "triton":
            moe.use_packed_experts(stacks)
        return moe.experts, stacks

    def _prefill(self) -> None:
        from dsv4serve.model.batch import build_layout

        page, rows = self.args.page_tokens, self.rows
        for first in range(0, self.n_rows, PREFILL_ROWS):
            batch = range(first, min(first + PREFILL_ROWS, self.n_rows))
            layout = build_layout(
                [rows.tokens[r][: self.context] for r in batch],
                [0] * len(batch),
                list(batch),
                [rows.pages[r][: -(-self.context // page)] for r in batch],
                self.device,
            )
            self.model.run(layout, self.pool, self.num)
            for r in batch:
                rows.pos[r] = self.context

    def _slot_cache(self, unpinned: int = 0):
        """An ExpertSlotCache over a bank holding the model's packed experts in host memory (pinned on CUDA,
        so the FP4 kernel reads the experts outside the slots in place); `unpinned`: the last layers held pageable
        instead, as beyond a pin budget (on CUDA the host stages their misses: the decode graphs are cut there)."""
        from dsv4serve.experts.bank import BankReport, ExpertBank
        from dsv4serve.experts.pinning import PinBudget
        from dsv4serve.experts.slot_cache import ExpertSlotCache

        cuda = self.device.type == "cuda"
        layers, pinned = {}, []
        for i, (moe, (_, stacks)) in enumerate(zip(self.moes, self.resident)):
            pin = cuda and i < len(self.moes) - unpinned
            src = {part: stacks[f"{part[:2]}_fp4{part[2:]}"] for part in FP4_PARTS}  # w1_scale <- w1_fp4_scale
            layers[moe.layer_id] = {
                part: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for part, t in src.items()
            }
            pinned += [moe.layer_id] if pin else []
        shapes = {part: (tuple(t.shape[1:]), t.dtype) for part, t in next(iter(layers.values())).items()}
        total = sum(t.numel() * t.element_size() for parts in layers.values() for t in parts.values())
        held = total * len(pinned) // len(layers)
        budget = PinBudget(held, "native", "decode_step bench: the random model's packed experts")
        report = BankReport(held, total - held, 0, budget)
        n_experts = self.args.n_routed_experts
        bank = ExpertBank(
            layers,
            {},
            None,
            shapes,
            n_experts,
            total // (len(layers) * n_experts),
            report,
            frozenset(pinned),
        )
        return ExpertSlotCache(bank, self.n_slots, self.device, first_layer=self.moes[0].layer_id)

    def staged_cache(self):
        """The "staged" home's slot cache (the last layer pageable), made at first use."""
        if self.staged is None:
            self.staged = self._slot_cache(unpinned=1)
        return self.staged

    # ------------------------------------------------------------------ expert homes and graphs

    def use(self, mode: str) -> None:
        """Route the MoE layers to the resident stacks, to the slot cache, or (hybrid) to the slot cache with
        the misses the split gives the CPU computed by kt-kernel (--moe-backend hybrid; its copy of the bank
        and the split's costs are made at first use). The captured graphs keep reading what they were
        captured with: the stacks stay referenced here."""
        if mode == self.mode:
            return
        if mode == "hybrid" and self.hybrid is None:
            from dsv4serve.experts.attach import attach_cpu_experts

            self.hybrid = attach_cpu_experts(self.model, self.cache, self.device)
        for moe, (experts, stacks) in zip(self.moes, self.resident):
            moe.cpu_experts = self.hybrid if mode == "hybrid" else None
            if mode in ("slots", "hybrid", "staged"):
                moe.use_expert_cache(self.staged_cache() if mode == "staged" else self.cache)
            else:
                moe.expert_source = None
                moe.experts = experts
                for name, t in stacks.items():
                    setattr(moe, name, t)
        self.mode = mode

    def decode_graphs(self, mode: str):
        """The DecodeGraphs of this expert home (captured on CUDA, every bucket up to the row count)."""
        from dsv4serve.worker.graphs import DecodeGraphs

        if mode in self.graph_errors:  # one failed capture per home is enough to learn from
            raise RuntimeError(f"the {mode} decode graphs failed earlier: {self.graph_errors[mode]}")
        if mode not in self.graphs:
            self.use(mode)
            try:
                self.graphs[mode] = DecodeGraphs(
                    self.model,
                    self.pool,
                    self.num,
                    self.n_rows,
                    self.graph_len,
                    self.pool.num_slots - 1,
                    self.pool.num_pages - 1,
                    capture=self.device.type == "cuda",
                    expert_cache=self.cache_of(mode),
                )
            except Exception as exc:
                self.graph_errors[mode] = error_line(exc)
                raise
        return self.graphs[mode]

    def cache_of(self, mode: str):
        return self.staged_cache() if mode == "staged" else self.cache if mode in ("slots", "hybrid") else None

    def cut_check_line(self) -> str:
        """The worker's start-up check of a graph cut at the staging path (experts/cut_check.py), on the staged
        home's pageable layer."""
        from dsv4serve.experts.cut_check import check_cut_graph

        self.use("staged")
        cache = self.staged_cache()
        staged = cache.staged_layers
        if not staged:
            return "cut check: no staged layer (the CPU reads every bank layer in place)"
        moe = next(m for m in self.moes if m.layer_id == staged[0])
        why = check_cut_graph(moe, cache, self.num, self.device, self.args.dim, self.args.vocab_size)
        return f"cut check on layer {staged[0]}: {'passed' if why is None else why}"

    # ------------------------------------------------------------------ steps

    def _entries(self, n: int) -> list[tuple[int, int, int, list[int]]]:
        """(token, position, slot, pages) of rows 0..n-1: the pages their length + 1 needs, as a scheduler
        would have handed them out."""
        rows, page, out = self.rows, self.args.page_tokens, []
        for r in range(n):
            p = rows.pos[r]
            if p >= self.max_len:
                raise RuntimeError(f"row {r} holds {p} tokens, all its pages hold: raise EXTRA_TOKENS")
            out.append((rows.tokens[r][p], p, r, rows.pages[r][: p // page + 1]))
        return out

    def eager_step(self, n: int, static: bool = False) -> torch.Tensor:
        """What the runner does for a decode step under --enforce-eager -> logits [n, vocab] fp32; `static`: on
        the layout a replay runs (DecodeGraphs' block-table width and length bound), so the same kernels run
        on the same shapes as in the graph."""
        from dsv4serve.model.batch import build_layout

        tok, pos, slot, pages = zip(*self._entries(n))
        width, max_end = (self.pages_per_row, self.graph_len) if static else (None, None)
        layout = build_layout([[t] for t in tok], pos, slot, pages, self.device, width, max_end, self.staging)
        logits = self.model.run(layout, self.pool, self.num).last_logits
        self._advance(n)
        return logits

    def graph_step(self, mode: str, n: int, eager: bool = False) -> torch.Tensor:
        """One replay -> logits [n, vocab] fp32 (a view of the graph's output: the next replay overwrites it);
        `eager`: DecodeGraphs' eager form of the same step (hybrid: with the replay's CPU sets)."""
        logits = self.decode_graphs(mode).run(self._entries(n), eager=eager, same_split=eager)
        self._advance(n)
        return logits

    def _advance(self, n: int) -> None:
        for r in range(n):
            self.rows.pos[r] += 1

    def snapshot(self, n: int) -> None:
        """Copy rows 0..n-1's slots (window ring, compressor carry) aside; their pages need no copy: a step
        from the restored length rewrites every entry it reads past that length."""
        for r in range(n):
            self.pool.copy_slot(r, self.n_rows + r)
        self._saved = (n, self.rows.pos[:n])

    def restore(self) -> None:
        n, pos = self._saved
        for r in range(n):
            self.pool.copy_slot(self.n_rows + r, r)
        self.rows.pos[:n] = pos

    def cache_line(self, mode: str = "slots") -> str:
        cache = self.cache_of(mode)
        cache.collect_usage()
        s = cache.stats
        rate = f" ({100 * s.hits / s.queries:.0f}%)" if s.queries else ""
        return (
            f"slot cache so far: {s.hits} hits of {s.queries} expert uses{rate} (counts arrive a step or two "
            f"late), {s.prefetches} promoted, {s.stalls} stalls, {s.staged_layers} layers staged"
        )
