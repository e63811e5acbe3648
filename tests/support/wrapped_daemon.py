"""`python -m tests.support.wrapped_daemon ARGS`: the pdkv CLI with a fault armed from the
environment, for faults a test cannot cause from outside the process.

PDKVTEST_NOFILE=N      the process may hold at most N fds (RLIMIT_NOFILE), to reach EMFILE
PDKVTEST_FAIL_STEP=N   the decode engine's Nth step raises (a failure of no one sequence)
PDKVTEST_FAIL_PREFILL_TOKEN=T   a prefill forward over a prompt holding token T raises (the batch)
"""

from __future__ import annotations

import os
import resource


def _arm() -> None:
    nofile = os.environ.get("PDKVTEST_NOFILE")
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))
    fail_step = os.environ.get("PDKVTEST_FAIL_STEP")
    if fail_step:
        from decode_server.engine import DecodeEngine

        real = DecodeEngine._step

        def step(self, batch):  # type: ignore[no-untyped-def]
            if self.steps + 1 >= int(fail_step):
                raise RuntimeError("injected failure of the decode step")
            return real(self, batch)

        DecodeEngine._step = step  # type: ignore[method-assign]
    poison = os.environ.get("PDKVTEST_FAIL_PREFILL_TOKEN")
    if poison:
        from common.model.llama import LlamaModel

        real_prefill = LlamaModel.prefill_batch

        def prefill_batch(self, prompts, slot_mappings, kv, *rest):  # type: ignore[no-untyped-def]
            if any(int(poison) in p.tolist() for p in prompts):
                raise RuntimeError("injected failure of the prefill forward")
            return real_prefill(self, prompts, slot_mappings, kv, *rest)

        LlamaModel.prefill_batch = prefill_batch  # type: ignore[method-assign]


if __name__ == "__main__":
    _arm()
    from pdkv.cli import cli

    cli()
