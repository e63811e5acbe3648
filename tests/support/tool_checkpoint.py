"""A checkpoint for the tool-calling tests: a random Qwen2 model (save_hf_model) with a byte-level
tokenizer that can spell any text (JSON included) and Qwen2.5's ChatML template with its tools
branch (qwen2_5_chat_template.jinja, written for these tests after Qwen2.5-Instruct's).

Ids: 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>` (EOS, the model's eos_token_id), 3..258
the 256 bytes, then `<tool_call>` and `</tool_call>` as added tokens that are not special (as in
Qwen's tokenizer: they stay in the text), then unused added tokens up to the model's 300 ids.

MISTRAL_V11: a random Mistral model whose tokenizer has, as Mistral's v11 on, `[TOOL_CALLS]`,
`[ARGS]` and `[CALL_ID]` as special tokens (ids 3, 4, 5 after `<unk>`, `<s>`, `</s>`), and a
template that writes calls as `[TOOL_CALLS]name[ARGS]{...}` (written for these tests in the
shape of Mistral-Small-3.x's).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from tests.support.api import Stack, short_runtime, start_api
from tests.support.checkpoints import save_hf_model
from tests.support.daemons import Pair

TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKERS = ["<tool_call>", "</tool_call>"]
VOCAB = 300


@dataclass(frozen=True)
class Vocab:
    """A byte tokenizer's special tokens (ids 0.. in order; id 2 the EOS), its added tokens
    that are not special, and the special-token names of tokenizer_config.json."""

    specials: tuple[str, ...] = tuple(SPECIALS)
    added: tuple[str, ...] = tuple(TOOL_MARKERS)
    names: tuple[tuple[str, str | None], ...] = (
        ("bos_token", None),
        ("eos_token", "<|im_end|>"),
        ("pad_token", "<|endoftext|>"),
    )


QWEN = Vocab()
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
MISTRAL_V11 = Vocab(
    specials=MISTRAL_SPECIALS,
    added=(),
    names=(("bos_token", "<s>"), ("eos_token", "</s>"), ("unk_token", "<unk>")),
)
MISTRAL_V11_TEMPLATE = (Path(__file__).parent / "mistral_v11_chat_template.jinja").read_text()


def write_byte_tokenizer(
    path: Path, template: str = TEMPLATE, vocab_spec: Vocab = QWEN
) -> tokenizers.Tokenizer:
    """tokenizer.json and tokenizer_config.json (with `template`) in `path`."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([*vocab_spec.specials, *alphabet])}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(list(vocab_spec.specials))
    extra = [f"<|unused_{i}|>" for i in range(VOCAB - len(vocab) - len(vocab_spec.added))]
    added = [*vocab_spec.added, *extra]
    tok.add_tokens([tokenizers.AddedToken(t, special=False) for t in added])
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(path / "tokenizer.json"))
    config = {
        **dict(vocab_spec.names),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def write_tool_checkpoint(
    path: Path,
    template: str = TEMPLATE,
    max_positions: int = 2048,
    family: str = "qwen2",
    vocab: Vocab = QWEN,
) -> Path:
    """The random `family` checkpoint with the byte tokenizer of `vocab` and `template`, in
    `path`, with room for `max_positions` (a byte per token: Qwen's tools prompt alone is
    ~700)."""
    path.mkdir(parents=True, exist_ok=True)
    save_hf_model(path, family)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (path / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(path, template, vocab)
    return path


@contextlib.contextmanager
def tool_stack(factory: pytest.TempPathFactory, name: str, **checkpoint: Any) -> Iterator[Stack]:
    """Both daemons on a tool checkpoint named `name` (its model id; `checkpoint`: as
    write_tool_checkpoint takes them); the API follows them."""
    ckpt = write_tool_checkpoint(factory.mktemp("ckpt") / name, **checkpoint)
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


def logprob_entries(logprobs: object) -> list[tuple[str, float, list]]:
    """(token, logprob, its top alternatives) of each entry of a chat logprobs object."""
    content = getattr(logprobs, "content", None) or []
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def streamed_entries(api, kw: dict) -> tuple[list, str, list]:  # type: ignore[no-untyped-def]
    """(the entries of every chunk in order, the content, the calls' names) of `kw` streamed."""
    got, content, names = [], "", []
    for chunk in api.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            got += logprob_entries(choice.logprobs)
            content += choice.delta.content or ""
            names += [p.function.name for p in choice.delta.tool_calls or [] if p.id is not None]
    return got, content, names
