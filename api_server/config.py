"""ApiConfig: everything `pdkv api start` takes, checked once at construction; each field a user
sets declares its option (common.settings.opt), from which the command's options are generated."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from api_server.tools.parsers import PARSERS
from common.daemon.rundir import StartupError, child_pids, read_pid
from common.model_dir import model_dir_problem
from common.settings import instance_name, opt

#: max_tokens of a request that sets none: OpenAI's default for /v1/completions, and for chat
#: (whose answers run longer) CHAT_DEFAULT_MAX_TOKENS; docs/operations.md documents both.
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
#: The largest request body (413 beyond): a prompt of a quarter of a million tokens or more,
#: and half the daemons' frame bound (MAX_META_BYTES), which a GENERATE must fit in.
MAX_BODY_BYTES = 2 * 2**20
#: A body over the limit but under this is read to its end before the 413 (see app.read_body).
DISCARD_BYTES = 64 * 2**20


def is_loopback(host: str) -> bool:
    """True for localhost and every address in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class ApiConfig:
    """How the API server listens and which daemons it fronts.

    Binding an address other than loopback needs `api_key` (StartupError otherwise): the daemons'
    sockets are protected by SO_PEERCRED, and the HTTP port must not open them to the network.
    """

    runtime_dir: Path
    host: str = field(
        default="127.0.0.1",
        metadata=opt(
            "--host",
            env="PDKV_API_HOST",
            help="Address to listen on; one other than loopback needs --api-key.",
        ),
    )
    port: int = field(
        default=8000,
        metadata=opt(
            "--port",
            env="PDKV_API_PORT",
            min=0,
            max=65535,
            help="TCP port to listen on (0: any free port).",
        ),
    )
    api_key: str | None = field(
        default=None,
        metadata=opt(
            "--api-key",
            secret=True,
            help="Clients must send `Authorization: Bearer KEY` to /v1/*.",
        ),
    )
    model: Path | None = field(
        default=None,
        metadata=opt(
            "--model",
            metavar="DIR",
            show_default="built-in tiny model",
            help="The daemons' checkpoint dir, for its chat template and name.",
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=opt(
            "--served-model-name",
            show_default="the checkpoint dir's name, or pdkv-tiny",
            help="Model id in /v1/models and requests.",
        ),
    )
    tool_parser: str | None = field(
        default=None,
        metadata=opt(
            "--tool-parser",
            choices=tuple(PARSERS),
            show_default="the one the chat template's text shows, if any",
            help="How tool calls are read from a model's text with tool_choice auto: hermes, "
            "llama3_json or mistral.",
        ),
    )
    client_socket: tuple[str, ...] = field(
        default=(),
        metadata=opt(
            "--client-socket",
            multiple=True,
            show_default="RUNTIME_DIR/prefill.sock",
            help="A prefill daemon's client socket; once per prefill daemon: each request goes "
            "to the one its prompt's start maps to (repeats of a prefix meet its cache), unless "
            "that one is much busier than the rest or down.",
        ),
    )
    link_socket: Path | None = field(
        default=None,
        metadata=opt(
            "--link-socket",
            show_default="RUNTIME_DIR/decode.sock",
            help="The decode daemon's socket (for health and metrics).",
        ),
    )
    instance: str | None = field(
        default=None,
        metadata=opt(
            "--instance",
            env="PDKV_API_INSTANCE",
            metavar="NAME",
            show_default="api@HOSTNAME:PORT",
            help="This API's name: the pdkv_instance label of its own series in /metrics.",
        ),
    )
    request_timeout_s: float = field(
        default=120.0,
        metadata=opt(
            "--request-timeout",
            env="PDKV_API_REQUEST_TIMEOUT",
            min=0.0,
            min_open=True,
            help="Seconds to wait for each answer from the daemons before a 504.",
        ),
    )
    drain_timeout_s: float = field(
        default=10.0,
        metadata=opt("--drain-timeout", help="Seconds to finish open responses on SIGTERM."),
    )
    workers: int = field(
        default=1,
        metadata=opt(
            "--workers",
            env="PDKV_API_WORKERS",
            min=1,
            max=64,
            help="API processes serving the port, each with its own connections to the daemons "
            "(one streams ~30k tokens/s on a core); /metrics sums their series.",
        ),
    )
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.api_key is not None:  # a blank PDKV_API_KEY is no key
            object.__setattr__(self, "api_key", self.api_key.strip() or None)
        if not is_loopback(self.host) and not self.api_key:
            raise StartupError(
                f"--host {self.host} is not a loopback address: set --api-key (or PDKV_API_KEY) so "
                "that only clients holding the key can generate"
            )
        if self.model is not None and (why := model_dir_problem(self.model)):
            raise StartupError(why)

    @property
    def instance_name(self) -> str:
        """--instance, else api@HOSTNAME:PORT (with --port 0: the pid, as the port is not known
        until the server listens)."""
        return instance_name(self.instance, "api", self.port or f"pid{os.getpid()}")

    @property
    def prefill_paths(self) -> tuple[Path, ...]:
        """Every --client-socket, or the runtime dir's prefill socket when none is given."""
        return tuple(Path(p) for p in self.client_socket) or (self.runtime_dir / "prefill.sock",)

    @property
    def prefill_path(self) -> Path:
        return self.prefill_paths[0]

    @property
    def decode_path(self) -> Path:
        return self.link_socket or self.runtime_dir / "decode.sock"

    def file(self, suffix: str, port: int | None = None) -> Path:
        """This API's file `suffix` (see api_file) for `port`, by default the configured one
        (0 before binding: the pidfile and URL file use the bound port)."""
        return api_file(self.runtime_dir, self.port if port is None else port, suffix)


def base_url(host: str, port: int) -> str:
    """http://HOST:PORT, an IPv6 address in brackets."""
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def api_file(runtime_dir: Path, port: int, suffix: str) -> Path:
    """RUNTIME_DIR/api-PORT.SUFFIX: the API on `port` keeps its pidfile (`pid`), base URL (`url`,
    for `pdkv status`) and, when detached, its log (`log`; `api-0.log` for --port 0) there. One
    set per port, so APIs on several ports share a runtime dir."""
    return runtime_dir / f"api-{port}.{suffix}"


@dataclass(frozen=True)
class RunningApi:
    """An API that runs in a runtime dir: its port, pid and base URL (None until it listens)."""

    port: int
    pid: int
    url: str | None
    workers: int = 0  # its live worker processes (--workers N > 1); 0: it serves alone


def api_pidfiles(runtime_dir: Path) -> dict[int, Path]:
    """Every API pidfile in `runtime_dir`, live or stale, by port."""
    found = {}
    for path in runtime_dir.glob("api-*.pid"):
        port = path.stem.removeprefix("api-")
        if port.isdigit():
            found[int(port)] = path
    return dict(sorted(found.items()))


def running_apis(runtime_dir: Path) -> list[RunningApi]:
    """The APIs whose pidfile in `runtime_dir` names a live process, by port."""
    apis = []
    for port, pidfile in api_pidfiles(runtime_dir).items():
        pid = read_pid(pidfile)
        if pid is None:
            continue
        try:
            url: str | None = api_file(runtime_dir, port, "url").read_text().strip() or None
        except OSError:
            url = None
        apis.append(RunningApi(port, pid, url, len(child_pids(pid))))
    return apis
