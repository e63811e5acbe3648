"""common.daemon.logs: each log line reaches its stream in one write, so that processes sharing a log
file (an API's workers, all on the one file `pdkv api start --background` opens) never
interleave inside a line."""

from __future__ import annotations

import json
import subprocess
import sys


def test_two_processes_logging_to_one_file_keep_every_line_whole(tmp_path) -> None:
    code = (
        "import sys, structlog\n"
        "from common.daemon import logs\n"
        "logs.configure('json', 'INFO')\n"
        "log = structlog.get_logger('t')\n"
        "for i in range(3000):\n"
        "    log.info('line', who=sys.argv[1], i=i, pad='x' * 60)\n"
    )
    path = tmp_path / "shared.log"
    with open(path, "ab") as out:  # stderr of both, as a detached API's workers share one
        procs = [
            subprocess.Popen([sys.executable, "-c", code, who], stdout=out, stderr=out)
            for who in ("a", "b")
        ]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = path.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # a line cut in two would not parse
    assert sorted((e["who"], e["i"]) for e in events) == sorted(
        (who, i) for who in "ab" for i in range(3000)
    )
