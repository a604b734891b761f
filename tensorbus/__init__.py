"""tensorbus: move tensors between processes and machines over pluggable transports."""

from .api import Consumer, Producer
from .codec import Limits, Message, Reassembler, SparseTensor, decode, dumps, encode, loads, split
from .errors import (
    Aborted,
    AuthRefused,
    BadMagic,
    CallbackInterrupted,
    Cancelled,
    ChecksumMismatch,
    Closed,
    CodecError,
    ConfigError,
    InvalidTensor,
    LimitExceeded,
    MalformedHeader,
    Rejected,
    Replayed,
    SignatureError,
    StaleIncarnation,
    TensorBusError,
    Timeout,
    TransportError,
    TruncatedFrame,
    UnsupportedDtype,
    UnsupportedVersion,
)
from .fanout import Publisher, Subscriber
from .keys import ParsedKey, make_key, parse_key
from .monitoring import serve_metrics
from .rendezvous import RecvHandle, Rendezvous

__version__ = "0.1.0"

__all__ = [
    "Aborted", "AuthRefused", "BadMagic", "CallbackInterrupted", "Cancelled", "ChecksumMismatch", "Closed",
    "CodecError",
    "ConfigError", "Consumer", "InvalidTensor", "LimitExceeded", "Limits", "MalformedHeader", "Message", "ParsedKey",
    "Producer", "Publisher", "Reassembler", "RecvHandle", "Rejected", "Rendezvous", "Replayed", "SignatureError",
    "SparseTensor", "StaleIncarnation", "Subscriber",
    "TensorBusError", "Timeout", "TransportError", "TruncatedFrame", "UnsupportedDtype", "UnsupportedVersion",
    "__version__", "decode", "dumps", "encode", "loads", "make_key", "parse_key", "serve_metrics", "split",
]  # fmt: skip
