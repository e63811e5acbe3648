"""The starlette application: routes, the API key check, and the daemons' health.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions
(the API key guards these when one is set), GET /health, GET /metrics (open, for probes and
scrapers). Every error, an unknown path (404) or method (405) included, is OpenAI's error JSON.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_server import generation, responses, schemas, structured, workers
from api_server.chat import TemplateError
from api_server.config import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    DISCARD_BYTES,
    MAX_BODY_BYTES,
    ApiConfig,
)
from api_server.daemons import Daemons
from api_server.errors import ApiError, bad_field, model_not_found, too_large
from api_server.logprobs import Echo, LogprobFormat
from api_server.metrics import CONTENT_TYPE, Metrics
from api_server.model import ServedModel
from api_server.prompts import Prompt, check_context, prompts_of
from api_server.sse import json_response
from api_server.tools.assembler import ToolAssembler
from api_server.tools.history import template_messages
from api_server.tools.plan import constrained, plan
from api_server.tools.spec import tool_request
from common.health import link_problem
from common.protocol import StatusReply

log = structlog.get_logger(__name__)
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


class Api:
    """One API server's state: its config, the daemons it fronts, and its metrics."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.daemons = Daemons(cfg)
        self.metrics = Metrics(cfg.instance_name, shared=workers.metrics_dir())
        self.created = workers.created() or int(time.time())  # one for every worker
        self._key = cfg.api_key.encode() if cfg.api_key else None

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._guard("models", self.models), methods=["GET"]),
                Route(
                    "/v1/models/{model_id:path}",
                    self._guard("models", self.model),
                    methods=["GET"],
                ),
                Route(
                    "/v1/completions",
                    self._guard("completions", self.completions),
                    methods=["POST"],
                ),
                Route("/v1/chat/completions", self._guard("chat", self.chat), methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},
        )

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """404 and 405 (no such route or method) as OpenAI's error JSON."""
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, message, code=code, headers=exc.headers).response()

    def _guard(
        self, endpoint: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """`handler` behind the API key, with its ApiErrors answered and counted."""

        async def guarded(request: Request) -> Response:
            try:
                self._authorize(request)
                return await handler(request)
            except ApiError as exc:
                if endpoint != "models":
                    self.metrics.finished(endpoint, exc.outcome)
                if exc.status >= 500:
                    log.warning(
                        "request_failed", endpoint=endpoint, status=exc.status, error=exc.message
                    )
                return exc.response()

        return guarded

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )

    async def models(self, request: Request) -> Response:
        """The daemons' model; none while they were never reached."""
        try:
            model: ServedModel | None = await self.daemons.learn()
        except ApiError:
            model = self.daemons.model
        data = [model.listing(self.created)] if model is not None else []
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model_id"]
        try:
            model = await self.daemons.learn()
        except ApiError:
            last = self.daemons.model
            if last is None:
                raise
            model = last
        if wanted != model.id:
            raise model_not_found(wanted, model.id)
        return json_response(model.listing(self.created))

    async def _served(self, req: schemas.CompletionRequest | schemas.ChatRequest) -> ServedModel:
        """The model for `req` once the daemons can serve it; 404 when `req` names another."""
        model = await self.daemons.ready()
        if req.model != model.id:
            raise model_not_found(req.model, model.id)
        return model

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        req = schemas.decode(schemas.CompletionRequest, await read_body(request))
        prompts = prompts_of(req.prompt)
        params = schemas.sampling(
            req, max_tokens=req.max_tokens, default_max=COMPLETION_DEFAULT_MAX_TOKENS
        )
        stops = schemas.stop_strings(req)
        model = await self._served(req)
        check_context(prompts, params.max_tokens, model.max_positions, "max_tokens")
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        jobs = generation.jobs(rid, prompts, params, req.n or 1, stops=stops, stream=req.stream)
        echoes = None
        if req.echo:
            echoes = [Echo.of(model.counter, j.prompt, j.prompt_tokens) for j in jobs]
        shape = responses.Shape(endpoint="completions", chat=False)
        return await self._respond(rid, jobs, req, shape, started, model, echoes)

    async def chat(self, request: Request) -> Response:
        started = time.perf_counter()
        req = schemas.decode(schemas.ChatRequest, await read_body(request))
        if not req.messages:
            raise bad_field("messages", "messages must hold at least one message")
        messages = template_messages(req.messages)
        tool_req = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        params = schemas.sampling(req, max_tokens=max_tokens, default_max=CHAT_DEFAULT_MAX_TOKENS)
        stops = schemas.stop_strings(req)
        model = await self._served(req)
        tools = plan(tool_req, messages, model.template.source, self.cfg.tool_parser, model.counter)
        params = constrained(params, tools, structured.source_field(req))
        try:
            prompt, prompt_tokens = model.template.prompt(messages, tools.template_tools)
        except TemplateError as exc:
            raise bad_field("messages", str(exc)) from None
        check_context(
            [Prompt(text=prompt, tokens=prompt_tokens)],
            params.max_tokens,
            model.max_positions,
            limit,
        )
        if tool_req.tools:
            self.metrics.tool_requests.labels(tool_req.choice).inc()
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        jobs = generation.jobs(
            rid,
            [Prompt(text=prompt, tokens=prompt_tokens)],
            params,
            req.n or 1,
            stops=stops,
            stream=req.stream,
            max_tokens_param=limit,
            markers=tools.markers,
        )
        shape = responses.Shape(endpoint="chat", chat=True)
        return await self._respond(rid, jobs, req, shape, started, model, tools=tools.assembler)

    async def _respond(
        self,
        rid: str,
        jobs: list[generation.Job],
        req: schemas.CompletionRequest | schemas.ChatRequest,
        shape: responses.Shape,
        started: float,
        model: ServedModel,
        echoes: list[Echo] | None = None,
        tools: Callable[[], ToolAssembler | None] | None = None,
    ) -> Response:
        reply = responses.Reply(
            id=rid,
            model=model.id,
            shape=shape,
            started=started,
            created=int(time.time()),
            choices=len(jobs),
            n=req.n or 1,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            fmt=None if jobs[0].sampling.logprobs is None else LogprobFormat(model.counter),
            echoes=echoes,
            tools=tools,
        )
        if (constraint := jobs[0].sampling.structured) is not None:  # a 400 before any daemon
            where = structured.source_field(req)
            await structured.check(constraint, model.card.path, self.metrics, where)
        prefill = self.daemons.route(jobs[0].prompt_tokens, jobs[0].prompt)
        events = generation.run_all(
            jobs,
            conn=prefill.conn,
            timeout=self.cfg.request_timeout_s,
            retry_after=self.cfg.retry_after_s,
            metrics=self.metrics,
            counter=model.counter,
        )
        events = self.daemons.counted(prefill, events)
        if req.stream:
            return await responses.streamed(reply, events, self.metrics)
        return await responses.whole(reply, events, self.metrics)

    async def daemon_statuses(self) -> dict[str, StatusReply | str]:
        """Each daemon's STATUS_REPLY, or why it did not answer; the metrics see them too."""
        statuses = await self.daemons.statuses()
        for role, answer in statuses.items():
            status = answer if isinstance(answer, StatusReply) else None
            self.metrics.daemons.statuses[role] = status
        self.metrics.daemons.statuses.update(await self.daemons.further_decodes(statuses))
        return statuses

    async def health(self, request: Request) -> Response:
        """200 while a prefill can serve (with the reasons of those that cannot, "degraded"
        with several prefills), 503 with every reason otherwise."""
        statuses = await self.daemon_statuses()
        reasons = [s for s in statuses.values() if isinstance(s, str)]
        serving = 0
        for role, st in statuses.items():
            if not role.startswith("prefill") or not isinstance(st, StatusReply):
                continue
            if why := link_problem(st.links):
                reasons.append(why)
            else:
                serving += 1
        if why := self.daemons.model_problem():
            reasons.append(why)
            serving = 0
        if serving == 0 or (reasons and len(self.daemons.prefills) == 1):
            return json_response(
                {"status": "unhealthy", "reasons": reasons},
                status=503,
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        if reasons:
            return json_response({"status": "degraded", "reasons": reasons})
        return json_response({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        await self.daemon_statuses()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def read_body(request: Request) -> bytes:
    """The request's body; 413 past MAX_BODY_BYTES. A body up to DISCARD_BYTES is read to its
    end first (and dropped), so that the client, which sends all of it before reading the
    answer, gets the 413 instead of a connection reset."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    if size > MAX_BODY_BYTES and size > DISCARD_BYTES:
        raise too_large(size, MAX_BODY_BYTES)
    chunks, read = [], 0
    async for chunk in request.stream():
        read += len(chunk)
        if read <= MAX_BODY_BYTES:
            chunks.append(chunk)
        elif read > DISCARD_BYTES:
            break
    if read > MAX_BODY_BYTES:
        raise too_large(max(size, read), MAX_BODY_BYTES)
    return b"".join(chunks)
