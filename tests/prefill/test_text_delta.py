"""Streamed text: the deltas sent with each TOKENS frame add up to the decoded generation."""

from __future__ import annotations

import random

from common.model.tokenizer import ByteTokenizer
from common.sampling_params import SamplingParams
from prefill_server.output import RequestOutput
from prefill_server.request import PrefillRequest


def test_text_deltas_concatenate_to_the_full_decode_and_never_split_a_character():
    tok = ByteTokenizer()
    out = RequestOutput(tok)
    rng = random.Random(0)
    utf8 = list("héllo wörld € 𝄞 abc".encode())
    for _ in range(2000):
        alphabet = utf8 + [rng.randrange(256) for _ in range(4)] + [tok.eos_token_id]
        gen = [rng.choice(alphabet) for _ in range(rng.randrange(1, 40))]
        req = PrefillRequest("r", [1], SamplingParams())
        deltas = []
        for t in gen:
            req.generated.append(t)
            deltas.append(out.text_delta(req, final=False))
        deltas.append(out.text_delta(req, final=True))
        full = tok.decode(gen)
        assert "".join(deltas) == full
        # a delta is never taken back (a character split across tokens is held until it
        # completes, not sent as U+FFFD): every text so far is a prefix of the whole
        assert all(full.startswith("".join(deltas[:k])) for k in range(len(deltas)))


def test_a_request_that_never_streamed_is_decoded_once_at_the_end():
    tok = ByteTokenizer()
    out = RequestOutput(tok)
    req = PrefillRequest("r", [1], SamplingParams(), stream=False)
    req.generated.extend("€ and 🚀".encode())
    assert out.tokens(req, req.generated).text == ""
    assert out.text_delta(req, final=True) == "€ and 🚀"
    assert req.text is None  # no detokenizer was made for it
