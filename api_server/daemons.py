"""The daemons as the API sees them: one connection per prefill daemon that every HTTP request
shares (common.client.Connection), the model they serve and the state of their links.

With several prefill daemons (`--client-socket` once each) `route` picks one per request: the
one the start of its prompt maps to (rendezvous hashing over the prefills that can serve now, so
repeats of a prefix go to one prefill, whose prefix cache then holds it), unless that one has
ROUTE_SLACK more requests of ours in flight than the least busy, which then gets it. A prefill
that does not answer or has no decode link up is left out until its STATUS says otherwise.

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
import hashlib
import time
from collections.abc import AsyncIterator
from typing import TypeVar

import structlog

from api_server import structured
from api_server.config import ApiConfig
from api_server.errors import timed_out, unavailable
from api_server.model import ServedModel, Unservable, served_model
from common import client
from common.daemon.rundir import StartupError
from common.errors import PdkvError
from common.health import link_problem
from common.protocol import ModelCard, StatusReply

log = structlog.get_logger(__name__)
STATUS_FRESH_S = 1.0
STATUS_TIMEOUT_S = 2.0
#: a request leaves its prefix's prefill for the least busy one past this many more in flight
ROUTE_SLACK = 8
#: what of a prompt names its prefix for routing: its first tokens, or characters of its text
AFFINITY_TOKENS = 64
AFFINITY_CHARS = 256
T = TypeVar("T")


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


class Prefill:
    """One prefill daemon: its shared connection, its last STATUS, our requests in flight."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn = client.Connection(path)
        self.status: StatusReply | None = None
        self.problem: str | None = "not asked yet"  # why it cannot take requests, or None
        self.at = 0.0
        self.connects = -1
        self.in_flight = 0  # this API's requests on it now
        self.routed = 0  # this API's requests sent to it since start

    def fresh(self) -> bool:
        return (
            self.status is not None
            and self.problem is None
            and self.connects == self.conn.connects
            and time.monotonic() - self.at < STATUS_FRESH_S
        )


class Daemons:
    """The prefill connections and what the API last learned from the daemons' STATUS."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.prefills = [Prefill(str(path)) for path in cfg.prefill_paths]
        self._card: ModelCard | None = None
        self._served: ServedModel | Unservable | None = None
        self._lock = asyncio.Lock()

    @property
    def prefill(self) -> client.Connection:
        """The first prefill's connection (the only one, unless --client-socket is repeated)."""
        return self.prefills[0].conn

    @property
    def model(self) -> ServedModel | None:
        """The model last learned, if it can be served."""
        return self._served if isinstance(self._served, ServedModel) else None

    def model_problem(self) -> str | None:
        """Why the daemons' model cannot be served, or None."""
        return str(self._served) if isinstance(self._served, Unservable) else None

    async def ready(self) -> ServedModel:
        """The model to serve a request with, once a prefill answers and has a decode link up;
        ApiError 503 saying why not."""
        await self._refresh()
        if not self._serving():
            answering = [p for p in self.prefills if p.status is not None and p.problem]
            if answering:
                why = "; ".join(p.problem or "" for p in answering)
                raise unavailable(why, retry_after=self.cfg.retry_after_s, code="link_down")
            why = "; ".join(p.problem or "" for p in self.prefills)
            raise unavailable(why, retry_after=self.cfg.retry_after_s)
        return self._servable()

    async def learn(self) -> ServedModel:
        """The daemons' model, whatever the state of their links; ApiError 503 when unknown."""
        await self._refresh()
        if self._served is None:
            why = "; ".join(p.problem or "" for p in self.prefills)
            raise unavailable(why, retry_after=self.cfg.retry_after_s)
        return self._servable()

    def route(self, prompt_tokens: list[int] | None, prompt: str | None) -> Prefill:
        """The prefill for a request with this prompt (module docstring); after `ready`."""
        serving = self._serving() or self.prefills
        if len(serving) == 1:
            return serving[0]
        if prompt_tokens:
            key = repr(prompt_tokens[:AFFINITY_TOKENS]).encode()
        else:
            key = (prompt or "")[:AFFINITY_CHARS].encode()
        home = max(serving, key=lambda p: hashlib.blake2b(key + p.path.encode()).digest())
        idle = min(serving, key=lambda p: p.in_flight)
        chosen = idle if home.in_flight > idle.in_flight + ROUTE_SLACK else home
        log.debug("routed", prefill=chosen.path, home=home.path, in_flight=chosen.in_flight)
        return chosen

    async def counted(self, prefill: Prefill, events: AsyncIterator[T]) -> AsyncIterator[T]:
        """`events` of one request on `prefill`, counted in its load while they run."""
        prefill.in_flight += 1
        prefill.routed += 1
        try:
            async for event in events:
                yield event
        finally:
            prefill.in_flight -= 1

    def _serving(self) -> list[Prefill]:
        """The prefills that can take a request now: answering, a link up, the API's model."""
        return [
            p
            for p in self.prefills
            if p.status is not None and p.problem is None and p.status.model_card == self._card
        ]

    def _servable(self) -> ServedModel:
        if isinstance(self._served, ServedModel):
            return self._served
        why = str(self._served) if self._served is not None else "no model learned yet"
        raise unavailable(why, retry_after=self.cfg.retry_after_s, code="model_mismatch")

    async def _refresh(self) -> None:
        """Ask every prefill whose STATUS is stale (at once, each bounded); a hung one: 504
        when it is the only one."""
        if all(p.fresh() for p in self.prefills):
            return
        async with self._lock:
            stale = [p for p in self.prefills if not p.fresh()]
            answers = await asyncio.gather(*(self._ask(p) for p in stale), return_exceptions=True)
            for p, answer in zip(stale, answers, strict=True):
                if isinstance(answer, StatusReply):
                    self.observe(answer, p)
                elif isinstance(answer, TimeoutError) and len(self.prefills) == 1:
                    raise timed_out(min(STATUS_TIMEOUT_S, self.cfg.request_timeout_s))
                elif isinstance(answer, TimeoutError | OSError | PdkvError):
                    p.status, p.problem = None, _not_answering(p, answer)
                elif isinstance(answer, BaseException):
                    raise answer

    async def _ask(self, p: Prefill) -> StatusReply:
        return await p.conn.status(min(STATUS_TIMEOUT_S, self.cfg.request_timeout_s))

    def observe(self, st: StatusReply, prefill: Prefill | None = None) -> None:
        """Take `st`, a prefill's STATUS (the first prefill's unless named), as its state now;
        the model is learned from the first prefill that answers."""
        p = prefill or self.prefills[0]
        p.status, p.at, p.connects = st, time.monotonic(), p.conn.connects
        p.problem = link_problem(st.links)
        others = [q.status for q in self.prefills if q is not p and q.status is not None]
        if st.model_card != self._card and any(o.model_card == self._card for o in others):
            # the others' model was learned first: this prefill is left out, and named
            p.problem = f"the prefill daemon at {p.path} serves another model than the others"
            log.warning("prefill_model_differs", prefill=p.path)
            return
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
            structured.warm(self._served.card.path)

    async def statuses(self) -> dict[str, StatusReply | str]:
        """Each daemon's STATUS_REPLY, or why it did not answer (for /health and /metrics):
        "prefill" (the first), "prefill@PATH" for each further one, "decode"."""
        decode_path = str(self.cfg.decode_path)
        answers = await asyncio.gather(
            *(p.conn.status(STATUS_TIMEOUT_S) for p in self.prefills),
            client.status(decode_path, timeout=STATUS_TIMEOUT_S),
            return_exceptions=True,
        )
        out: dict[str, StatusReply | str] = {}
        names = ["prefill"] + [f"prefill@{p.path}" for p in self.prefills[1:]]
        paths = [p.path for p in self.prefills] + [decode_path]
        for role, path, answer in zip([*names, "decode"], paths, answers, strict=True):
            if isinstance(answer, StatusReply):
                out[role] = answer
            elif isinstance(answer, OSError | TimeoutError | PdkvError):
                kind = role.partition("@")[0]
                out[role] = (
                    f"{kind} daemon at {path} does not answer ({type(answer).__name__}: {answer})"
                )
            else:
                raise answer  # type: ignore[misc]
        for p, answer in zip(self.prefills, answers, strict=False):
            if isinstance(answer, StatusReply):
                self.observe(answer, p)
        return out

    async def further_decodes(
        self, statuses: dict[str, StatusReply | str]
    ) -> dict[str, StatusReply | None]:
        """The STATUS_REPLY (None: no answer) of every decode the prefills link to, besides the
        one of --link-socket, as "decode@PATH" (for /metrics; /health keeps to the prefills and
        that decode). Decodes across hosts (tcp://) are not asked: STATUS is not served there."""
        mine = str(self.cfg.decode_path)
        paths = sorted(
            {
                str(link.get("decode", ""))
                for st in statuses.values()
                if isinstance(st, StatusReply) and st.role == "prefill"
                for link in st.links
            }
            - {"", mine}
        )
        paths = [p for p in paths if not p.startswith("tcp://")]
        answers = await asyncio.gather(
            *(client.status(p, timeout=STATUS_TIMEOUT_S) for p in paths), return_exceptions=True
        )
        out: dict[str, StatusReply | None] = {}
        for path, answer in zip(paths, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(
                answer, OSError | TimeoutError | PdkvError
            ):
                raise answer
            out[f"decode@{path}"] = answer if isinstance(answer, StatusReply) else None
        return out

    def close(self) -> None:
        for p in self.prefills:
            p.conn.close()


def _not_answering(p: Prefill, exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"the prefill daemon at {p.path} did not answer STATUS in time"
    return f"the prefill daemon at {p.path} is not answering ({type(exc).__name__}: {exc})"


__all__ = ["Daemons", "Prefill", "check_at_start"]
