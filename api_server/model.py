"""The model this API serves, as the daemons name it in their STATUS (`model_card`).

Without `--model` the API follows the daemons: their checkpoint directory gives it the chat
template and the tokenizer it counts prompts with, their card the context length and the name
(`--served-model-name` replaces the name). With `--model DIR` it serves only DIR: daemons
serving anything else are a mismatch, refused (exit 3 at start, 503 `model_mismatch` later).
The checkpoint directory is read at the path the daemons report, so an API in another
container mounts it at the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from api_server.chat import ChatTemplate, TemplateError
from api_server.config import ApiConfig
from api_server.tokens import PromptCounter
from common.errors import PdkvError
from common.protocol import ModelCard


class Unservable(PdkvError):
    """The daemons' model cannot be served by this API; the message says why and what to do."""


@dataclass(frozen=True)
class ServedModel:
    """What the API needs of the daemons' model for one request."""

    id: str
    card: ModelCard
    template: ChatTemplate
    counter: PromptCounter

    @property
    def max_positions(self) -> int:
        return self.card.max_positions

    def listing(self, created: int) -> dict[str, object]:
        """The model's object in GET /v1/models."""
        return {"id": self.id, "object": "model", "created": created, "owned_by": "pdkv"}


def describe(card: ModelCard) -> str:
    return f"the checkpoint {card.path}" if card.path else "the built-in tiny model"


def served_model(card: ModelCard | None, cfg: ApiConfig) -> ServedModel:
    """The model to serve in front of daemons that report `card`; Unservable when it is not
    `--model`, or when its checkpoint directory cannot be read here."""
    if card is None:
        raise Unservable("the prefill daemon's STATUS names no model (a pdkv of another version?)")
    path = Path(card.path) if card.path else None
    if cfg.model is not None and path != cfg.model.resolve():
        raise Unservable(
            f"the daemons serve {describe(card)}, not --model {cfg.model}: start the API with "
            "the daemons' --model, or without --model to follow the daemons"
        )
    if path is not None and not path.is_dir():
        raise Unservable(
            f"the daemons serve the checkpoint {path}, which is not a directory here: the API "
            "reads its chat template and tokenizer there (mount it at the same path)"
        )
    try:
        template = ChatTemplate.for_model(path)
        counter = PromptCounter(path)
    except TemplateError as exc:
        raise Unservable(str(exc)) from None
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise Unservable(f"cannot read {path}/tokenizer.json: {exc}") from None
    return ServedModel(cfg.served_model_name or card.name, card, template, counter)
