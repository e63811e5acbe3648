"""lm-evaluation-harness against pdkv's API on the real SmolLM2-135M-Instruct checkpoint, checked
sample by sample against lm-eval's own HF backend on the same weights (issue 25's done-when).

    .venv/bin/pip install 'lm_eval[api]'    # once; not a pdkv dependency
    .venv/bin/python bench/lm_eval_check.py [--tasks pdkv_capitals_gen,pdkv_choices_mc]

It makes the checkpoint (pdkv.models, cached), starts a decode + prefill pair on it (CPU, float32)
and the API in front of them, and runs two tiny tasks from bench/lm_eval_tasks/ (local JSONL, no
download) through lm-eval's `local-completions` model, which sends token-id prompts to
/v1/completions:

- pdkv_capitals_gen, generate_until: greedy answers cut at a newline. Equal when every sample's
  answer is the HF backend's, character for character.
- pdkv_choices_mc, multiple_choice: one log-likelihood request per choice (`echo`, `logprobs` and
  `max_tokens` 1 on /v1/completions). Equal when every sample picks the HF backend's choice and
  each choice's log-likelihood is within --atol of the HF backend's.

Then it runs the same tasks with lm-eval's `hf` model (transformers, float32, CPU), prints a line
per sample and a verdict per task, and exits 0 only when every task ran and was equal. A task the
API refuses (an HTTP error after lm-eval's retries) is reported with the API's answer, FAILED, not
skipped. Takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE / "lm_eval_tasks"
TASKS = ("pdkv_capitals_gen", "pdkv_choices_mc")
sys.path[:0] = [str(HERE), str(HERE.parent)]


def evaluate(model: str, model_args: dict[str, Any], task: str) -> list[dict[str, Any]]:
    """lm-eval's samples of `task` with `model`, by doc_id (the task's data read from TASKS_DIR)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    with contextlib.chdir(TASKS_DIR):  # the YAMLs name their data files relative to it
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[task],
            task_manager=manager,
            log_samples=True,
            bootstrap_iters=0,
        )
    assert out is not None
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def api_samples(url: str, model_id: str, checkpoint: Path, task: str) -> list[dict] | str:
    """The samples of `task` through the API, or why the API refused it."""
    import requests

    args = {
        "model": model_id,
        "base_url": f"{url}/v1/completions",
        "tokenizer": str(checkpoint),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,  # lm-eval's default: prompts as token-id lists
        "num_concurrent": 1,
        "max_retries": 1,
    }
    try:
        return evaluate("local-completions", args, task)
    except requests.HTTPError as exc:
        body = exc.response.text if exc.response is not None else ""
        return f"{exc} {body}".strip()


def compare(task: str, api: list[dict], hf: list[dict], atol: float) -> bool:
    """Print a line per sample; True when every sample is equal (see the module docstring)."""
    equal = len(api) == len(hf)
    for a, h in zip(api, hf, strict=False):
        if "acc" in h:
            ll_a = [float(r[0]) for r in a["filtered_resps"]]
            ll_h = [float(r[0]) for r in h["filtered_resps"]]
            close = all(math.isclose(x, y, abs_tol=atol) for x, y in zip(ll_a, ll_h, strict=True))
            same = close and a["acc"] == h["acc"] and _argmax(ll_a) == _argmax(ll_h)
            diff = max(abs(x - y) for x, y in zip(ll_a, ll_h, strict=True))
            detail = f"choice {_argmax(ll_a)} vs {_argmax(ll_h)}, max |d loglik| {diff:.2e}"
        else:
            got, want = a["filtered_resps"][0], h["filtered_resps"][0]
            same = got == want
            detail = f"api {got!r}" + ("" if same else f" hf {want!r}")
        equal &= same
        print(f"  {task} doc {a['doc_id']:>2}: {'equal' if same else 'DIFFERENT'}  {detail}")
    return equal


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    ap.add_argument(
        "--atol", type=float, default=1e-3, help="largest log-likelihood difference (nats)"
    )
    args = ap.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSONL only, never the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval  # noqa: F401
        import tenacity  # noqa: F401  (lm-eval's `api` extra: local-completions needs it)
    except ImportError:
        print("lm-eval is not installed: .venv/bin/pip install 'lm_eval[api]'", file=sys.stderr)
        return 2

    from serve_api import model_id, own_api
    from serve_daemons import own_pair

    from pdkv import models

    checkpoint = models.ensure(progress=lambda line: print(line, file=sys.stderr))
    opts = ["--device", "cpu", "--dtype", "float32", "--model", str(checkpoint)]
    api: dict[str, list[dict] | str] = {}
    with own_pair(opts, []) as sock, own_api(Path(sock).parent, sock) as url:
        served = model_id(url)
        for task in tasks:
            print(f"lm-eval local-completions -> {url}/v1/completions: {task}", file=sys.stderr)
            api[task] = api_samples(url, served, checkpoint, task)
    verdicts = {}
    for task in tasks:
        print(f"lm-eval hf ({checkpoint.name}, float32, CPU): {task}", file=sys.stderr)
        hf = evaluate(
            "hf", {"pretrained": str(checkpoint), "dtype": "float32", "device": "cpu"}, task
        )
        if isinstance(api[task], str):
            print(f"  {task}: the API refused lm-eval's requests: {api[task]}")
            verdicts[task] = "FAILED (API error)"
            continue
        equal = compare(task, api[task], hf, args.atol)  # type: ignore[arg-type]
        verdicts[task] = "equal to the HF backend" if equal else "DIFFERENT"
    for task, verdict in verdicts.items():
        print(f"{task}: {verdict}")
    return 0 if all(v.startswith("equal") for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
