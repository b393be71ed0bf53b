"""``k3serve serve``: check the layout (before any weight loads), start the engine process, build
the app, and run uvicorn in this process."""

from __future__ import annotations

import argparse
import gc
import logging

from ..bundled import resolve_model

log = logging.getLogger(__name__)


def build_state(args: argparse.Namespace):
    from ..cli import engine_config_from_args
    from ..engine.async_engine import AsyncLLM
    from ..engine.engine import tokenizer_or_none, validate_startup
    from ..engine.sampling_params import generation_defaults
    from .api import ServerState

    model = None if args.preset else resolve_model(args.model)
    # Refused here, before the engine process starts (it checks again, with the GPU's memory).
    validate_startup(model, args.preset, engine_config_from_args(args), args.device, check_memory=False,
                     quantization=args.quantization)
    defaults = generation_defaults(model, args.generation_config, args.override_generation_config)
    if defaults:
        log.warning("omitted sampling settings default to the model's generation config (--generation-config "
                    "vllm: none): %s", defaults)
    llm = AsyncLLM.start(args, args.max_queue)
    name = args.served_model_name or args.preset or model.name
    return ServerState(llm, name, tokenizer_or_none(model), args.api_key, args.reasoning_parser,
                       args.tool_call_parser, args.tool_call_text_limit, args.return_tokens_as_token_ids, defaults)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api import build_app

    state = build_state(args)
    app = build_app(state)

    @app.on_event("shutdown")
    def _stop() -> None:  # SIGTERM: uvicorn stops accepting, then in-flight requests are aborted cleanly
        state.llm.shutdown()

    # Startup's ~200K objects (FastAPI, pydantic, the tokenizer's tables) live as long as the process:
    # out of the collector's reach, a full collection no longer scans them mid-stream (RESULTS,
    # thirty-seventh session: the server's CPU a streamed token, median of 5 medians 85 -> 81 us,
    # its worst runs 105-122 -> 81-98 us).
    gc.freeze()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        gc.unfreeze()
        state.llm.shutdown()
    return 0
