"""Chat templates render the text and the ids transformers' apply_chat_template renders (the
template's text tokenized without the tokenizer's special tokens), and the default template is the
documented one, sent as text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api_server.chat import DEFAULT_TEMPLATE, ChatTemplate, TemplateError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# A Llama-2-style template: BOS, a system message folded into the first user turn, loop
# controls, raise_exception on a bad role order, and tojson.
LLAMA2_STYLE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = false %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n'"
    " + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% if message.get('name') %}{% continue %}{% endif %}"
    "{% endfor %}{{ '' | tojson }}"
)
MESSAGES = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Hello  there"},
    {"role": "assistant", "content": "Bonjour"},
    {"role": "user", "content": "Ça va ?"},
]


def write_checkpoint_tokenizer(path: Path, template: str | None) -> None:
    """A word-level tokenizer.json whose post-processor puts BOS first, and its config."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "Bonjour": 4, "INST": 5, "[": 6, "]": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "</s>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        },
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_checkpoint_template_renders_as_transformers(tmp_path: Path) -> None:
    write_checkpoint_tokenizer(tmp_path, LLAMA2_STYLE)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ours = ChatTemplate.for_model(tmp_path).render(MESSAGES)
    assert theirs.startswith("<s>[INST] <<SYS>>")
    assert ours == theirs


def hf_chat_ids(hf, messages: list[dict]) -> list[int]:
    """transformers' `apply_chat_template(tokenize=True)` ids (a list, or in a BatchEncoding)."""
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize(
    ("template", "bos_count"),
    [(LLAMA2_STYLE, 2), ("{% for m in messages %}{{ m['content'] + ' ' }}{% endfor %}", 0)],
    ids=["template-writes-bos", "template-without-bos"],
)
def test_checkpoint_template_ids_are_transformers_ids(
    tmp_path: Path, template: str, bos_count: int
) -> None:
    """The template alone decides the special tokens, though the tokenizer adds BOS to a prompt:
    one BOS per user turn where the template writes `bos_token`, none where it does not."""
    write_checkpoint_tokenizer(tmp_path, template)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.encode("hello")[0] == 1  # the tokenizer on its own adds BOS
    for messages in (MESSAGES, MESSAGES[1:3]):
        prompt, ids = ChatTemplate.for_model(tmp_path).prompt(messages)
        assert prompt is None
        assert ids == hf_chat_ids(hf, messages)
    assert ids.count(1) == (1 if bos_count else 0)  # MESSAGES[1:3] has one user turn
    assert ChatTemplate.for_model(tmp_path).prompt(MESSAGES)[1].count(1) == bos_count


def test_template_errors_are_template_errors(tmp_path: Path) -> None:
    write_checkpoint_tokenizer(tmp_path, LLAMA2_STYLE)
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate.for_model(tmp_path).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_checkpoint_without_template_and_tiny_model_use_the_default(tmp_path: Path) -> None:
    write_checkpoint_tokenizer(tmp_path, None)
    for template in (ChatTemplate.for_model(tmp_path), ChatTemplate.for_model(None)):
        assert template.is_default
        text = "<|system|>\nAnswer in French.\n<|user|>\nHello  there\n<|assistant|>\n"
        assert template.render(MESSAGES[:2]) == text
        assert template.prompt(MESSAGES[:2]) == (text, None)  # the daemons encode it, BOS first
    assert ChatTemplate(DEFAULT_TEMPLATE).is_default


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    write_checkpoint_tokenizer(tmp_path, None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.for_model(tmp_path).render(MESSAGES) == "D"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert ChatTemplate.for_model(tmp_path).render(MESSAGES) == "4"


# Qwen2.5's ChatML template (its tools branch cut to a refusal): a default system message when the
# conversation has none, no BOS, <|im_end|> closing each turn.
QWEN_CHATML = (
    "{%- if tools %}{{ raise_exception('no tools here') }}{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen_chatml_template_with_a_default_system_renders_as_transformers(
    tmp_path: Path,
) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = ["system", "user", "assistant", "You", "are", "Qwen", "hello", "Bonjour", "<unk>"]
    vocab = {t: i for i, t in enumerate([*specials, *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": QWEN_CHATML,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in (MESSAGES, MESSAGES[1:3]):
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ChatTemplate.for_model(tmp_path).render(messages) == theirs
        prompt, ids = ChatTemplate.for_model(tmp_path).prompt(messages)
        assert prompt is None
        assert ids == hf_chat_ids(hf, messages)
    assert theirs.startswith("<|im_start|>system\nYou are Qwen")  # the default system message
    assert ids.count(vocab["<|im_start|>"]) == 4 and ids[-1] != vocab["<|im_end|>"]
