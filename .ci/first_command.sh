#!/usr/bin/env bash
# The README's first command ("Install and start the server"), verbatim, on a fresh copy of this checkout:
# serve dsv4-tiny on a free port (DSV4SERVE_PORT: every option has its variable), await /health, ask one
# chat completion (HTTP 200), stop the server by its pid. Prints the server's log on failure.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cmd="$(grep -m1 -E '^python3 -m venv \.venv && \. \.venv/bin/activate && pip install -e \. && dsv4serve --model dsv4-tiny$' "$repo/README.md")"
if [ -z "$cmd" ]; then
  echo "first command: not found in README.md"
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$repo" && tar --exclude=./.venv --exclude=./.git -cf - .) | tar -xf - -C "$work"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
echo "first command, in $work, port $port: $cmd"
cd "$work" || exit 1
# its own session and process group: the server, its worker and the venv's shell stop together
DSV4SERVE_PORT="$port" DSV4SERVE_CACHE_DIR="$work/cache" setsid bash -c "$cmd" >"$work/server.log" 2>&1 &
pid=$!
stop() { kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }
fail() { echo "first command: $1"; tail -n 60 "$work/server.log"; stop; exit 1; }
deadline=$((SECONDS + 900))  # the install (torch from the local wheel) plus the first build of dsv4-tiny
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 "$pid" 2>/dev/null || fail "the server exited before /health answered"
  [ "$SECONDS" -lt "$deadline" ] || fail "no /health within 900 s"
  sleep 2
done
status="$(curl -s -o "$work/reply.json" -w '%{http_code}' "http://127.0.0.1:$port/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{"model":"dsv4-tiny","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}')"
[ "$status" = "200" ] || fail "the chat completion answered $status: $(cat "$work/reply.json")"
echo "first command: /health ok, chat completion 200: $(head -c 300 "$work/reply.json")"
stop
echo "first command: the server stopped"
