"""Where a launch or sync belongs: its transformer layer and a component, read from the Python stack.

    locate = Attributor(model)          # a counter.Locate
    site, layer, component = locate(frame)

The stack says it all: the innermost frame whose `self` is one of the model's modules names the
sub-module at work ("layers.3.attn.indexer.compressor"), including methods that forward hooks would
miss (`Compressor.project`, `update_decode` and `Indexer.queries` are called directly, not through
`forward`); the files and functions of the project frames name the rest (hc.py's functions, the
sampler, the runner, the expert-slot cache). Layer = the `layers.N` of that module path.

Components: inside a layer "mhc", "norms", "attention projections" (wq_a, wq_b, wkv, wo_a / wo_b, RoPE,
the q scale and the KV FP8 simulation), "compressor", "indexer", "attention core", "moe router",
"moe align", "moe experts", "moe slot cache" (the cache's per-layer sources), "shared expert",
"other"; per step (no layer): "embed", "model glue" (Transformer.run's own ops), "head" (HC head, final
norm, logits), "sampler", "runner/metadata", "slot cache boundary" (usage harvest and promotions,
run once per step inside the first MoE layer), "other". HOST marks ops on host-side tensors (the slot
cache's bookkeeping, the decode bucket's host buffer): the counter counts them as neither launches nor syncs.
"""

from __future__ import annotations

import re
from types import FrameType

from torch import nn

from bench.census.counter import HOST, PROJECT_ROOTS, REPO, site_of

# (file, function) whose own torch ops work on host tensors: the slot cache's scores, maps and counters
HOST_CODE = {
    ("dsv4serve/experts/residency.py", "*"),
    ("dsv4serve/experts/transfers.py", "_take"),
    ("dsv4serve/experts/slot_cache.py", "_account"),
    ("dsv4serve/experts/slot_cache.py", "_promote"),
    ("dsv4serve/experts/slot_cache.py", "resident"),
    ("dsv4serve/experts/staging.py", "layer_parts"),
    ("dsv4serve/worker/graphs.py", "_fill"),  # the bucket's pinned host buffer (its device copy: CUDA only)
    ("dsv4serve/worker/spec_graphs.py", "fill"),  # the same for the speculative buckets
}
BOUNDARY = {"_boundary", "begin_step", "collect_usage"}  # slot_cache.py: once per step
CORE = {"_attend_kernel", "_attend_row", "_store_window", "sparse_attention"}  # attention.py
PER_STEP = {HOST, "sampler", "slot cache boundary"}  # run once per step, whichever layer calls them
_LAYER = re.compile(r"^layers\.(\d+)(\.|$)")
_PREFIX = len(str(REPO)) + 1


class Attributor:
    def __init__(self, model: nn.Module, roots: tuple[str, ...] = PROJECT_ROOTS):
        self.roots = roots
        self.names = {id(m): name for name, m in model.named_modules()}

    def __call__(self, frame: FrameType | None) -> tuple[str, int | None, str]:
        site, module, files = None, None, []
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(self.roots):
                site = site or frame
                files.append((code.co_filename[_PREFIX:], code.co_name))
                if module is None and code.co_argcount and code.co_varnames[0] == "self":
                    module = self.names.get(id(frame.f_locals.get("self")))
            frame = frame.f_back
        match = _LAYER.match(module or "")
        layer = int(match.group(1)) if match else None
        comp = component(module, files, layer)
        if comp in PER_STEP:
            layer = None
        return site_of(site), layer, comp


def component(module: str | None, files: list[tuple[str, str]], layer: int | None) -> str:
    """The component of an op from its innermost model module and its project frames (innermost first)."""
    if files and ((files[0][0], "*") in HOST_CODE or files[0] in HOST_CODE):
        return HOST
    paths = {path for path, _ in files}
    if any(path.endswith("experts/slot_cache.py") and func in BOUNDARY for path, func in files):
        return "slot cache boundary"
    if "dsv4serve/worker/sampling.py" in paths:
        return "sampler"
    if layer is None:
        return _per_step(module, files, paths)
    mod = module or ""
    if any(path.startswith("dsv4serve/experts/") for path in paths):
        return "moe slot cache"
    if "kernels/dsv4_kernels/moe_align.py" in paths:
        return "moe align"
    if ".indexer" in mod or ("dsv4serve/model/attention.py", "_select") in files:
        return "indexer"
    for part, name in ((".compressor", "compressor"), ("shared_experts", "shared expert")):
        if part in mod:
            return name
    for suffix, name in ((".gate", "moe router"), (".ffn", "moe experts"), ("norm", "norms")):
        if mod.endswith(suffix):
            return name
    if "dsv4serve/model/hc.py" in paths:
        return "mhc"
    if "dsv4serve/model/attention_decode.py" in paths or any(
        path == "dsv4serve/model/attention.py" and func in CORE for path, func in files
    ):
        return "attention core"
    if ".attn" in mod:
        return "attention projections"
    return "other"


def _per_step(module: str | None, files: list[tuple[str, str]], paths: set[str]) -> str:
    if module == "embed":
        return "embed"
    if module in ("head", "norm") or ("dsv4serve/model/transformer.py", "logits") in files:
        return "head"
    if module == "":  # the Transformer itself
        return "model glue"
    if paths & {"dsv4serve/worker/runner.py", "dsv4serve/model/batch.py", "dsv4serve/model/kv_pool.py"}:
        return "runner/metadata"
    return "other"
