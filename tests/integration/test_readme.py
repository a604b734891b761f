"""README.md's code runs as shown, after its first set-up command (`pip install -e .`: no extras).

Every ```python block runs on its own, in a fresh interpreter in an empty directory, with the
optional extras hidden; a block that needs a second process belongs in a file under examples/,
and a ```bash block that names such files is run as written (one shell, a free port given to each
example, a bounded time).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
EXAMPLE = re.compile(r"\bexamples/\w+\.py\b")
#: modules of the optional extras (pyproject.toml's optional-dependencies), which the first set-up command leaves out
EXTRAS = ("lz4", "zstandard", "torch", "pika", "kafka", "rich", "matplotlib", "zmq", "pyarrow", "safetensors",
          "prometheus_client", "opentelemetry", "uvloop")  # fmt: skip
HIDE_EXTRAS = f"import sys; sys.modules.update(dict.fromkeys({EXTRAS!r}))\n"
#: how long a block or an example may take
BOUND_S = 120


def blocks(language: str, text: str | None = None) -> list[str]:
    """The code of every fenced block of `language` in the README (or in `text`)."""
    return [code for lang, code in BLOCK.findall(README.read_text() if text is None else text) if lang == language]


def example_scripts(text: str | None = None) -> list[str]:
    """The ```bash blocks that run files of examples/."""
    return [code for code in blocks("bash", text) if EXAMPLE.search(code)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def env() -> dict[str, str]:
    """This checkout's tensorbus on the path, as `pip install -e .` puts it there."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def as_run_here(script: str, url: str) -> str:
    """A README shell block as it runs in this test: this interpreter for `.venv/bin/python` (or `python3`),
    and `url` for the examples' endpoint (the default port may be taken by someone else on this machine)."""
    python = shlex.quote(sys.executable)
    script = re.sub(r"(?<![\w/.-])(\.venv/bin/python3?|python3?)(?=\s)", python, script)
    script = re.sub(rf"({EXAMPLE.pattern})(?:[ \t]+\w+://[^\s;&|]+)?", rf"\1 {url}", script)
    return script.rstrip("\n") + "\nwait\n"


def run_example(name: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / name), url],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


#: the pages of docs/ whose ```python blocks run on their own, as the README's do
DOC_PAGES = ("FORMAT.md", "DELIVERY.md")
DOC_BLOCKS = [(page, code) for page in DOC_PAGES for code in blocks("python", (ROOT / "docs" / page).read_text())]


@pytest.mark.parametrize("page, code", DOC_BLOCKS, ids=[f"{page}-{i}" for i, (page, _) in enumerate(DOC_BLOCKS)])
def test_every_python_block_of_the_pages_that_carry_examples_runs(page: str, code: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", HIDE_EXTRAS + code],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=BOUND_S,
    )  # fmt: skip
    assert result.returncode == 0, f"docs/{page} python block:\n{code}\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_every_python_block_of_the_readme_runs_on_its_own(index: int, tmp_path: Path) -> None:
    code = blocks("python")[index]
    result = subprocess.run(
        [sys.executable, "-c", HIDE_EXTRAS + code],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=BOUND_S,
    )  # fmt: skip
    assert result.returncode == 0, f"README python block {index + 1}:\n{code}\n{result.stdout}{result.stderr}"


def test_every_shell_block_that_runs_examples_runs() -> None:
    scripts = example_scripts()
    named = {name for script in scripts for name in EXAMPLE.findall(script)}
    assert {"examples/consumer.py", "examples/producer.py"} <= named, "README.md shows no way to run both examples"
    assert all((ROOT / name).is_file() for name in named), named
    for script in scripts:
        result = subprocess.run(
            ["bash", "-e", "-c", as_run_here(script, f"tcp://127.0.0.1:{free_port()}")],
            cwd=ROOT, env=env(), capture_output=True, text=True, timeout=BOUND_S,
        )  # fmt: skip
        assert result.returncode == 0, f"README bash block:\n{script}\n{result.stdout}{result.stderr}"
        if "examples/consumer.py" in script:
            assert "done: [0, 1, 2]" in result.stdout, result.stdout + result.stderr


def test_the_example_consumer_prints_what_the_example_producer_sent() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    consumer = run_example("consumer.py", url)
    assert consumer.stdout is not None
    assert consumer.stdout.readline().startswith(f"listening on {url}")
    producer = run_example("producer.py", url)
    produced, _ = producer.communicate(timeout=BOUND_S)
    consumed, _ = consumer.communicate(timeout=BOUND_S)
    assert producer.returncode == 0 and consumer.returncode == 0, produced + consumed
    assert consumed.splitlines() == [
        "layer1/w: float32 (1024, 1024), sum 1.04858e+06",
        "params: a bundle of ['b', 'w'], metadata {'step': 7}",
        "grad: sparse (4, 4), 2 values, dense sum -0.5",
        "done: [0, 1, 2]",
    ]
    assert produced.strip() == "sent layer1/w, params, grad and done"


def test_a_shell_block_runs_the_examples_with_this_interpreter_on_the_given_url() -> None:
    script = (
        ".venv/bin/python examples/consumer.py &\n"
        "python3 examples/producer.py  # then this\n"
        ".venv/bin/python examples/producer.py unix:///tmp/x.sock; wait\n"
    )
    ran = as_run_here(script, "tcp://127.0.0.1:1234")
    python = shlex.quote(sys.executable)
    assert ran.splitlines() == [
        f"{python} examples/consumer.py tcp://127.0.0.1:1234 &",
        f"{python} examples/producer.py tcp://127.0.0.1:1234  # then this",
        f"{python} examples/producer.py tcp://127.0.0.1:1234; wait",
        "wait",
    ]


def test_the_sparse_example_cannot_be_read_in_the_other_layout() -> None:
    """SparseTensor's indices are (nnz, ndim), torch's (ndim, nnz): the README's example must say which, and
    have nnz != ndim so that following it the other way round fails instead of transposing the values."""
    line = next(line for line in blocks("python")[0].splitlines() if "indices, values =" in line)
    assert "(nnz, ndim)" in line
    indices, values = eval(line.split("=", 1)[1].split("#")[0], {"np": np})  # (the README's own code)
    assert indices.shape == (len(values), 2) and indices.shape[0] != indices.shape[1]
