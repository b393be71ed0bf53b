"""``k3serve serve``: build the engine (layout checked before weights load), the app, and run uvicorn."""

from __future__ import annotations

import argparse
import logging

from ..bundled import resolve_model

log = logging.getLogger(__name__)


def build_state(args: argparse.Namespace):
    from ..cli import engine_from_args
    from ..engine.async_engine import AsyncLLM
    from .api import ServerState

    engine = engine_from_args(args)
    grammar = None
    if engine.tokenizer is not None and not args.no_structured_output:
        try:
            from .grammar import GrammarBackend
        except ImportError as exc:  # xgrammar missing: serve without structured output
            log.warning("structured output disabled: %s", exc)
        else:
            from .tool_grammar import K3_MARKERS

            markers = tuple(i for m in K3_MARKERS if (i := engine.tokenizer.special_tokens.get(m)) is not None)
            grammar = GrammarBackend(engine.tokenizer, engine.model.config.vocab_size, marker_ids=markers)
    name = args.served_model_name or args.preset or resolve_model(args.model).name
    return ServerState(AsyncLLM(engine, args.max_queue), name, args.api_key, args.reasoning_parser,
                       args.tool_call_parser, grammar)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api import build_app

    state = build_state(args)
    app = build_app(state)

    @app.on_event("shutdown")
    def _stop() -> None:  # SIGTERM: uvicorn stops accepting, then in-flight requests are aborted cleanly
        state.llm.shutdown()

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
