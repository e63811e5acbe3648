"""The daemons as the API sees them: one connection to the prefill daemon that every HTTP request
shares (common.client.Connection), the model they serve and the state of their link.

`ready()` runs before each request, on the prefill's STATUS over that connection, asked again
when the last one is older than STATUS_FRESH_S, said the link was down, or came over an earlier
connection (a restarted daemon may serve another model). It refuses at once, with 503 and the
reason: a prefill that does not answer (`unavailable`), its link to the decode down
(`link_down`; the request would otherwise wait in the prefill up to its --handoff-timeout for a
decode that may be gone), or a model this API cannot serve (`model_mismatch`,
api_server.model). A link that drops less than STATUS_FRESH_S after a STATUS that saw it up is
met by the prefill, which waits for it as before.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from api_server.config import ApiConfig
from api_server.errors import timed_out, unavailable
from api_server.model import ServedModel, Unservable, served_model
from common import client
from common.errors import PdkvError
from common.protocol import ModelCard, StatusReply
from common.rundir import StartupError

log = structlog.get_logger(__name__)
STATUS_FRESH_S = 1.0
STATUS_TIMEOUT_S = 2.0


def link_problem(st: StatusReply) -> str | None:
    """Why the prefill's link to the decode is down, or None when it is up."""
    link = st.links[0] if st.links else {}
    if link.get("state") == "up":
        return None
    why = link.get("last_error") or "not connected yet"
    return f"the prefill daemon's link to the decode daemon is down ({why})"


def check_at_start(cfg: ApiConfig) -> None:
    """StartupError when the prefill answers and serves a model this API cannot serve (another
    than --model, or a checkpoint not readable here); daemons not up yet are met later."""
    try:
        st = asyncio.run(client.status(str(cfg.prefill_path), timeout=STATUS_TIMEOUT_S))
    except (OSError, TimeoutError, PdkvError):
        return
    try:
        served_model(st.model_card, cfg)
    except Unservable as exc:
        raise StartupError(str(exc)) from None


class Daemons:
    """The prefill connection and what the API last learned from the daemons' STATUS."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.prefill = client.Connection(str(cfg.prefill_path))
        self._status: StatusReply | None = None
        self._at = 0.0
        self._connects = -1
        self._card: ModelCard | None = None
        self._served: ServedModel | Unservable | None = None
        self._lock = asyncio.Lock()

    @property
    def model(self) -> ServedModel | None:
        """The model last learned, if it can be served."""
        return self._served if isinstance(self._served, ServedModel) else None

    def model_problem(self) -> str | None:
        """Why the daemons' model cannot be served, or None."""
        return str(self._served) if isinstance(self._served, Unservable) else None

    async def ready(self) -> ServedModel:
        """The model to serve a request with, once the prefill answers and its link is up;
        ApiError 503 saying why not."""
        st = await self._fresh_status()
        if why := link_problem(st):
            raise unavailable(why, retry_after=self.cfg.retry_after_s, code="link_down")
        return self._servable()

    async def learn(self) -> ServedModel:
        """The daemons' model, whatever the state of their link; ApiError 503 when unknown."""
        await self._fresh_status()
        return self._servable()

    def _servable(self) -> ServedModel:
        if isinstance(self._served, ServedModel):
            return self._served
        why = str(self._served) if self._served is not None else "no model learned yet"
        raise unavailable(why, retry_after=self.cfg.retry_after_s, code="model_mismatch")

    def _is_fresh(self) -> bool:
        st = self._status
        return (
            st is not None
            and link_problem(st) is None
            and self._connects == self.prefill.connects
            and time.monotonic() - self._at < STATUS_FRESH_S
        )

    async def _fresh_status(self) -> StatusReply:
        if not self._is_fresh():
            async with self._lock:
                if not self._is_fresh():
                    self.observe(await self._ask_prefill())
        assert self._status is not None
        return self._status

    async def _ask_prefill(self) -> StatusReply:
        """The prefill's STATUS; 504 when it does not answer in time (hung), 503 when it
        cannot be reached."""
        seconds = min(STATUS_TIMEOUT_S, self.cfg.request_timeout_s)
        try:
            return await self.prefill.status(seconds)
        except TimeoutError:
            raise timed_out(seconds) from None
        except (OSError, PdkvError) as exc:
            raise unavailable(
                f"the prefill daemon at {self.prefill.path} is not answering "
                f"({type(exc).__name__}: {exc})",
                retry_after=self.cfg.retry_after_s,
            ) from None

    def observe(self, st: StatusReply) -> None:
        """Take `st`, the prefill's STATUS, as the daemons' state now."""
        self._status, self._at, self._connects = st, time.monotonic(), self.prefill.connects
        if self._served is not None and st.model_card == self._card:
            return
        self._card = st.model_card
        try:
            self._served = served_model(st.model_card, self.cfg)
        except Unservable as exc:
            self._served = exc
            log.warning("model_unservable", error=str(exc))
        else:
            log.info("model_served", model=self._served.id, path=self._served.card.path or None)

    async def statuses(self) -> dict[str, StatusReply | str]:
        """Each daemon's STATUS_REPLY, or why it did not answer (for /health and /metrics)."""
        decode_path = str(self.cfg.decode_path)
        prefill, decode = await asyncio.gather(
            self.prefill.status(STATUS_TIMEOUT_S),
            client.status(decode_path, timeout=STATUS_TIMEOUT_S),
            return_exceptions=True,
        )
        out: dict[str, StatusReply | str] = {}
        for role, path, answer in (
            ("prefill", self.prefill.path, prefill),
            ("decode", decode_path, decode),
        ):
            if isinstance(answer, StatusReply):
                out[role] = answer
            elif isinstance(answer, OSError | TimeoutError | PdkvError):
                out[role] = (
                    f"{role} daemon at {path} does not answer ({type(answer).__name__}: {answer})"
                )
            else:
                raise answer
        if isinstance(prefill, StatusReply):
            self.observe(prefill)
        return out

    def close(self) -> None:
        self.prefill.close()
