"""The deployment files, checked without a Docker engine (CI has none).

hadolint lints the Dockerfile; the compose file is validated against the compose-spec JSON schema
(the copy vendored in check-jsonschema, `vendor.compose-spec`); and the three files are checked
against each other and against the server: the env names exist, the health check script the
compose file calls is the one the image copies, every COPY source survives .dockerignore.
"""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from dsv4serve.config import options
from dsv4serve.env import PREFIX, option_env_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
# The CUDA build of PyPI's default Linux torch wheel, read from its metadata (torch 2.13.0 requires
# cuda-toolkit==13.0.3): bumping the torch pin means checking this and the base image again.
TORCH_CUDA = {"2.13.0": "13.0"}
KNOWN_ENV = {option_env_name(o) for o in options()} | {PREFIX + "CACHE_DIR"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in steps:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    return env


def compose_default(value: str) -> str:
    """What compose makes of ${VAR:-default} when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_dockerfile_passes_hadolint():
    out = subprocess.run(
        ["hadolint", "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_file_matches_the_compose_spec():
    out = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_image_matches_the_cuda_build_of_the_pinned_torch():
    pin = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text(encoding="utf-8")).group(1)
    base = re.search(
        r"ARG CUDA_IMAGE=nvidia/cuda:(\d+\.\d+)\.\d+-\w+-ubuntu[\d.]+", DOCKERFILE.read_text(encoding="utf-8")
    )
    assert base, "the base image must be a pinned nvidia/cuda:X.Y.Z-<flavour>-ubuntuNN.NN tag"
    assert base.group(1) == TORCH_CUDA[pin]


def test_image_runs_dsv4serve_as_a_non_root_user_reachable_on_its_port():
    steps = final_stage()
    words = dict(steps)  # the last of each instruction in the runtime stage
    env = env_of(steps)
    assert words["ENTRYPOINT"] == '["dsv4serve"]'
    assert words["USER"].split(":")[0] not in ("root", "0")
    assert env["DSV4SERVE_HOST"] == "0.0.0.0"  # a container must listen on its own interfaces
    assert words["EXPOSE"] == env["DSV4SERVE_PORT"]
    assert "healthcheck.py" in words["HEALTHCHECK"]
    volumes = words["VOLUME"]
    assert env["HF_HOME"] in volumes and "/models" in volumes
    unknown = {k for k in env if k.startswith(PREFIX)} - KNOWN_ENV
    assert not unknown, f"the server reads no such variable: {unknown}"


def test_compose_binds_localhost_reserves_gpus_and_shares_the_image_paths():
    service = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]["dsv4serve"]
    env = env_of(final_stage())
    host_ip, _, container_port = compose_default(service["ports"][0]).rpartition(":")
    assert host_ip.split(":")[0] == "127.0.0.1" and container_port == env["DSV4SERVE_PORT"]
    device = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert compose_default(device["device_ids"][0]) == "all"
    assert service.get("ipc") == "host" or int(service["shm_size"].rstrip("gb")) >= 1
    targets = [compose_default(v).split(":")[1] for v in service["volumes"]]
    assert env["HF_HOME"] in targets
    assert service["environment"]["DSV4SERVE_API_KEY"].startswith("${DSV4SERVE_API_KEY")
    assert not {k for k in service["environment"] if k.startswith(PREFIX)} - KNOWN_ENV
    image_copies = [rest.split()[-1] for word, rest in final_stage() if word == "COPY"]
    assert service["healthcheck"]["test"][-1] in image_copies
    assert service["restart"] in ("always", "unless-stopped", "on-failure")


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore glob as a regex: `*` stays inside one path segment, a leading `**/` spans any."""
    body = re.escape(pattern.rstrip("/")).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
    return re.compile(body.replace(r"\?", "[^/]") + "$")


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        regex = _glob_regex(pattern.removeprefix("!"))
        if any(regex.match(c) for c in candidates):
            ignored = not pattern.startswith("!")
    return ignored


def test_every_copy_source_reaches_the_builder_and_nothing_else_does():
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    sources = [
        src
        for word, rest in dockerfile_instructions()
        if word == "COPY" and "--from" not in rest
        for src in rest.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert not _ignored(src.rstrip("/"), patterns), f"{src} is excluded by .dockerignore"
    assert not _ignored("dsv4serve/cli.py", patterns)
    for junk in (".git/config", "tests/conftest.py", ".venv/bin/python", "dsv4serve/__pycache__/cli.pyc"):
        assert _ignored(junk, patterns), junk


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, expected", [(200, 0), (503, 1)])
def test_healthcheck_script_follows_health(status, expected):
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"DSV4SERVE_PORT": str(server.server_address[1]), "PATH": ""}
        out = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == expected, out.stderr


def test_healthcheck_script_fails_when_nothing_listens():
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health) as server:
        port = server.server_address[1]  # bound, then closed: nothing listens there afterwards
    out = subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env={"DSV4SERVE_PORT": str(port)}, capture_output=True, timeout=30
    )
    assert out.returncode == 1
