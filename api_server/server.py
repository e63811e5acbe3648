"""Run the API server: bind (fail fast), write the pidfile, serve with uvicorn until SIGTERM/SIGINT.

The pidfile and URL file are named by the bound port (RUNTIME_DIR/api-PORT.pid, .url), so APIs on
several ports share a runtime dir; `pdkv status` and `pdkv stop` find each.

uvicorn owns the signals and the graceful shutdown (stop accepting, finish open responses within
`drain_timeout_s`, then cancel them: a cancelled stream closes its daemon connection, which aborts
its request). The pidfile is removed on the way out.
"""

from __future__ import annotations

import signal
import socket

import prometheus_client
import structlog
import uvicorn

from api_server.app import Api
from api_server.config import ApiConfig, base_url
from common import heap
from common.rundir import StartupError, remove_file, write_pidfile

log = structlog.get_logger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; StartupError naming the address when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run(cfg: ApiConfig, *, drain_timeout_s: float = 10.0) -> int:
    """Serve until stopped; 0 after a clean stop. StartupError when it cannot start."""
    prometheus_client.disable_created_metrics()  # no `_created` series beside every counter
    api = Api(cfg)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    pidfile, urlfile = cfg.file("pid", port), cfg.file("url", port)
    try:
        write_pidfile(pidfile)
    except StartupError:
        sock.close()
        raise
    url = base_url(host, port)
    urlfile.write_text(url + "\n")
    config = uvicorn.Config(
        api.app(),
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=max(1, round(drain_timeout_s)),
    )
    server = uvicorn.Server(config)
    log.info(
        "api_listening",
        address=url,
        model=str(cfg.model) if cfg.model else "the daemons'",
        prefill=str(cfg.prefill_path),
        decode=str(cfg.decode_path),
        api_key=cfg.api_key is not None,
    )
    # uvicorn handles SIGTERM/SIGINT while it serves, then restores the previous handlers and
    # raises the signal again: with these no-op handlers that ends in a clean exit 0, not -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    heap.freeze_startup_heap()  # as the daemons do (common.heap)
    pauses = heap.watch_pauses()
    try:
        server.run(sockets=[sock])
    finally:
        pauses.close()
        sock.close()
        api.daemons.close()
        remove_file(urlfile)
        remove_file(pidfile)
    log.info("api_stopped")
    return 0
