"""Run the API server: bind (fail fast), write the pidfile, serve with uvicorn until SIGTERM/SIGINT.

The pidfile and URL file are named by the bound port (RUNTIME_DIR/api-PORT.pid, .url), so APIs on
several ports share a runtime dir; `pdkv status` and `pdkv stop` find each.

uvicorn owns the signals and the graceful shutdown (stop accepting, finish open responses within
`drain_timeout_s`, then cancel them: a cancelled stream closes its daemon connection, which aborts
its request). The pidfile is removed on the way out. With `--workers N` this process binds and
keeps the files, and N workers serve the socket (api_server/workers.py).
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import replace

import prometheus_client
import structlog
import uvicorn

from api_server import workers
from api_server.app import Api
from api_server.config import ApiConfig, base_url
from common import settings
from common.daemon import heap
from common.daemon.rundir import StartupError, remove_file, write_pidfile

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


def run(
    cfg: ApiConfig, *, drain_timeout_s: float = 10.0, worker_argv: list[str] | None = None
) -> int:
    """Serve until stopped; 0 after a clean stop. StartupError when it cannot start. With
    `cfg.workers` > 1, start that many workers (`worker_argv`: the command line that runs this
    again, see api_server/workers.py) and supervise them instead; in a worker, serve the socket
    the supervisor bound."""
    if workers.worker_index() is not None:
        sock = socket.socket(fileno=workers.inherited_socket())
        try:
            return _serve(cfg, sock, drain_timeout_s)
        finally:
            sock.close()
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
    log.info(
        "api_listening",
        address=url,
        model=str(cfg.model) if cfg.model else "the daemons'",
        prefill=str(cfg.prefill_path),
        decode=str(cfg.decode_path),
        api_key=cfg.api_key is not None,
        workers=cfg.workers,
    )
    try:
        if cfg.workers == 1:
            return _serve(cfg, sock, drain_timeout_s)
        if worker_argv is None:
            raise StartupError("--workers needs the command line that starts a worker")
        env = {k: v for k, v in os.environ.items() if k != "PDKV_API_KEY"}
        if cfg.api_key:
            env["PDKV_API_KEY"] = cfg.api_key  # never on a command line
        # each worker takes the bound port (so --port 0 names one instance) and the same settings
        argv = [*worker_argv, *settings.argv(replace(cfg, port=port))]
        metrics = cfg.file("metrics", port)
        return workers.Supervisor(argv, env, sock, cfg.workers, metrics, drain_timeout_s).run()
    finally:
        sock.close()
        remove_file(urlfile)
        remove_file(pidfile)
        log.info("api_stopped")


def _serve(cfg: ApiConfig, sock: socket.socket, drain_timeout_s: float) -> int:
    """One API process on the listening `sock` until SIGTERM/SIGINT; 0 after a clean stop."""
    prometheus_client.disable_created_metrics()  # no `_created` series beside every counter
    api = Api(cfg)
    config = uvicorn.Config(
        api.app(),
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=max(1, round(drain_timeout_s)),
    )
    server = uvicorn.Server(config)
    if workers.worker_index() is not None:
        log.info("api_worker_serving")
        workers.serving()
    # uvicorn handles SIGTERM/SIGINT while it serves, then restores the previous handlers and
    # raises the signal again: with these no-op handlers that ends in a clean exit 0, not -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    heap.freeze_startup_heap()  # as the daemons do (common.daemon.heap)
    pauses = heap.watch_pauses()
    try:
        server.run(sockets=[sock])
    finally:
        pauses.close()
        api.daemons.close()
    return 0
