"""Communication per decode step of DeepSeek-V4-Flash over 2 / 4 / 8 GPUs, projected (no GPU needed).

    python bench/bench_comm_volume.py [--config-dir tests/data/DeepSeek-V4-Flash]

Prints, per layout (tensor-parallel attention with experts split or owned; data-parallel attention with
expert parallelism), GPU count and batch: the collectives per step, the bytes of one (all-reduce operand or a
rank's dispatch), the bytes the busiest rank sends per step, and the time at NVLink 4 with an eager and a
graph-captured cost per collective. The model and its sources: dsv4serve/parallel/comm_volume.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4serve.model.args import read_model_args
from dsv4serve.parallel.comm_volume import NVLINK4_EAGER, NVLINK4_GRAPHED, Layout, decode_collectives, step_comm
from dsv4serve.report import format_table

REPO = Path(__file__).resolve().parents[1]
LAYOUTS: tuple[tuple[Layout, bool, str], ...] = (
    ("tp", True, "TP attention (+EP or TP experts)"),
    ("dp_ep", True, "DP attention + EP, all-to-all"),
    ("dp_ep", False, "DP attention + EP, all-gather + reduce-scatter"),
)


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def rows(config_dir: Path) -> list[dict[str, str]]:
    args = read_model_args(config_dir)
    out = []
    for layout, a2a, label in LAYOUTS:
        for gpus in (2, 4, 8):
            for batch in (1, 8, 64):
                colls = decode_collectives(args, batch, gpus, layout, all_to_all=a2a)
                eager, graphed = step_comm(colls, NVLINK4_EAGER), step_comm(colls, NVLINK4_GRAPHED)
                out.append(
                    {
                        "layout": label,
                        "gpus": str(gpus),
                        "batch": str(batch),
                        "calls/step": str(eager.calls),
                        "KiB/call": _kib(colls[0].message_bytes),
                        "KiB sent/step": _kib(eager.sent_bytes),
                        "ms eager": f"{eager.seconds * 1e3:.2f}",
                        "ms graphed": f"{graphed.seconds * 1e3:.2f}",
                        "latency share": f"{eager.latency_seconds / eager.seconds:.0%}",
                    }
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config-dir", type=Path, default=REPO / "tests" / "data" / "DeepSeek-V4-Flash")
    ns = p.parse_args()
    print(f"links: {NVLINK4_EAGER.source}; {NVLINK4_GRAPHED.source}")
    print("KiB/call: an all-reduce's [batch, 4096] bf16 operand, or the busiest rank's dispatch payload")
    cols = ("layout", "gpus", "batch", "calls/step", "KiB/call", "KiB sent/step", "ms eager", "ms graphed")
    print(format_table(rows(ns.config_dir), (*cols, "latency share")))


if __name__ == "__main__":
    main()
