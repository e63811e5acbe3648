"""pdkv's OpenAI-compatible HTTP front end and Prometheus metrics.

A client of the prefill daemon's Unix socket (common.client), served by uvicorn + starlette: it adds
HTTP, OpenAI's request and response shapes, chat templates, stop strings and metrics; the daemons
do the rest. `api_server.server.run(cfg)` is the one entry point (the CLI's `pdkv api start`).
"""
