"""The client commands, `pdkv status` and `pdkv generate`: ask the running daemons over their sockets
and print what they answer (text for a terminal, with control characters escaped, or JSON).
Keyword-only functions returning exit codes, as in commands.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
import msgspec

from common import client
from common.errors import PdkvError
from common.health import daemons_healthy, link_problem
from common.protocol import ConnectionClosed, ModelCard, StatusReply
from common.sampling_params import SamplingParams
from pdkv.commands import EXIT_FAIL, EXIT_OK, Globals


def status(
    g: Globals,
    *,
    client_socket: Path | None = None,
    link_socket: Path | None = None,
    as_json: bool = False,
) -> int:
    """Print each daemon's state; the exit code is `pdkv status RUNTIME_DIR`'s (healthy): a
    socket given as an option counts as found even where it is missing."""
    targets = {
        "prefill": (client_socket or g.runtime_dir / "prefill.sock", client_socket is not None),
        "decode": (link_socket or g.runtime_dir / "decode.sock", link_socket is not None),
    }
    out = {role: _ask(role, path, named=named) for role, (path, named) in targets.items()}
    apis = _apis(g.runtime_dir)  # optional: not part of the exit code
    if as_json:
        click.echo(json.dumps({**out, **({"apis": apis} if apis else {})}, indent=2))
    else:
        for role, st in out.items():
            click.echo(_status_line(role, st))
        for api in apis:
            workers = f"  ({api['workers']} workers)" if api.get("workers") else ""
            click.echo(f"{'api':8} up    pid {api['pid']}  {api.get('url', '?')}/v1{workers}")
    return EXIT_OK if healthy(out.values()) else EXIT_FAIL


def status_of_dirs(dirs: list[Path], *, as_json: bool = False) -> int:
    """`pdkv status DIR...`: every daemon of several runtime dirs (one per daemon in an XpYd
    deployment: a dir may hold a prefill, a decode or both). Exit 0 only when every dir holds a
    daemon's socket and the daemons are healthy (healthy)."""
    found: list[dict[str, Any]] = []
    ok = True
    for d in dirs:
        here = [_ask(r, d / f"{r}.sock", named=False) for r in ("prefill", "decode")]
        here = [st for st in here if not st.get("absent")]
        if not here:  # a daemon stopped cleanly removes its socket: the dir is named, down
            why = "no daemon: neither prefill.sock nor decode.sock here"
            here = [{"role": "daemon", "down": why, "socket": str(d)}]
        ok = healthy(here) and ok
        found += [{"runtime_dir": str(d), **st} for st in here]
    if as_json:
        click.echo(json.dumps({"daemons": found, "healthy": ok}, indent=2))
    else:
        for st in found:
            click.echo(f"[{st['runtime_dir']}]\n{_status_line(st['role'], st)}")
    return EXIT_OK if ok else EXIT_FAIL


def healthy(daemons: Iterable[dict[str, Any]]) -> bool:
    """The one rule of `pdkv status` and `pdkv status DIR...`, over one runtime dir's daemons:
    those whose socket is there (or was named) count; the dir is healthy when it holds one and
    each answers and is linked to the other kind (common.health). A daemon whose socket is not
    there is left out: a prefill's decode may live in another dir (`--decode`), and a missing
    counterpart shows in the link of the daemon that is there."""
    return daemons_healthy(st for st in daemons if not st.get("absent"))


def _ask(role: str, path: Path, *, named: bool) -> dict[str, Any]:
    """The STATUS of the daemon at `path` as a dict, or one whose `down` says why it did not
    answer (`absent` too when there is no socket there and it was not named)."""
    try:
        return msgspec.to_builtins(asyncio.run(client.status(str(path))))
    except (OSError, TimeoutError, PdkvError) as exc:
        st = {"role": role, "down": why_down(role, exc), "socket": str(path)}
        if not named and not path.exists():
            st["absent"] = True
        return st


def why_down(role: str, exc: BaseException) -> str:
    """Why a daemon's socket did not answer, in words (no exception class for the usual ones)."""
    if isinstance(exc, FileNotFoundError):
        return f"not running: no socket (pdkv {role} start)"
    if isinstance(exc, ConnectionRefusedError):
        return f"not running: nothing listens on the socket (pdkv {role} start)"
    if isinstance(exc, PermissionError):
        return "not allowed: the socket refuses this user (--socket-group, --allowed-uids)"
    if isinstance(exc, TimeoutError):
        return "not answering: connected, but no STATUS reply in time"
    return f"{type(exc).__name__}: {exc}"


def _apis(runtime_dir: Path) -> list[dict[str, Any]]:
    """The APIs running in `runtime_dir` (one per port): port, pid and, once it listens, URL."""
    from api_server.config import running_apis

    return [
        {
            "port": a.port,
            "pid": a.pid,
            **({"url": a.url} if a.url else {}),
            **({"workers": a.workers} if a.workers else {}),
        }
        for a in running_apis(runtime_dir)
    ]


def _prefix_cache_text(cache: dict[str, int]) -> str:
    """The prefix cache's part of a status line: its hit rate over the prompt tokens that looked,
    and the blocks it holds ("" for a daemon without one)."""
    if not cache:
        return ""
    if not cache.get("enabled"):
        return "  prefix cache off"
    queried = cache.get("queried_tokens", 0)
    rate = f"{100 * cache.get('hit_tokens', 0) / queried:.1f}%" if queried else "-"
    return (
        f"  prefix cache hit {rate} of {queried} tokens ({cache.get('named_blocks', 0)} blocks, "
        f"{cache.get('evictions', 0)} evicted)"
    ) + _host_tier_text(cache)


def _host_tier_text(cache: dict[str, int]) -> str:
    """The host KV tier's part (`host_tier_*` keys; "" when off): its size and occupancy, this
    daemon's reads and writes, and any checksum failure."""
    if not cache.get("host_tier_enabled"):
        return ""
    t = {k.removeprefix("host_tier_"): v for k, v in cache.items() if k.startswith("host_tier_")}
    text = (
        f"  host tier {t.get('used', 0)}/{t.get('slots', 0)} blocks "
        f"({t.get('capacity_bytes', 0) / 2**30:.2f} GiB, {t.get('evictions', 0)} evicted), "
        f"{t.get('hits', 0)} read, {t.get('stored', 0)} written"
    )
    if t.get("checksum_failures"):
        text += f", {t['checksum_failures']} CHECKSUM FAILURES"
    return text


def _status_line(role: str, st: dict[str, Any]) -> str:
    if "down" in st:
        return f"{role:8} down  {st['down']}  socket {st['socket']}"
    pool = st["pool"]
    line = (
        f"{role:8} up    pid {st['pid']}  instance {st.get('instance') or '-'}  "
        f"{st['device']}/{st['backend']}  "
        f"model {_model_name(st)} {st['dtype']}  uptime {st['uptime_s']:.0f}s  "
        f"pool {pool['total'] - pool['free']}/{pool['total']} blocks used ({pool['leased']} leased)  "
        f"in-flight {st['inflight']}  served {st['served']}  {st['tokens_per_s']:.1f} tokens/s"
    )
    line += _prefix_cache_text(st.get("prefix_cache") or {})
    if role == "prefill" and len(st["links"]) == 1:
        line += "  link " + _link_text(st["links"][0])
    elif role == "prefill" and st["links"]:
        up = sum(link["state"] == "up" for link in st["links"])
        line += f"  decodes {up}/{len(st['links'])} up"
        for link in st["links"]:
            line += f"\n           decode {link.get('decode', '?')}: {_link_text(link)}"
            line += f", {link.get('requests', 0)} requests"
    elif role == "decode":
        line += f"  links {len(st['links'])}"
    return line


def _link_text(link: dict[str, Any]) -> str:
    text = f"{link['state']} (connects {link['connects']}, rtt {link['rtt_us']} us)"
    if link["state"] != "up" and link.get("last_error"):
        text += f"  last error: {link['last_error']}"
    return text


def _model_name(st: dict[str, Any]) -> str:
    """The model's name as the API serves it (the fingerprint only in --json)."""
    card = st.get("model_card") or {}
    return card.get("name") or st.get("model") or "?"


def generate(
    g: Globals,
    *,
    prompt: str,
    client_socket: Path | None = None,
    stream: bool = True,
    as_json: bool = False,
    timeout: float = 120.0,
    chat: bool = False,
    system: str | None = None,
    **sampling: Any,
) -> int:
    """Run one request through the daemons and print its text (or, `as_json`, one JSON object).

    With `chat`, `prompt` is a user message (after `system`'s, if given) in the daemons' model's
    chat template, tokenized as the HTTP API's chat route does (chat_prompt)."""
    path = str(client_socket or g.runtime_dir / "prefill.sock")
    try:
        params = SamplingParams(**sampling).validate()
    except (PdkvError, TypeError) as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    stream = stream and not as_json
    prompt_tokens: list[int] | None = None

    async def run() -> client.Result:
        result = client.Result(request_id="")
        async for msg in client.stream(
            path,
            prompt=None if prompt_tokens is not None else prompt,
            prompt_tokens=prompt_tokens,
            sampling=params,
            timeout=timeout,
            text_deltas=stream,
        ):
            result.request_id = msg.request_id
            result.text += msg.text
            if isinstance(msg, client.Tokens):
                result.tokens.extend(msg.tokens)
            if stream and msg.text:
                click.echo(printable(msg.text), nl=False)
            if isinstance(msg, client.Finish):
                result.finish = msg
        return result

    try:
        st = ready(path)
        if chat:
            prompt, prompt_tokens = chat_prompt(st.model_card, prompt, system=system)
        result = asyncio.run(run())
    except LinkDown as exc:
        return _generate_failed(as_json, None, "LINK_DOWN", str(exc), newline=False)
    except ChatUnavailable as exc:
        return _generate_failed(as_json, None, "CHAT_TEMPLATE", str(exc), newline=False)
    except client.RequestFailed as exc:
        return _generate_failed(as_json, exc.request_id, str(exc.code), str(exc), newline=stream)
    except (ConnectionClosed, ConnectionResetError, BrokenPipeError) as exc:
        return _generate_failed(
            as_json,
            None,
            "CONNECTION_CLOSED",
            f"the prefill daemon at {path} closed the connection before the answer was complete "
            f"({exc}); did it stop or crash? (pdkv status)",
            newline=stream,
        )
    except (OSError, TimeoutError, PdkvError) as exc:
        return _generate_failed(
            as_json,
            None,
            "UNREACHABLE",
            f"cannot reach the prefill daemon at {path} ({type(exc).__name__}: {exc}); is it "
            "running? (pdkv prefill start)",
            newline=stream,
        )
    if as_json:
        # ASCII-only JSON: no raw control character (C0 or C1) reaches a terminal
        click.echo(json.dumps(_result_json(result)))
    else:
        click.echo("" if stream else printable(result.text))
    return EXIT_OK


class LinkDown(PdkvError):
    """The prefill daemon answers but has no link to a decode up: the request is not sent."""


def ready(path: str) -> StatusReply:
    """The STATUS of the prefill daemon at `path` once it can take a request; LinkDown, with
    the reason the HTTP API's 503 gives (common.health), when no link of it to a decode is up.
    Sent anyway, the request would wait in the prefill up to its --handoff-timeout for a decode
    that may not come back. A link that drops after this STATUS is waited for by the prefill,
    as for the API's requests."""
    st = asyncio.run(client.status(path))
    if why := link_problem(st.links):
        raise LinkDown(f"{why}; the request was not sent (pdkv status shows the link)")
    return st


class ChatUnavailable(PdkvError):
    """`generate --chat` cannot build the chat prompt; the message says why."""


def chat_prompt(
    card: ModelCard | None, text: str, *, system: str | None = None
) -> tuple[str | None, list[int] | None]:
    """(prompt, prompt_tokens) of the chat `[system,] user: text` for the daemons whose STATUS
    has the model card `card`: their checkpoint's chat template, rendered and tokenized by
    api_server.chat exactly as /v1/chat/completions does (transformers' apply_chat_template
    ids); the default template's text for the built-in tiny model."""
    from api_server.chat import ChatTemplate, TemplateError

    if card is None:
        raise ChatUnavailable("the prefill daemon names no model (a pdkv of another version?)")
    model_dir = Path(card.path) if card.path else None
    if model_dir is not None and not model_dir.is_dir():
        raise ChatUnavailable(
            f"the daemons serve the checkpoint {model_dir}, which is not a directory here: "
            "--chat reads its chat template there"
        )
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": text})
    try:
        return ChatTemplate.for_model(model_dir).prompt(messages)
    except TemplateError as exc:
        raise ChatUnavailable(str(exc)) from None


def _result_json(result: client.Result) -> dict[str, Any]:
    finish = result.finish
    return {
        "request_id": result.request_id,
        "tokens": result.tokens,
        "text": result.text,
        "finish_reason": finish.reason if finish else None,
        "usage": msgspec.to_builtins(finish.usage) if finish else None,
        "timings": dict(finish.timings) if finish else {},
        "decode": finish.decode if finish else "",
    }


def _generate_failed(
    as_json: bool, request_id: str | None, code: str, message: str, *, newline: bool
) -> int:
    if as_json:
        error = {"code": code, "message": message}
        click.echo(json.dumps({"request_id": request_id, "error": error}))
    else:
        click.echo(("\n" if newline else "") + f"error: {message}", err=True)
    return EXIT_FAIL


# C0 controls but newline and tab, DEL and the C1 controls: shown escaped, never sent to a terminal
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (9, 10)}


def printable(text: str) -> str:
    """`text` with control characters (ESC, CR, BEL, ...) escaped as \\xNN."""
    return text.translate(_CONTROL)
