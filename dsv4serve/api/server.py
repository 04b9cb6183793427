"""`dsv4serve serve`: start the worker, report what it allocated, serve the API with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import sys

from dsv4serve.api.tokenizer import tokenizer_file
from dsv4serve.config import ServeConfig, Setting, default_max_request_bytes
from dsv4serve.ipc.messages import Ready, Sourced, WorkerLaunch

log = logging.getLogger("dsv4serve")


def worker_launch(cfg: ServeConfig, model_path) -> WorkerLaunch:
    """The worker's copy of the frozen config: every setting with its source (ipc.messages.Sourced)."""

    def wire(setting: Setting) -> Sourced:
        return Sourced(setting.value, setting.source.value)

    return WorkerLaunch(
        to_worker="",
        from_worker="",
        model_path=str(model_path),
        device=cfg.device.value,
        max_num_seqs=wire(cfg.max_num_seqs),
        max_queued_requests=wire(cfg.max_queued_requests),
        max_model_len=wire(cfg.max_model_len),
        max_prefill_length=wire(cfg.max_prefill_length),
        num_tokens=wire(cfg.num_tokens),
        moe_cache_size=wire(cfg.moe_cache_size),
        memory_ratio=wire(cfg.memory_ratio),
        kernels=wire(cfg.kernels),
        batch_invariant=wire(cfg.batch_invariant),
        enforce_eager=wire(cfg.enforce_eager),
        moe_backend=wire(cfg.moe_backend),
        speculative_tokens=wire(cfg.speculative_tokens),
        tensor_parallel_size=wire(cfg.tensor_parallel_size),
        expert_parallel=wire(cfg.expert_parallel),
        log_level=cfg.log_level.value,
        tokenizer_path=str(tokenizer_file(model_path)),
    )


def request_bytes_limit(cfg: ServeConfig, ready: Ready) -> int:
    """--max-request-bytes, or its default from the max_model_len the worker allocated."""
    return cfg.max_request_bytes.value or default_max_request_bytes(ready.max_model_len)


def _limit_source(cfg: ServeConfig) -> str:
    if cfg.max_request_bytes.value:
        return f"--max-request-bytes, {cfg.max_request_bytes.source.value}"
    return "default: 4 MiB + 48 bytes x max_model_len"


def format_ready(ready: Ready) -> str:
    chunk = ready.chunk
    requested = "auto" if chunk.requested is None else str(chunk.requested)
    slots = "all resident" if ready.expert_slots is None else str(ready.expert_slots)
    lines = [
        "worker ready (what was allocated)",
        f"  device                 {ready.device}",
        f"  KV capacity            {ready.kv_capacity_tokens} tokens ({ready.kv_pages} pages of "
        f"{ready.page_tokens} tokens, {ready.sequence_slots} sequence slots)",
        f"  max running requests   {ready.max_running_requests}",
        f"  max model len          {ready.max_model_len} tokens",
        f"  expert slots           {slots}",
        *([f"  decode graphs          {ready.decode_graphs}"] if ready.decode_graphs else []),
        *([f"  expert bank            {ready.expert_bank}"] if ready.expert_bank else []),
        *[f"  tensor parallel        {line}" for line in ready.ranks],
        f"  prefill chunk          requested {requested}, effective {chunk.effective_tokens} tokens, "
        f"bound by {chunk.binding}: {chunk.reason}",
    ]
    if chunk.warning:
        lines.append(f"  warning                {chunk.warning}")
    return "\n".join(lines)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, plus: on Ctrl-C / SIGTERM the running requests are aborted first, so
        their clients get finish_reason "abort" and [DONE] within the graceful-shutdown time."""

        def __init__(self, config, on_exit):
            super().__init__(config)
            self._on_exit = on_exit
            self._loop = asyncio.get_running_loop()

        def handle_exit(self, sig, frame) -> None:
            self._loop.call_soon_threadsafe(self._on_exit)
            super().handle_exit(sig, frame)

    return Server


async def _serve_async(cfg: ServeConfig, model_path) -> int:
    import uvicorn

    from dsv4serve.api.app import ServeOptions, create_app
    from dsv4serve.api.tokenizer import TextTokenizer
    from dsv4serve.supervisor import EngineClient, EngineUnavailable

    tokenizer = TextTokenizer.for_model(model_path)
    engine = EngineClient(worker_launch(cfg, model_path))
    try:
        try:
            ready = await engine.start()
        except EngineUnavailable as exc:
            print(f"dsv4serve: error: {exc}", file=sys.stderr)
            return 1
        print(format_ready(ready), file=sys.stderr, flush=True)
        options = ServeOptions(
            cfg.served_model_name.value,
            cfg.default_thinking.value,
            cfg.api_key.value,
            request_bytes_limit(cfg, ready),
        )
        print(f"  max request bytes      {options.max_request_bytes} ({_limit_source(cfg)})", file=sys.stderr)
        app = create_app(engine, tokenizer, options)
        config = uvicorn.Config(
            app, host=cfg.host.value, port=cfg.port.value, log_level=cfg.log_level.value, timeout_graceful_shutdown=5
        )
        log.info("serving %s on http://%s:%s", options.served_model_name, cfg.host.value, cfg.port.value)
        await _server_class()(config, app.state.dsv4.abort_all).serve()
        return 0
    finally:
        await _shutdown(engine)


async def _shutdown(engine) -> None:
    """Stop the worker even when Ctrl-C cancelled this task (uvicorn re-raises SIGINT on exit):
    the cancellation is taken once by the shield, then the shutdown is awaited to its end."""
    done = asyncio.ensure_future(engine.shutdown())
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        await done
    log.info("the worker was shut down")


def serve(cfg: ServeConfig, model_path) -> int:
    try:
        return asyncio.run(_serve_async(cfg, model_path))
    except KeyboardInterrupt:
        return 130
