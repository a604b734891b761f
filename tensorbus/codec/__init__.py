"""The frame codec: tensors to scatter-gather buffers and back, checksummed, chunkable."""

from .chunking import Reassembler, encode_chunks, split
from .frame import DEFAULT_LIMITS, Frame, Limits, Message, MessageId, decode, dumps, encode, loads, parse
from .tensors import SparseTensor

__all__ = [
    "DEFAULT_LIMITS",
    "Frame",
    "Limits",
    "Message",
    "MessageId",
    "Reassembler",
    "SparseTensor",
    "decode",
    "dumps",
    "encode",
    "encode_chunks",
    "loads",
    "parse",
    "split",
]
