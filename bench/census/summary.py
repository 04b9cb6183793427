"""A step census in numbers: per layer, per layer kind, per step, and projected to another config.

    s = summarize(census, tiny_args)      # a JSON-ready dict
    p = project(s, real_args)             # the same step on DeepSeek-V4-Flash's layers
    compare_steps(census_a, census_b)     # do two decode steps issue the same op sequence (CUDA graphs)?

Projection: each layer of the target config takes the mean per-layer counts of the census's layers of
the same class (kind: swa = sliding window only, csa, hca; and routing: hash or gate), or of the same
kind when no layer has that class; the per-step parts (outside the layers: embedding, head, sampler,
runner, the slot cache's step boundary) are added once. Grids and widths differ at the real size; the
number of launches and syncs does not, as long as no count depends on a dimension (per-row or
per-expert loops do depend on the batch and the routing: compare censuses at several batch sizes).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from difflib import SequenceMatcher
from statistics import mean

from bench.census.counter import Launch, Seen, fingerprint
from bench.census.steps import StepCensus
from dsv4serve.model.args import ModelArgs

# per-step components outside the model's forward: what a CUDA graph of the forward leaves around its replay
OUTSIDE_FORWARD = {"sampler", "runner/metadata", "slot cache boundary", "other"}


def layer_class(args: ModelArgs, layer: int) -> tuple[str, str]:
    return args.kind(layer), "hash" if args.is_hash_layer(layer) else "gate"


def _part(launches: list[Launch], syncs: int) -> dict:
    return {
        "launches": len(launches),
        "aten": sum(1 for x in launches if x.kind == "aten"),
        "triton": sum(1 for x in launches if x.kind == "triton"),
        "syncs": syncs,
        "components": dict(Counter(x.component for x in launches).most_common()),
    }


def summarize(census: StepCensus, args: ModelArgs) -> dict:
    seen = census.seen
    by_layer: dict[int | None, list[Launch]] = defaultdict(list)
    for launch in seen.launches:
        by_layer[launch.layer].append(launch)
    syncs_by_layer = Counter(s.layer for s in seen.syncs)
    layers = []
    for i in range(args.n_layers):
        kind, routing = layer_class(args, i)
        layers.append({"layer": i, "kind": kind, "routing": routing, **_part(by_layer[i], syncs_by_layer[i])})
    per_kind = {}
    for kind in ("swa", "csa", "hca"):
        rows = [x for x in layers if x["kind"] == kind]
        if rows:
            per_kind[kind] = {
                "layers": len(rows),
                "launches_per_layer": mean(x["launches"] for x in rows),
                "syncs_per_layer": mean(x["syncs"] for x in rows),
                "components": dict(sum((Counter(x["components"]) for x in rows), Counter()).most_common()),
            }
    sites = Counter((s.site, s.what) for s in seen.syncs)
    outside = [x for x in by_layer[None] if x.component in OUTSIDE_FORWARD]
    outside_syncs = sum(1 for s in seen.syncs if s.layer is None and s.component in OUTSIDE_FORWARD)
    return {
        "phase": census.phase,
        "rows": census.num_rows,
        "tokens": census.num_tokens,
        "start_positions": census.start_positions,
        "wall_s": round(census.wall_s, 2),
        "total": {
            **_part(seen.launches, len(seen.syncs)),
            "host_ops": len(seen.host_ops),
            "host_tensors": len(seen.host_tensors),
        },
        "per_step": _part(by_layer[None], syncs_by_layer[None]),
        "outside_forward": _part(outside, outside_syncs),
        "layers": layers,
        "per_kind": per_kind,
        "sync_sites": [{"site": site, "what": what, "count": n} for (site, what), n in sites.most_common()],
        "sync_components": dict(Counter(s.component for s in seen.syncs).most_common()),
        "triton_kernels": dict(Counter(x.name for x in seen.launches if x.kind == "triton").most_common()),
        "fingerprint": fingerprint(seen)[1],
        "collectives": _collectives(census, args),
    }


PER_STEP_COLLECTIVES = ("embedding", "logits")  # outside the layers (model/transformer.py's `what` names)


def _collectives(census: StepCensus, args: ModelArgs) -> dict:
    """A tensor-parallel rank's collectives of the step: calls and operand bytes, per step and per layer."""
    calls = census.collectives
    per_step = [c for c in calls if c.what.startswith(PER_STEP_COLLECTIVES)]
    return {
        "calls": len(calls),
        "bytes": sum(c.message_bytes for c in calls),
        "per_step_calls": len(per_step),
        "per_layer_calls": (len(calls) - len(per_step)) / args.n_layers,
        "by_what": dict(Counter(c.what for c in calls).most_common()),
    }


def project(summary: dict, target: ModelArgs) -> dict:
    """The summary's step on `target`'s layers (module doc)."""
    by_class: dict[tuple[str, str], list[dict]] = defaultdict(list)
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for row in summary["layers"]:
        by_class[(row["kind"], row["routing"])].append(row)
        by_kind[row["kind"]].append(row)
    launches = float(summary["per_step"]["launches"])
    syncs = float(summary["per_step"]["syncs"])
    kinds: Counter = Counter()
    for i in range(target.n_layers):
        cls = layer_class(target, i)
        rows = by_class.get(cls) or by_kind.get(cls[0])
        if not rows:
            raise ValueError(f"layer {i} of the target is {cls[0]}; the census has no layer of that kind")
        kinds[cls[0]] += 1
        launches += mean(r["launches"] for r in rows)
        syncs += mean(r["syncs"] for r in rows)
    c = summary["collectives"]
    collectives = round(c["per_step_calls"] + c["per_layer_calls"] * target.n_layers)
    return {"layers": dict(kinds), "launches": round(launches), "syncs": round(syncs), "collectives": collectives}


def _forward(seen: Seen) -> Seen:
    """The launches of the model's forward only (what a CUDA graph of it would hold)."""
    inside = [x for x in seen.launches if x.layer is not None or x.component not in OUTSIDE_FORWARD]
    return Seen(launches=inside)


def compare_steps(a: Seen, b: Seen, shown: int = 5) -> dict:
    """Whether two steps issued the same (op, input shapes, grid) sequence (`static`; `forward_static`: the
    model's forward alone); where not, the blocks that differ (difflib opcodes: replaced, inserted or deleted
    entries, with the first site of each); plus the Triton launch sites whose scalar arguments changed (a
    CUDA graph replays the values it captured)."""
    fa, ha = fingerprint(a)
    fb, hb = fingerprint(b)
    opcodes = SequenceMatcher(None, fa, fb, autojunk=False).get_opcodes()
    blocks = [op for op in opcodes if op[0] != "equal"]
    first = []
    for tag, i0, i1, j0, j1 in blocks[:shown]:
        site = a.launches[i0].site if i1 > i0 else b.launches[j0].site
        example = [repr(fa[i0]) if i1 > i0 else "-", repr(fb[j0]) if j1 > j0 else "-"]
        first.append({"change": tag, "entries": [i1 - i0, j1 - j0], "site": site, "a": example[0], "b": example[1]})
    matched = []  # launch pairs of the blocks that are equal
    for tag, i0, i1, j0, _ in opcodes:
        if tag == "equal":
            matched += [(a.launches[i0 + k], b.launches[j0 + k]) for k in range(i1 - i0)]
    scalars = Counter(x.site for x, y in matched if x.kind == "triton" and x.scalars != y.scalars)
    return {
        "static": ha == hb,
        "forward_static": fingerprint(_forward(a))[1] == fingerprint(_forward(b))[1],
        "hashes": [ha, hb],
        "lengths": [len(fa), len(fb)],
        "differing_entries": sum(max(i1 - i0, j1 - j0) for _, i0, i1, j0, j1 in blocks),
        "blocks": len(blocks),
        "first_differences": first,
        "triton_scalar_changes": dict(scalars.most_common()),
    }
