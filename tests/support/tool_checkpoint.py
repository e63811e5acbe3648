"""A checkpoint for the tool-calling tests: a random Qwen2 model (save_hf_model) with a byte-level
tokenizer that can spell any text (JSON included) and Qwen2.5's ChatML template with its tools
branch (qwen2_5_chat_template.jinja, written for these tests after Qwen2.5-Instruct's).

Ids: 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>` (EOS, the model's eos_token_id), 3..258
the 256 bytes, then `<tool_call>` and `</tool_call>` as added tokens that are not special (as in
Qwen's tokenizer: they stay in the text), then unused added tokens up to the model's 300 ids.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tokenizers

from tests.support.api import Stack, short_runtime, start_api
from tests.support.checkpoints import save_hf_model
from tests.support.daemons import Pair

TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKERS = ["<tool_call>", "</tool_call>"]
VOCAB = 300


def write_byte_tokenizer(path: Path, template: str = TEMPLATE) -> tokenizers.Tokenizer:
    """tokenizer.json and tokenizer_config.json (with `template`) in `path`."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([*SPECIALS, *alphabet])}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    extra = [f"<|unused_{i}|>" for i in range(VOCAB - len(vocab) - len(TOOL_MARKERS))]
    tok.add_tokens([tokenizers.AddedToken(t, special=False) for t in [*TOOL_MARKERS, *extra]])
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def write_tool_checkpoint(path: Path, template: str = TEMPLATE, max_positions: int = 2048) -> Path:
    """The random Qwen2 checkpoint with the byte tokenizer and `template`, in `path`, with room
    for `max_positions` (a byte per token: Qwen's tools prompt alone is ~700)."""
    path.mkdir(parents=True, exist_ok=True)
    save_hf_model(path, "qwen2")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (path / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(path, template)
    return path


@contextlib.contextmanager
def tool_stack(factory: pytest.TempPathFactory, name: str) -> Iterator[Stack]:
    """Both daemons on a tool checkpoint named `name` (its model id); the API follows them."""
    ckpt = write_tool_checkpoint(factory.mktemp("ckpt") / name)
    pair = Pair(short_runtime(factory))
    pair.extra = {role: ["--model", str(ckpt)] for role in ("decode", "prefill")}
    try:
        pair.start("decode")
        pair.start("prefill")
        api = start_api(pair.runtime)
        yield Stack(pair, api)
        assert api.stop() == 0
    finally:
        pair.kill_all()


MODEL = "qwen-tools"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time"}},
]


def hf_ids(ckpt: Path, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """transformers' ids of the chat, arguments as objects (what its templates expect), and the
    tool message with its call's function name (as the API adds it)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    chat = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        if m["role"] == "tool":
            m["name"] = "get_weather"
        chat.append(m)
    out = hf.apply_chat_template(chat, tools=tools, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
