#!/usr/bin/env bash
# Drive a real `dsv4serve --model dsv4-tiny` with NVIDIA's aiperf (a load generator no one here wrote)
# and print its summary. aiperf needs no torch, so it lives in its own venv.
#
#   bash bench/load_aiperf.sh [concurrency] [requests]      (defaults: 4 16)
#
# Notes: aiperf must load the tokenizer from the local dsv4-tiny folder in its online mode (with
# HF_HUB_OFFLINE=1 it treats a local path as a repo id); it makes no network request for a folder.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${1:-4}
REQUESTS=${2:-16}
PORT=${PORT:-8126}
CACHE=${DSV4SERVE_CACHE_DIR:-$HOME/.cache/dsv4serve}
OUT=${OUT:-$(mktemp -d)}
AIPERF_VENV=${AIPERF_VENV:-.aiperf-venv}
[ -x "$AIPERF_VENV/bin/aiperf" ] || { python3 -m venv "$AIPERF_VENV" && "$AIPERF_VENV/bin/pip" install -q aiperf==0.13.0; }
TINY=$(DSV4SERVE_CACHE_DIR="$CACHE" python3 -c "
from pathlib import Path; from dsv4serve.tiny.builder import ensure_tiny; print(ensure_tiny(Path('$CACHE')))")
DSV4SERVE_CACHE_DIR="$CACHE" dsv4serve --model dsv4-tiny --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done
"$AIPERF_VENV/bin/aiperf" profile --model dsv4-tiny --url "http://127.0.0.1:$PORT" --endpoint-type chat \
  --streaming --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --isl 32 --osl 8 \
  --tokenizer "$TINY" --artifact-dir "$OUT/aiperf" --ui-type simple > "$OUT/aiperf.log" 2>&1
python3 - "$OUT/aiperf/profile_export_aiperf.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{'metric':28s} {'avg':>10s} {'p50':>10s} {'p90':>10s}")
for key in ("time_to_first_token", "inter_token_latency", "request_latency"):
    m = d[key]
    print(f"{key + ' (' + m['unit'] + ')':28s} {m['avg']:10.1f} {m.get('p50', 0):10.1f} {m.get('p90', 0):10.1f}")
print(f"output tokens/s {d['output_token_throughput']['avg']:.2f}, requests/s {d['request_throughput']['avg']:.2f}, "
      f"requests {d['request_count']['avg']:.0f}, errors {(d.get('error_summary') or []) and len(d['error_summary']) or 0}")
PY
echo "artifacts: $OUT"
