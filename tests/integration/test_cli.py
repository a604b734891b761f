"""The tensorbus command through its entry point, in subprocesses: every command and its error paths."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import tensorbus as tb
from tensorbus.files import read_tensor
from tests.conftest import endpoint_url

ROOT = Path(__file__).parents[2]


def tensorbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorbus", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def listen(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start a listening command (recv, save) on a free port; return it and the address it printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorbus", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert " on " in line, line + process.stderr.read() if process.stderr else line
    return process, line.rsplit(" on ", 1)[1].strip()


def finish(process: subprocess.Popen[str]) -> str:
    """Wait for a listening command, close its pipes, fail with its stderr if it failed."""
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return out


@pytest.mark.parametrize("command", [[], ["demo"], ["send"], ["recv"], ["save"], ["inspect"], ["bench"]])
def test_help(command: list[str]) -> None:
    result = tensorbus(*command, "--help")
    assert result.returncode == 0 and "usage: tensorbus" in result.stdout


def test_demo() -> None:
    result = tensorbus("demo")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("checksum ok") == 3


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors", ".tbf"])
def test_send_and_recv_each_format(tmp_path: Path, suffix: str) -> None:
    source = tmp_path / f"in{suffix}"
    tensor: object
    if suffix == ".npy":
        tensor = np.arange(12, dtype=np.float32).reshape(3, 4)
        np.save(source, tensor)
    elif suffix == ".npz":
        tensor = {"w": np.ones((2, 2)), "b": np.arange(3)}
        np.savez(source, **tensor)
    elif suffix == ".safetensors":
        tensor = {"layer.weight": np.eye(3, dtype=np.float32)}
        save_file(tensor, str(source))
    else:
        tensor = np.full(5, 7, np.int16)
        source.write_bytes(tb.dumps(tensor))
    output = tmp_path / f"out{suffix}"
    receiver, address = listen("recv", "tcp://127.0.0.1:0", "k", "-o", str(output), "--timeout", "30")
    sent = tensorbus("send", address, "k", str(source))
    assert sent.returncode == 0, sent.stderr
    finish(receiver)
    got = read_tensor(output)
    if isinstance(tensor, dict):
        assert got.keys() == tensor.keys() and all(np.array_equal(got[k], tensor[k]) for k in tensor)
    else:
        assert np.array_equal(got, tensor) and got.dtype == tensor.dtype


def test_save_follow_keeps_every_version_atomically(tmp_path: Path) -> None:
    saver, address = listen(
        "save",
        "tcp://127.0.0.1:0",
        "params",
        "-o",
        str(tmp_path / "p.safetensors"),
        "--follow",
        "--max-versions",
        "3",
        "--timeout",
        "30",
    )
    with tb.Producer(address) as producer:
        for step in range(3):
            producer.send("params", {"w": np.full((4, 4), step, np.float32)})
    assert finish(saver).count("saved") == 3
    for version in range(1, 4):
        saved = read_tensor(tmp_path / f"p-{version:06d}.safetensors")
        assert np.array_equal(saved["w"], np.full((4, 4), version - 1, np.float32))
    assert not list(tmp_path.glob(".*"))  # no temp files left behind


def test_inspect_prints_headers_and_checksum_status(tmp_path: Path) -> None:
    frames = tmp_path / "frames.tbf"
    frames.write_bytes(
        tb.dumps(np.zeros((2, 3), np.float32), key="a", metadata={"m": 1}) + tb.dumps({"w": np.ones(4)}, key="b")
    )
    result = tensorbus("inspect", str(frames))
    assert result.returncode == 0, result.stderr
    assert (
        "key='a'" in result.stdout
        and "float32 < shape=[2, 3]" in result.stdout
        and "metadata: {'m': 1}" in result.stdout
    )
    assert "kind=bundle" in result.stdout and result.stdout.count("checksum ok") == 2
    corrupt = bytearray(frames.read_bytes())
    corrupt[-1] ^= 1
    frames.write_bytes(bytes(corrupt))
    result = tensorbus("inspect", str(frames))
    assert "checksum BAD" in result.stdout and result.stdout.count("checksum ok") == 1
    assert result.returncode == 1 and "1 of 2 frames failed their checks" in result.stderr  # scripts can tell


def test_inspect_refuses_an_empty_file_and_names_a_file_that_holds_no_frames(tmp_path: Path) -> None:
    (tmp_path / "empty.tbf").write_bytes(b"")
    one_line_error(tensorbus("inspect", str(tmp_path / "empty.tbf")), "empty", "no frames", status=1)
    np.save(tmp_path / "w.npy", np.ones(2))
    one_line_error(tensorbus("inspect", str(tmp_path / "w.npy")), "is not a file of tensorbus frames", status=1)


def test_output_cut_off_by_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    frames = tmp_path / "many.tbf"
    frames.write_bytes(tb.dumps(np.zeros(1), key="k") * 5000)  # far more output than a pipe buffers
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorbus", "inspect", str(frames)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith("frame 0")
    process.stdout.close()  # as `| head -1` does
    assert process.wait(timeout=60) == 141  # 128 + SIGPIPE, as a shell reports it for any tool
    with process.stderr:
        assert process.stderr.read() == ""


def test_arguments_are_checked_by_the_command_they_belong_to(tmp_path: Path) -> None:
    out = str(tmp_path / "x.npy")
    result = tensorbus("recv", "tcp://127.0.0.1:0", "k", "-o", out, "--timout", "1")
    assert result.returncode == 2 and "usage: tensorbus recv" in result.stderr and "--timout" in result.stderr
    result = tensorbus("recv", "tcp://127.0.0.1:0", "k", "-o", out, "--timeout", "abc")
    assert result.returncode == 2 and "invalid seconds value: 'abc'" in result.stderr
    result = tensorbus("save", "tcp://127.0.0.1:0", "k", "-o", str(tmp_path / "p.npz"), "--max-versions", "2")
    assert result.returncode == 2 and "--max-versions goes with --follow" in result.stderr
    subscribed = ("save", "tcp://127.0.0.1:1", "k", "-o", str(tmp_path / "p.npz"), "--subscribe", "--timeout", "1")
    result = tensorbus(*subscribed, "--metrics-port", "0")  # (refused, not accepted and silently not served)
    assert result.returncode == 2 and "--metrics-port does not go with --subscribe" in result.stderr
    np.save(out, np.ones(2))
    result = tensorbus("send", "-v", "tcp://127.0.0.1:1?reconnect_timeout_s=0.5", "k", out)  # -v after the command
    assert result.returncode == 2 and "INFO connect to tcp://127.0.0.1:1 failed" in result.stderr
    (tmp_path / "d.npy").mkdir()
    one_line_error(tensorbus("recv", "tcp://127.0.0.1:0", "k", "-o", str(tmp_path / "d.npy")), "is a directory")
    (tmp_path / "text.npy").write_text("not numpy")
    one_line_error(tensorbus("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "text.npy")), "never unpickled")


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str, status: int = 2) -> None:
    assert result.returncode == status, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def side_by_side(*commands: tuple[str, ...], timeout: float = 60) -> list[subprocess.CompletedProcess[str]]:
    """Run each command as `tensorbus` does, all at once: a command's start (~0.3 s) is most of its time."""
    processes: list[subprocess.Popen[str]] = []
    try:  # (each prints a line or two: no pipe fills while an earlier one is waited for)
        for args in commands:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tensorbus", *args],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
            )
        outputs = [process.communicate(timeout=timeout) for process in processes]
        return [
            subprocess.CompletedProcess(process.args, process.returncode, *output)
            for process, output in zip(processes, outputs, strict=True)
        ]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


def test_errors_are_one_line(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones(2))
    x = str(tmp_path / "x.npy")
    (tmp_path / "bad.tbf").write_bytes(b"not a frame at all, just text")
    (tmp_path / "cut.tbf").write_bytes(tb.dumps(np.ones(64))[:-8])  # a frame cut short
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    cases: list[tuple[tuple[str, ...], tuple[str, ...], int]] = [  # (command, what its one line says, exit status)
        (("send", "tpc://127.0.0.1:1", "k", x), ("did you mean 'tcp'",), 2),
        (
            ("send", "amqp://guest:guest@127.0.0.1:1/%2F?queue=q&reconnect_timeout_s=1", "k", x),
            ("TransportError",),
            2,
        ),
        (
            ("send", "tcp://127.0.0.1:1?reconnect_timeout_s=1", "k", x),
            ("cannot connect", "reconnect_timeout_s=1 bounds them"),
            2,
        ),
        (("recv", "tcp://127.0.0.1:0", "k", "-o", str(tmp_path / "y.npy"), "--timeout", "0.5"), ("Timeout", "'k'"), 2),
        (("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "missing.npy")), ("missing.npy",), 2),
        (("inspect", str(tmp_path / "bad.tbf")), ("BadMagic",), 1),
        (("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "bad.tbf")), ("BadMagic", "bad.tbf"), 2),
        (("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "cut.tbf")), ("Truncated", "cut.tbf"), 2),
        (("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "x.csv")), ("cannot tell the format",), 2),
        (("send", "tcp://127.0.0.1", "k", x), ("needs a port",), 2),
        (("send", "tcp://127.0.0.1:99999", "k", x), ("bad port",), 2),
        (("send", "amqp://guest:guest@127.0.0.1:abc/%2F?queue=q", "k", x), ("bad port",), 2),
        (("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "objects.npy")), ("cannot read",), 2),
        (("send", "tcp://127.0.0.1:1", "k", str(tmp_path / "bad.safetensors")), ("cannot read",), 2),
        (("demo", "--url", "memory://demo"), ("memory://",), 2),
    ]
    bad_timeouts = [("recv", "tcp://127.0.0.1:0", "k", "-o", x, "--timeout", bad) for bad in ("nan", "-1")]
    started = time.monotonic()
    results = side_by_side(*(command for command, _, _ in cases), *bad_timeouts)
    assert time.monotonic() - started < 60  # (the timed-out recv among them: its timeout, not a hang)
    for (_, needles, status), result in zip(cases, results[: len(cases)], strict=True):
        one_line_error(result, *needles, status=status)
    for result in results[len(cases) :]:
        assert result.returncode == 2 and "seconds" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.broker
def test_credentials_the_broker_refuses_are_a_one_line_error(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones(2))
    parts = urllib.parse.urlsplit(endpoint_url("amqp"))
    wrong = parts._replace(
        netloc=f"guest:wrong@{parts.hostname}:{parts.port}", query=f"{parts.query}&reconnect_timeout_s=1"
    )
    one_line_error(
        tensorbus("send", urllib.parse.urlunsplit(wrong), "k", str(tmp_path / "x.npy")),
        "TransportError",
        "refused the credentials",
    )


@pytest.mark.broker
def test_recv_checks_its_output_before_taking_the_tensor_off_a_broker(tmp_path: Path) -> None:
    url = endpoint_url("amqp")
    with tb.Producer(url) as producer:
        producer.send("k", np.arange(5.0))
        producer.flush(30)
    one_line_error(tensorbus("recv", url, "k", "-o", str(tmp_path / "out.txt"), "--timeout", "5"), "format")
    one_line_error(tensorbus("recv", url, "k", "-o", str(tmp_path / "none" / "y.npy"), "--timeout", "5"), "writable")
    one_line_error(tensorbus("save", url, "k", "-o", str(tmp_path / "p.npy"), "--timeout", "5"), "bundle")
    result = tensorbus("recv", url, "k", "-o", str(tmp_path / "ok.npy"), "--timeout", "30")
    assert result.returncode == 0, result.stderr
    assert np.array_equal(np.load(tmp_path / "ok.npy"), np.arange(5.0))
    assert (tmp_path / "ok.npy").stat().st_mode & 0o777 == 0o666 & ~_umask()  # not mkstemp's private 0600


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_tensor_the_output_format_cannot_hold_is_written_as_a_frame_not_lost(tmp_path: Path) -> None:
    receiver, address = listen(
        "recv", "tcp://127.0.0.1:0", "k", "-o", str(tmp_path / "one.npy"), "--timeout", "30", "--tbf-fallback"
    )
    with tb.Producer(address) as producer:
        producer.send("k", {"w": np.ones(3), "b": np.zeros(2)}, metadata={"step": 4})  # a bundle: not for .npy
    assert "one.tbf" in finish(receiver)
    message = tb.decode((tmp_path / "one.tbf").read_bytes())
    assert message.key == "k" and message.metadata == {"step": 4} and set(message.tensor) == {"w", "b"}


@pytest.mark.parametrize("command", ["recv", "save", "save --subscribe"])
def test_a_fallback_never_replaces_a_file_and_fails_unless_allowed(tmp_path: Path, command: str) -> None:
    """`recv -o model.npz` (or `save`, or `save --subscribe`) of a bfloat16 tensor, which .npz cannot describe: an
    existing model.tbf (the user's, not named) stays as it was, the tensor goes to model-1.tbf, and the exit status
    is 2 since the file asked for was not written; with --tbf-fallback, the next goes to model-2.tbf and it is 0."""
    (tmp_path / "model.tbf").write_bytes(b"the user's own file")
    bundle = {"w": np.arange(4).astype(ml_dtypes.bfloat16)}
    for n, flags in enumerate([(), ("--tbf-fallback",)], start=1):
        args = (*command.split(), "k", "-o", str(tmp_path / "model.npz"), "--timeout", "30", *flags)
        if command == "save --subscribe":
            with tb.Publisher("tcp://127.0.0.1:0") as pub:
                pub.publish("k", bundle, version=n, metadata={"step": 4})
                result = tensorbus(args[0], pub.address, *args[1:])
            status, err = result.returncode, result.stderr
        else:
            receiver, address = listen(args[0], "tcp://127.0.0.1:0", *args[1:])
            with tb.Producer(address) as producer:
                producer.send("k", bundle, metadata={"step": 4})
            _, err = receiver.communicate(timeout=60)
            status = receiver.returncode
        assert status == (2 if n == 1 else 0), err
        assert f"model-{n}.tbf" in err and ("--tbf-fallback" in err) == (n == 1), err
        assert tb.decode((tmp_path / f"model-{n}.tbf").read_bytes()).metadata["step"] == 4
    assert (tmp_path / "model.tbf").read_bytes() == b"the user's own file" and not (tmp_path / "model.npz").exists()


def test_a_restarted_save_follow_numbers_on_instead_of_overwriting(tmp_path: Path) -> None:
    for run in range(2):
        saver, address = listen(
            "save", "tcp://127.0.0.1:0", "params", "-o", str(tmp_path / "p.npz"), "--follow", "--max-versions", "2",
            "--timeout", "30",
        )  # fmt: skip
        with tb.Producer(address) as producer:
            for step in range(2):
                producer.send("params", {"w": np.full(3, 10 * run + step)})
        finish(saver)
    for version, value in zip(range(1, 5), (0, 1, 10, 11), strict=True):
        assert read_tensor(tmp_path / f"p-{version:06d}.npz")["w"].tolist() == [value] * 3


@pytest.mark.parametrize("example", ["param_streaming.py", "mapreduce.py"])
@pytest.mark.parametrize("transport", ["tcp://127.0.0.1:0", "unix"])
def test_examples_run_as_is(example: str, transport: str, tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/example.sock" if transport == "unix" else transport
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--url", url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": True" in result.stdout


def test_a_recv_that_times_out_names_the_keys_that_did_arrive(tmp_path: Path) -> None:
    receiver, address = listen("recv", "tcp://127.0.0.1:0", "weights", "-o", str(tmp_path / "w.npy"), "--timeout", "5")
    with tb.Producer(address) as producer:
        producer.send("weight", np.ones(3))  # a typo in the key
        producer.flush(30)  # acknowledged: it is in the receiver's table
    _, err = receiver.communicate(timeout=60)
    assert receiver.returncode == 2 and "no tensor for key 'weights'" in err
    assert "1 more tensor(s) arrived here and were not saved: 'weight'; not taken" in err


def test_save_follow_ended_by_its_timeout_after_saving_succeeds(tmp_path: Path) -> None:
    saver, address = listen(
        "save", "tcp://127.0.0.1:0", "params", "-o", str(tmp_path / "p.npz"), "--follow", "--timeout", "5"
    )
    with tb.Producer(address) as producer:
        producer.send("params", {"w": np.ones(2)})
        producer.flush(30)
    out = finish(saver)  # exit status 0
    assert "no new version within 5.0s: stopping after 1 saved" in out and (tmp_path / "p-000001.npz").exists()


@pytest.mark.broker
def test_recv_says_when_tensors_under_other_keys_are_dropped_with_it(tmp_path: Path) -> None:
    url = endpoint_url("amqp")
    with tb.Producer(url) as producer:
        producer.send("other", np.ones(2))
        producer.send("k", np.arange(3.0))
        producer.flush(30)
    result = tensorbus("recv", url, "k", "-o", str(tmp_path / "k.npy"), "--timeout", "30")
    assert result.returncode == 0, result.stderr
    assert "1 more tensor(s) arrived here and were not saved: 'other'; not taken" in result.stderr


def test_errors_are_named_by_the_class_tensorbus_exports() -> None:
    from tensorbus.cli import _public_name
    from tensorbus.transports.stream import Refused

    assert _public_name(Refused("refused")) == "TransportError"  # what a user can catch, not an internal name
    assert _public_name(tb.AuthRefused("refused")) == "AuthRefused"
    assert _public_name(tb.Timeout("late")) == "Timeout"


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int4"])
@pytest.mark.parametrize(("command", "suffix"), [("recv", ".npy"), ("save", ".npz"), ("recv", ".safetensors")])
def test_a_dtype_the_file_format_cannot_describe_comes_back_the_same(
    tmp_path: Path, dtype: str, command: str, suffix: str
) -> None:
    """What recv and save write comes back as the same dtype and bits, through `tensorbus send` too:
    numpy's formats would store bfloat16 as raw |V2, so such a tensor is written as a .tbf instead."""
    tensor = np.arange(-3, 5).astype(getattr(ml_dtypes, dtype))
    output = tmp_path / f"out{suffix}"
    receiver, address = listen(
        command, "tcp://127.0.0.1:0", "k", "-o", str(output), "--timeout", "30", "--tbf-fallback"
    )
    with tb.Producer(address) as producer:
        producer.send("k", tensor if command == "recv" else {"w": tensor, "b": np.ones(2)})
    _, err = receiver.communicate(timeout=60)
    assert receiver.returncode == 0, err
    holds = suffix == ".safetensors" and dtype != "int4"  # safetensors names bfloat16 and float8; numpy does not
    written = output if holds else output.with_suffix(".tbf")
    assert written.exists() and (holds or not output.exists())
    if not holds:
        assert f"cannot {'hold' if suffix == '.safetensors' else 'describe'} dtype {dtype}" in err
        assert f"wrote it as a tensorbus frame instead: {written}" in err
    back = read_tensor(written)
    got = back if command == "recv" and not isinstance(back, dict) else back.get("tensor", back.get("w"))
    assert got.dtype == tensor.dtype and got.tobytes() == tensor.tobytes()
    receiver, address = listen("recv", "tcp://127.0.0.1:0", "again", "-o", str(tmp_path / "again.tbf"))
    sent = tensorbus("send", address, "again", str(written))  # what tensorbus wrote, it sends back unchanged
    assert sent.returncode == 0, sent.stderr
    finish(receiver)
    again = read_tensor(tmp_path / "again.tbf")
    again = again if isinstance(again, np.ndarray) else again.get("tensor", again.get("w"))
    assert again.dtype == tensor.dtype and again.tobytes() == tensor.tobytes()


def test_a_nested_structure_is_received_as_a_frame_and_sent_on(tmp_path: Path) -> None:
    receiver, address = listen(
        "recv", "tcp://127.0.0.1:0", "k", "-o", str(tmp_path / "s.npz"), "--timeout", "30", "--tbf-fallback"
    )
    with tb.Producer(address) as producer:
        producer.send("k", {"layers": [np.ones(2), np.zeros(3)], "step": 7})
    out, err = receiver.communicate(timeout=60)
    assert receiver.returncode == 0 and "structure of 2 arrays" in out and "s.tbf" in err, err
    assert tb.loads((tmp_path / "s.tbf").read_bytes())["step"] == 7


def test_send_to_nobody_names_the_option_that_bounds_the_wait_and_timeout_shortens_it(tmp_path: Path) -> None:
    np.save(tmp_path / "w.npy", np.ones(2))
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    started = time.monotonic()  # (the URL asks for 300 s of retries: far from the 1 s, with a Python start-up)
    patient = f"{url}?reconnect_timeout_s=300"
    one_line_error(tensorbus("send", patient, "k", str(tmp_path / "w.npy"), "--timeout", "1"), "reconnect_timeout_s=1 ")
    assert time.monotonic() - started < 60
    result = tensorbus("send", f"{url}?reconnect_timeout_s=0.5", "k", str(tmp_path / "w.npy"), "--timeout", "30")
    assert "reconnect_timeout_s=0.5 bounds them" in result.stderr  # the URL's lower value stays
    assert "connect_timeout_s bounds each attempt" in result.stderr


@pytest.mark.parametrize("timeout", ["20", "inf"])
def test_send_timeout_bounds_the_confirmation_too(tmp_path: Path, timeout: str) -> None:
    """(inf: each option its own bound, and a flush as long as it takes; 0 is refused, as no send takes no time)"""
    np.save(tmp_path / "w.npy", np.ones(2))
    receiver, address = listen("recv", "tcp://127.0.0.1:0", "k", "-o", str(tmp_path / "out.npy"), "--timeout", "30")
    refused = tensorbus("send", address, "k", str(tmp_path / "w.npy"), "--timeout", "0")
    assert refused.returncode == 2 and "> 0" in refused.stderr, refused.stderr
    sent = tensorbus("send", address, "k", str(tmp_path / "w.npy"), "--timeout", timeout)
    assert sent.returncode == 0, sent.stderr
    finish(receiver)
    assert np.load(tmp_path / "out.npy").tolist() == [1.0, 1.0]


@pytest.mark.parametrize("damage", ["truncated", "bad header", "empty"])
def test_inspect_exits_1_on_a_truncated_or_malformed_file_as_documented(tmp_path: Path, damage: str) -> None:
    frame = bytearray(tb.dumps(np.arange(100.0), key="k"))
    whole = len(frame)
    if damage == "truncated":  # (a whole frame, then one cut short)
        frame = frame + frame[:-10]
    elif damage == "bad header":
        frame[24:30] = b"\xc1" * 6  # (0xc1: never valid msgpack)
    else:
        frame = bytearray()
    (tmp_path / "f.tbf").write_bytes(bytes(frame))
    result = tensorbus("inspect", str(tmp_path / "f.tbf"))
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr and result.stderr.strip()
    if damage == "truncated":
        said = f"frame 1 at byte {whole} needs {whole} bytes, the file has {whole - 10} from there"
        assert said in result.stderr, result.stderr
    assert "exit 1" in tensorbus("inspect", "--help").stdout


#: what `send --timeout` meets where it gives up at its timeout: a URL's form, and whether its port takes connections.
#: A port nobody listens on refuses every attempt at once, and every transport tries again until the timeout; a port
#: that takes connections and never answers (a hung broker, or a black hole) is met by the Kafka clients too.
NOBODY = {
    "tcp": ("tcp://127.0.0.1:{port}", False),
    "amqp": ("amqp://guest:guest@127.0.0.1:{port}/%2F?queue=q", False),
    "kafka-python": ("kafka://127.0.0.1:{port}/t?client=kafka-python", True),
    "confluent": ("kafka://127.0.0.1:{port}/t?client=confluent", True),
    "kafka-python, refused": ("kafka://127.0.0.1:{port}/t?client=kafka-python", False),
    "confluent, refused": ("kafka://127.0.0.1:{port}/t?client=confluent", False),
}


@pytest.mark.parametrize("endpoint", list(NOBODY))
@pytest.mark.parametrize("timeout", [1.0, 3.0])
def test_send_to_nobody_gives_up_at_its_timeout_not_a_fraction_of_it(
    tmp_path: Path, timeout: float, endpoint: str
) -> None:
    """`send --timeout T` keeps trying for T: it gives up within [0.9 T, T + max(0.5 T, 1 s)] (timed in this
    process, with the transport's modules imported first, so that neither the interpreter's start-up nor an
    import is counted), not a backoff step early."""
    from tensorbus.cli import main
    from tensorbus.transports import resolve_transport

    np.save(tmp_path / "w.npy", np.ones(2))
    form, answers_nothing = NOBODY[endpoint]
    with socket.socket() as nobody:  # bound: no other test takes the port meanwhile
        nobody.bind(("127.0.0.1", 0))
        if answers_nothing:
            nobody.listen()  # the kernel takes the connections; nobody reads or answers them
        url = form.format(port=nobody.getsockname()[1])
        resolve_transport(url)  # (its module imported first)
        if endpoint.startswith("confluent"):
            import tensorbus.transports.kafka_confluent  # noqa: F401  (what client=confluent imports)
        started = time.monotonic()
        assert main(["send", url, "k", str(tmp_path / "w.npy"), "--timeout", str(timeout)]) == 2
        took = time.monotonic() - started
    assert 0.9 * timeout <= took <= timeout + max(0.5 * timeout, 1.0), took  # (the producer's close is timed too)


def test_recv_timeout_bounds_a_brokers_connect_too(tmp_path: Path) -> None:
    """A consumer connects to its broker before it can wait: `--timeout` bounds that as well (Kafka's
    connect_timeout_s, 10 s by default, is longer than the 1 s asked for)."""
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        url = f"kafka://127.0.0.1:{free.getsockname()[1]}/nobody"
    started = time.monotonic()
    result = tensorbus("recv", url, "k", "-o", str(tmp_path / "x.npy"), "--timeout", "1")
    assert result.returncode != 0 and "no Kafka broker answers" in result.stderr, result.stderr
    assert time.monotonic() - started < 9  # (over 10 before: the broker's connect was not bounded)
