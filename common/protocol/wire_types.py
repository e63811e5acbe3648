"""What every message of the wire protocol is built from: bounded field types, the frame types,
the error codes and the Message base (its TYPE is the frame type). No message lives here:
link_setup.py holds the link's set-up messages, messages.py the rest and the catalogue.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

import msgspec

NonNeg = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Nonce = Annotated[str, msgspec.Meta(max_length=128)]
Proof = Annotated[str, msgspec.Meta(max_length=128)]


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_OK = 2
    REGISTER = 3
    REGISTERED = 4
    HANDOFF = 5
    RELEASE = 6
    TOKENS = 7
    FINISH = 8
    ABORT = 9
    ERROR = 10
    PING = 11
    PONG = 12
    PUSH = 13  # v3
    PUSH_FAILED = 14  # v3
    KV_READY = 15  # v5
    STEP_TOKENS = 16  # v10
    KV_LAUNCHED = 17  # v12
    GENERATE = 20
    STATUS = 21
    STATUS_REPLY = 22


class ErrorCode(enum.StrEnum):
    CACHE_NOT_EXIST = "CACHE_NOT_EXIST"
    WAIT_TIMEOUT = "WAIT_TIMEOUT"
    NO_CAPACITY = "NO_CAPACITY"
    BAD_REQUEST = "BAD_REQUEST"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    INCOMPATIBLE = "INCOMPATIBLE"
    LINK_LOST = "LINK_LOST"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    NUMERIC_ERROR = "NUMERIC_ERROR"  # v2: this request's logits were not finite / not drawable
    AUTH_FAILED = "AUTH_FAILED"  # v3: a TCP link's key proof is missing or wrong


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every message; TYPE is its frame type."""

    TYPE: ClassVar[MsgType]
