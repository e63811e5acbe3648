"""The starlette application: routes, the API key check, and the daemons' health.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the API key guards
these three when one is set), GET /health, GET /metrics (open, for probes and scrapers).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_server import generation, responses, schemas
from api_server.chat import ChatTemplate, TemplateError
from api_server.config import CHAT_DEFAULT_MAX_TOKENS, COMPLETION_DEFAULT_MAX_TOKENS, ApiConfig
from api_server.errors import ApiError, bad_field
from api_server.metrics import CONTENT_TYPE, Metrics
from api_server.sse import json_response
from api_server.tokens import PromptCounter
from api_server.upstream import Upstream
from common import client
from common.errors import PdkvError
from common.protocol import StatusReply

log = structlog.get_logger(__name__)
STATUS_TIMEOUT_S = 2.0


class Api:
    """One API server's state: its config, chat template, prompt counter and metrics."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.template = ChatTemplate.for_model(cfg.model)
        self.counter = PromptCounter(cfg.model)
        self.metrics = Metrics()
        self.upstream = Upstream(str(cfg.prefill_path))
        self.created = int(time.time())
        self._key = cfg.api_key.encode() if cfg.api_key else None

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._guard("models", self.models), methods=["GET"]),
                Route(
                    "/v1/completions",
                    self._guard("completions", self.completions),
                    methods=["POST"],
                ),
                Route("/v1/chat/completions", self._guard("chat", self.chat), methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ]
        )

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
        model = {
            "id": self.cfg.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "pdkv",
        }
        return json_response({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        req = schemas.decode(schemas.CompletionRequest, await request.body())
        prompt, prompt_tokens = schemas.prompt_of(req)
        max_tokens = req.max_tokens
        params = schemas.sampling(
            req, max_tokens=max_tokens, default_max=COMPLETION_DEFAULT_MAX_TOKENS
        )
        job = generation.Job(
            request_id="cmpl-" + uuid.uuid4().hex[:24],
            sampling=params,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            stops=schemas.stop_strings(req),
            stream=req.stream,
        )
        return await self._respond(
            job, req, responses.Shape(endpoint="completions", chat=False), started
        )

    async def chat(self, request: Request) -> Response:
        started = time.perf_counter()
        req = schemas.decode(schemas.ChatRequest, await request.body())
        if not req.messages:
            raise bad_field("messages", "messages must hold at least one message")
        messages = [
            {
                "role": m.role,
                "content": schemas.message_text(m, i),
                **({"name": m.name} if m.name else {}),
            }
            for i, m in enumerate(req.messages)
        ]
        try:
            prompt, prompt_tokens = self.template.prompt(messages)
        except TemplateError as exc:
            raise bad_field("messages", str(exc)) from None
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        params = schemas.sampling(req, max_tokens=max_tokens, default_max=CHAT_DEFAULT_MAX_TOKENS)
        job = generation.Job(
            request_id="chatcmpl-" + uuid.uuid4().hex[:24],
            sampling=params,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            stops=schemas.stop_strings(req),
            stream=req.stream,
        )
        return await self._respond(job, req, responses.Shape(endpoint="chat", chat=True), started)

    async def _respond(
        self,
        job: generation.Job,
        req: schemas.CompletionRequest | schemas.ChatRequest,
        shape: responses.Shape,
        started: float,
    ) -> Response:
        if req.model != self.cfg.model_id:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; GET /v1/models lists "
                f"{self.cfg.model_id!r}",
                param="model",
                code="model_not_found",
            )
        reply = responses.Reply(
            id=job.request_id,
            model=self.cfg.model_id,
            shape=shape,
            started=started,
            created=int(time.time()),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        events = generation.run(
            job,
            upstream=self.upstream,
            timeout=self.cfg.request_timeout_s,
            retry_after=self.cfg.retry_after_s,
            metrics=self.metrics,
            counter=self.counter,
        )
        if job.stream:
            return await responses.streamed(reply, events, self.metrics)
        return await responses.whole(reply, events, self.metrics)

    async def daemon_statuses(self) -> dict[str, StatusReply | str]:
        """Each daemon's STATUS_REPLY, or why it did not answer; the metrics see them too."""
        paths = {"prefill": self.cfg.prefill_path, "decode": self.cfg.decode_path}
        answers = await asyncio.gather(
            *(client.status(str(p), timeout=STATUS_TIMEOUT_S) for p in paths.values()),
            return_exceptions=True,
        )
        out: dict[str, StatusReply | str] = {}
        for (role, path), answer in zip(paths.items(), answers, strict=True):
            if isinstance(answer, StatusReply):
                out[role] = answer
            elif isinstance(answer, OSError | TimeoutError | PdkvError):
                out[role] = (
                    f"{role} daemon at {path} does not answer ({type(answer).__name__}: {answer})"
                )
            else:
                raise answer
            self.metrics.daemons.statuses[role] = (
                answer if isinstance(answer, StatusReply) else None
            )
        return out

    async def health(self, request: Request) -> Response:
        statuses = await self.daemon_statuses()
        reasons = [s for s in statuses.values() if isinstance(s, str)]
        prefill = statuses["prefill"]
        if isinstance(prefill, StatusReply):
            link = prefill.links[0] if prefill.links else {}
            if link.get("state") != "up":
                why = link.get("last_error") or "not connected yet"
                reasons.append(f"the prefill daemon's link to the decode daemon is down ({why})")
        if reasons:
            return json_response(
                {"status": "unhealthy", "reasons": reasons},
                status=503,
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        return json_response({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        await self.daemon_statuses()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
