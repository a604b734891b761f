"""`tensorbus bench` through its entry point, in a configuration that finishes in seconds."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tensorbus.bench import config
from tensorbus.cli import main
from tensorbus.errors import ConfigError
from tests.conftest import require_module

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "bench.toml"
TINY = [
    "bench", "--config", str(SHIPPED), "--transports", "memory,tcp,unix", "--baselines", "socket",
    "--sizes", "4KB,64KB", "--latency-sizes", "4KB", "--repeats", "2", "--budget-s", "2",
    "--warmup-s", "0.05", "--round-s", "0.05", "--timeout-s", "30", "--no-progress",
]  # fmt: skip


def run_tiny(tmp_path: Path, transports: str, baselines: str, *more: str) -> dict[str, Any]:
    """The tiny benchmark with these rows instead (comma-separated) and `more` arguments: its JSON report,
    once every row ran and every cell came through without a failed tensor."""
    out = tmp_path / "bench.json"
    argv = [*TINY, *more, "--json", str(out)]
    argv[argv.index("memory,tcp,unix")] = transports
    argv[argv.index("socket")] = baselines
    assert main(argv) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    rows = [*transports.split(","), *baselines.split(",")]
    assert {m["name"]: m["status"] for m in data["methods"]} == dict.fromkeys(rows, "ok")
    for cell in data["throughput"] + data["latency"]:
        assert cell["status"] == "ok" and cell["failures"] == 0, cell
    return data


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the tiny benchmark once; every test below reads its outputs."""
    out = tmp_path_factory.mktemp("bench")
    files = {"json": out / "bench.json", "csv": out / "bench.csv", "plot": out / "bench.png"}
    code = main([*TINY, *(arg for kind, path in files.items() for arg in (f"--{kind}", str(path)))])
    return {"code": code, **files}


def test_tiny_run_succeeds(tiny_run: dict[str, Any]) -> None:
    assert tiny_run["code"] == 0


def test_json_has_every_cell_measured_and_verified(tiny_run: dict[str, Any]) -> None:
    data = json.loads(tiny_run["json"].read_text())
    methods = {m["name"]: m for m in data["methods"]}
    assert set(methods) == {"memory", "tcp", "unix", "socket"}
    assert all(m["status"] == "ok" for m in methods.values())
    throughput = {(c["method"], c["size"]): c for c in data["throughput"]}
    assert set(throughput) == {(m, s) for m in methods for s in ("4KB", "64KB")}
    for cell in throughput.values():
        assert cell["status"] == "ok", cell
        assert cell["gbps_median"] > 0 and cell["tensors_per_s"] > 0
        assert 1 <= cell["rounds"] <= 2
        assert cell["verified"] > 0 and cell["failures"] == 0
    latency = {c["method"]: c for c in data["latency"]}
    assert set(latency) == set(methods)
    for cell in latency.values():
        assert cell["status"] == "ok" and cell["failures"] == 0
        assert 0 < cell["p50_us"] <= cell["p99_us"]
    ratios = {(r["transport"], r["baseline"], r["size"]) for r in data["ratios"] if r["metric"] == "throughput"}
    assert ("tcp", "socket", "64KB") in ratios and ("unix", "socket", "4KB") in ratios


def test_csv_has_a_row_per_cell(tiny_run: dict[str, Any]) -> None:
    with open(tiny_run["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * (2 + 1)  # four methods, two throughput sizes and one latency size
    assert all(row["status"] == "ok" and row["failures"] == "0" for row in rows)
    assert all(float(row["gbps_median"]) > 0 for row in rows if row["metric"] == "throughput")


def test_plot_is_a_png(tiny_run: dict[str, Any]) -> None:
    assert tiny_run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_broker_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(
        ["bench", "--transports", "amqp", "--baselines", "auto", "--sizes", "4KB", "--no-progress",
         "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2F", "--json", str(out)]
    )  # fmt: skip
    assert code == 1  # a run that measured nothing is not a success
    methods = {m["name"]: m for m in json.loads(out.read_text())["methods"]}
    assert set(methods) == {"amqp", "pika"}
    for method in methods.values():
        assert method["status"] == "skipped" and "127.0.0.1:1" in method["reason"]
    captured = capsys.readouterr()
    assert "skipped" in captured.out and "nothing was measured" in captured.err


def test_output_paths_are_checked_before_anything_is_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorbus.bench.runner import Runner

    monkeypatch.setattr(Runner, "run", lambda self: pytest.fail("measured before checking the output path"))
    out = str(tmp_path / "no" / "b.json")
    code = main(["bench", "--transports", "tcp", "--sizes", "4KB", "--no-progress", "--json", out])
    assert code == 2 and "not a writable directory" in capsys.readouterr().err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--transports" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--sizes", "4XB"], ["--sizes", "0"], ["--transports", "carrier-pigeon"]])
def test_bad_argument_is_one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorbus bench: ConfigError:") and err.count("\n") == 1


def test_bad_size_from_the_shell() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorbus", "bench", "--sizes", "4KB,lots"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "bad tensor size 'lots'" in done.stderr


def test_importing_the_cli_is_cheap() -> None:
    code = (
        "import sys, tensorbus.cli; tensorbus.cli.build_parser(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'matplotlib', 'pika', 'kafka', 'zmq'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_shipped_config_holds_the_defaults() -> None:
    shipped = config.load(SHIPPED, {})
    assert shipped == config.BenchConfig(amqp_url=shipped.amqp_url, kafka_url=shipped.kafka_url)


def test_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text('sizes = ["4KB"]\nrepeat = 3\n')
    with pytest.raises(ConfigError, match="unknown benchmark setting 'repeat'"):
        config.load(path, {})


@pytest.mark.parametrize(
    ("text", "nbytes"), [("4KB", 4096), ("64kib", 65536), ("1MB", 1 << 20), ("256MB", 1 << 28), ("1000", 1000)]
)
def test_sizes(text: str, nbytes: int) -> None:
    assert config.parse_size(text) == nbytes
    if nbytes % 1024 == 0:
        assert config.parse_size(config.format_size(nbytes)) == nbytes


def test_plain_text_report_without_rich(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorbus.bench import report
    from tensorbus.bench.results import Cell, Method, Results

    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # import rich... -> ImportError
    cfg = config.BenchConfig(transports=["tcp"], sizes=[4096], baselines=["socket"])
    results = Results(
        config=cfg,
        methods=[
            Method("tcp", "tensorbus", "tensorbus", "tcp", "tcp://127.0.0.1:0", compare=["socket"]),
            Method("socket", "baseline", "socket", "tcp", "tcp://127.0.0.1:0"),
        ],
        cells=[
            Cell("tcp", "throughput", 4096, rounds=[0.1, 0.2]),
            Cell("socket", "throughput", 4096, rounds=[0.4, 0.4]),
            Cell("tcp", "latency", 4096, rounds=[1e-4], samples=[1e-4] * 10),
            Cell("socket", "latency", 4096, rounds=[5e-5], samples=[5e-5] * 10),
        ],
    )
    report.print_report(results)
    out = capsys.readouterr().out
    assert "bare socket" in out and "100 µs" in out and "50 µs" in out
    assert "tcp ÷ bare socket: 4KB 0.38x, 4KB RTT 2.00x" in out
    assert "MISSED  tcp 4KB round trip (p50) ≤ 1.5x bare socket's: 4KB 2.00x" in out


def test_unix_and_memory_are_held_against_tcp_and_the_small_tensor_goals_judged() -> None:
    from tensorbus.bench import report
    from tensorbus.bench.plan import plan
    from tensorbus.bench.results import Cell, Results

    baselines = ["socket", "zmq", "zmq-recipe", "zmq-frame"]
    cfg = config.BenchConfig(transports=["memory", "tcp", "unix"], sizes=[4096, 65536], baselines=baselines)
    methods = plan(cfg)
    assert {m.name: m.compare for m in methods if m.kind == "tensorbus"} == {
        "memory": ["tcp"], "tcp": baselines, "unix": [*baselines, "tcp"],
    }  # fmt: skip
    gbps = {"memory": 0.3, "tcp": 0.2, "unix": 0.25, "socket": 0.4, "zmq": 0.3, "zmq-recipe": 0.19, "zmq-frame": 0.3}
    rtt = {
        "memory": 9e-5,
        "tcp": 6e-5,
        "unix": 4e-5,
        "socket": 3e-5,
        "zmq": 5e-5,
        "zmq-recipe": 6e-5,
        "zmq-frame": 5e-5,
    }
    cells = [Cell(name, "throughput", n, rounds=[g, g]) for name, g in gbps.items() for n in (4096, 65536)]
    cells += [Cell(name, "latency", 4096, rounds=[r], samples=[r] * 10) for name, r in rtt.items()]
    judged = report.targets(Results(config=cfg, methods=methods, cells=cells))
    verdicts = {t.name: (t.verdict, t.detail) for t in judged}
    assert verdicts["tcp ≥ 0.8x bare socket at 4KB and 64KB"] == ("missed", "4KB 0.50x, 64KB 0.50x")
    assert verdicts["tcp ≥ 0.6x bare pyzmq (one frame) at 4KB"] == ("met", "4KB 0.67x")
    assert verdicts["tcp ≥ 1.0x pyzmq's send_array recipe at every size"] == ("met", "4KB 1.05x, 64KB 1.05x")
    assert verdicts["unix ≥ 1.0x tcp at every size"] == ("met", "4KB 1.25x, 64KB 1.25x")
    assert verdicts["memory ≥ 1.0x tcp at every size"] == ("met", "4KB 1.50x, 64KB 1.50x")
    assert verdicts["memory 4KB round trip (p50) ≤ tcp's"] == ("missed", "4KB 1.50x")


def test_quorum_and_classic_rows_each_have_their_queue_type_and_their_baseline() -> None:
    from tensorbus.bench.plan import plan

    cfg = config.BenchConfig(
        transports=["amqp-quorum", "amqp-classic"], baselines=["auto"], amqp_url="amqp://guest:guest@127.0.0.1:1/%2F"
    )
    methods = {m.name: m for m in plan(cfg)}
    assert set(methods) == {"amqp-quorum", "amqp-classic", "pika", "pika-classic"}
    assert methods["amqp-quorum"].url.endswith("?queue_type=quorum") and methods["amqp-quorum"].family == "amqp"
    assert methods["amqp-classic"].url.endswith("?queue_type=classic")
    assert methods["pika-classic"].url.endswith("?queue_type=classic")
    assert methods["pika-classic"].impl == "pika-classic"
    assert methods["amqp-quorum"].compare == ["pika"] and methods["amqp-classic"].compare == ["pika-classic"]
    with pytest.raises(ConfigError, match="amqp-quorum, amqp-classic"):
        config.BenchConfig(transports=["amqp-mirrored"])


def test_each_transport_runs_its_rounds_next_to_the_baselines_it_is_compared_with() -> None:
    from tensorbus.bench.plan import plan, round_order

    cfg = config.BenchConfig(
        transports=["memory", "tcp", "unix", "amqp-quorum", "amqp-classic", "kafka"],
        amqp_url="amqp://guest:guest@127.0.0.1:1/%2F",
        kafka_url="kafka://127.0.0.1:1",
    )
    methods = plan(cfg)  # (brokers that do not answer: skipped, still planned)
    assert [m.name for m in methods].index("pika") > [m.name for m in methods].index("kafka")
    assert [m.name for m in round_order(methods)] == [
        "memory", "tcp", "socket", "zmq", "zmq-recipe", "zmq-frame", "unix", "amqp-quorum", "pika", "amqp-classic",
        "pika-classic", "kafka", "kafka-python", "pickle",
    ]  # fmt: skip


def test_a_large_broker_cells_rounds_carry_broker_round_bytes_and_no_other_cells_do() -> None:
    from tensorbus.bench.results import Method
    from tensorbus.bench.runner import Runner

    cfg = config.BenchConfig(broker_cap_from=config.parse_size("64MB"), broker_round_bytes=config.parse_size("512MB"))
    runner = Runner(cfg)
    amqp = Method("amqp", "tensorbus", "tensorbus", "amqp", "amqp://h/?queue=q")
    tcp = Method("tcp", "tensorbus", "tensorbus", "tcp", "tcp://127.0.0.1:0")
    one_s = 1.0  # seconds per tensor: `broker_round_s` alone would make rounds of one tensor
    assert runner._tensors_per_round(amqp, 256 << 20, "throughput", one_s) == 2
    assert runner._tensors_per_round(amqp, 100 << 20, "throughput", one_s) == 6  # (rounded up)
    assert runner._tensors_per_round(amqp, 16 << 20, "throughput", one_s) == 1  # below broker_cap_from
    assert runner._tensors_per_round(amqp, 256 << 20, "latency", one_s) == 1
    assert runner._tensors_per_round(tcp, 256 << 20, "throughput", one_s) == 1
    small = Runner(config.BenchConfig(broker_cap_from=4096, max_tensors_per_round=1000))
    assert small._tensors_per_round(amqp, 4096, "throughput", one_s) == 1000  # never past max_tensors_per_round


def test_asyncio_rows_run_tensorbus_aio_against_pyzmq_asyncio(tmp_path: Path) -> None:
    from tensorbus.bench.plan import plan

    methods = {m.name: m for m in plan(config.BenchConfig(transports=["tcp", "aio-tcp", "aio-unix"]))}
    assert methods["aio-tcp"].impl == methods["aio-unix"].impl == "tensorbus-aio"
    assert methods["aio-unix"].family == "unix" and methods["aio-tcp"].compare == ["tcp", "zmq-asyncio"]
    assert "zmq-asyncio" not in {m.name for m in plan(config.BenchConfig(transports=["tcp", "unix"]))}
    require_module("zmq", "bench")
    data = run_tiny(tmp_path, "aio-tcp,aio-unix", "zmq-asyncio")
    assert {r["transport"] for r in data["ratios"]} == {"aio-tcp", "aio-unix"}


def test_asyncio_rows_run_on_the_loop_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorbus.bench.aio_links import AioTensorbusLink, ZmqAsyncioLink
    from tensorbus.bench.plan import plan
    from tensorbus.bench.runner import Runner

    with pytest.raises(ConfigError, match="event_loop must be one of asyncio, uvloop, got 'trio'"):
        config.BenchConfig(event_loop="trio")
    for loop in ("asyncio", "uvloop"):  # what each worker pair is told
        chosen = config.BenchConfig(transports=["aio-tcp"], baselines=["zmq-asyncio"], event_loop=loop)
        assert {m.name: Runner(chosen)._spec(m)["event_loop"] for m in plan(chosen)} == {
            "aio-tcp": loop,
            "zmq-asyncio": loop,
        }
    require_module("uvloop", "aio")
    require_module("zmq", "bench")
    import uvloop

    spec = {"method": "aio-tcp", "impl": "tensorbus-aio", "url": "tcp://127.0.0.1:0", "tag": "t", "timeout_s": 5.0}
    for link_type in (AioTensorbusLink, ZmqAsyncioLink):
        for loop, kind in (("uvloop", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)):
            link = link_type({**spec, "event_loop": loop}, "A")
            try:
                assert isinstance(link.loop, kind) and isinstance(link.loop, uvloop.Loop) == (loop == "uvloop")
            finally:
                link.close()
    data = run_tiny(tmp_path, "aio-tcp", "zmq-asyncio", "--loop", "uvloop")
    assert data["config"]["event_loop"] == "uvloop"
    assert "asyncio rows on uvloop" in capsys.readouterr().out


class _QueueRounds:
    """A LoopRounds link over an asyncio.Queue (sends land in its own inbox) that counts loop runs."""

    def __init__(self) -> None:
        import asyncio

        from tensorbus.bench.aio_links import LoopRounds

        class Link(LoopRounds):
            runs = 0

            def __init__(self) -> None:
                self.loop = asyncio.new_event_loop()
                self.inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
                run = self.loop.run_until_complete

                def counted(coroutine: Any) -> Any:
                    self.runs += 1
                    return run(coroutine)

                self.loop.run_until_complete = counted  # type: ignore[method-assign]

            async def asend(self, array: Any, index: int) -> None:
                await self.inbox.put((index, array))

            async def arecv(self, timeout: float) -> tuple[int, Any]:
                return await asyncio.wait_for(self.inbox.get(), timeout)

        self.link = Link()


def test_an_asyncio_rows_round_is_one_coroutine_awaiting_every_tensor() -> None:
    import numpy as np

    link = _QueueRounds().link
    slots = [np.full(4, i, np.uint8) for i in range(3)]
    t_start, t_end = link.send_round(slots, 10, 7)
    assert link.runs == 1 and t_start <= t_end and link.inbox.qsize() == 7
    expected = iter(range(10, 17))

    def check(obj: Any, index: int, want: int) -> str | None:
        return None if index == want == next(expected) and obj[0] == index % 3 else f"#{index}, wanted #{want}"

    outcome = link.recv_round(7, 10, 5.0, check)
    assert link.runs == 2 and (outcome["failures"], outcome["problem"]) == (0, None)
    assert outcome["t_first"] <= outcome["t_last"]
    trips = link.ping_round(slots, 0, 5, 5.0, lambda obj, got, want: None if got == want else "wrong")
    assert link.runs == 3 and len(trips["rtts"]) == 5 and trips["failures"] == 0
    link.loop.close()


def test_pyzmqs_send_array_recipe_and_one_bare_frame_carry_every_tensor_checked(tmp_path: Path) -> None:
    """The two pyzmq baselines issue goals name: its docs' send_array recipe (a JSON dtype/shape frame, then the
    array) and one frame a tensor with no metadata, numbered by arrival, through streams and round trips."""
    require_module("zmq", "bench")
    data = run_tiny(tmp_path, "tcp", "zmq-recipe,zmq-frame")
    assert {c["method"] for c in data["latency"]} == {"tcp", "zmq-recipe", "zmq-frame"}
    assert {r["baseline"] for r in data["ratios"]} == {"zmq-recipe", "zmq-frame"}
