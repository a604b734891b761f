"""Nothing received is ever unpickled: checked in the source and while decoding hostile frames."""

from __future__ import annotations

import ast
import pickle
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorbus as tb

PACKAGE = Path(tb.__file__).parent
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
#: the one exception: `tensorbus bench` measures pickle-5 itself as a baseline, between its own two
#: processes, on data it generated; no tensorbus receive path imports it (the audit test below checks)
ALLOWED = {PACKAGE / "bench" / "baselines.py"}


def sources() -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_the_package_imports_no_pickle_like_module() -> None:
    offenders = []
    for path, tree in sources():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if path not in ALLOWED:
                offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
    assert not offenders, offenders


def test_every_np_load_refuses_pickles() -> None:
    offenders = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                if getattr(node.func.value, "id", None) != "np":
                    continue
                allow = [k for k in node.keywords if k.arg == "allow_pickle"]
                if not allow or not (isinstance(allow[0].value, ast.Constant) and allow[0].value.value is False):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"np.load without allow_pickle=False: {offenders}"


@pytest.fixture
def unpickling_events() -> Iterator[list[str]]:
    """Record the audit events Python raises whenever anything is unpickled or unmarshalled."""
    events: list[str] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if active[0] and event in ("pickle.find_class", "marshal.loads", "marshal.load"):
            events.append(event)

    sys.addaudithook(hook)
    yield events
    active[0] = False


def test_decoding_pickle_bearing_and_mutated_frames_unpickles_nothing(unpickling_events: list[str]) -> None:
    evil = pickle.dumps(np.arange(3))  # a pickle that would rebuild an ndarray (find_class events)
    pickle.loads(evil)
    assert unpickling_events, "the audit hook sees unpickling"
    unpickling_events.clear()
    candidates = [evil, tb.dumps(np.frombuffer(evil, np.uint8))]
    from tensorbus.codec.frame import encode_raw

    for kind in ("ndarray", "pickle", "object", "bundle"):
        header = {
            "kind": kind,
            "key": None,
            "meta": {"x": evil},
            "id": None,
            "comp": None,
            "tensors": [
                {
                    "name": "",
                    "dtype": "object",
                    "order": "|",
                    "shape": [len(evil)],
                    "fortran": False,
                    "offset": 0,
                    "nbytes": len(evil),
                }
            ],
        }
        candidates.append(b"".join(encode_raw(header, [evil], len(evil))))
    rng = random.Random(0)
    for _ in range(2000):
        data = bytearray(rng.choice(candidates))
        data[rng.randrange(len(data))] = rng.randrange(256)
        candidates.append(bytes(data))
    reassembler = tb.Reassembler()
    for data in candidates:
        for decode in (tb.decode, reassembler.feed):
            try:
                decode(data)
            except tb.CodecError:
                pass
    with tb.Consumer("memory://no-pickle") as consumer, tb.Producer("memory://no-pickle") as producer:
        for data in candidates[:200]:
            producer.transport.send([data], key=None)
        producer.send("last", np.ones(1))
        assert consumer.recv("last", timeout=10)[0] == 1
    assert unpickling_events == []
