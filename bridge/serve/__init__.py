"""`bridge serve`: an OpenAI-compatible HTTP server over one engine (vLLM's API and prompt_embeds format).

    bridge serve MODEL_OR_RUN_DIR [--host 127.0.0.1] [--port 8000] [--enable-prompt-embeds] ...

Modules: `protocol` (pydantic bodies), `app` (routes), `engine_loop` (the one task that steps the
engine), `generation` (one HTTP request's deltas -> responses / SSE), `inputs` (bodies -> prompts
and SamplingParams), `chat` (templates, media parts), `guards` (API key, body size), `metrics`
(Prometheus), `errors` (OpenAI-shaped errors), `server` (loading, flags, uvicorn). Needs the
`serve` extra (fastapi, uvicorn, prometheus-client); imported only by the `serve` command.
"""
