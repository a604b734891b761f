"""The node-loss harness itself, over a plain tcp:// endpoint: it counts every tensor and runs its faults."""

from __future__ import annotations

import threading

from tests import faults, node_loss


def test_the_harness_counts_a_clean_stream_and_runs_each_fault_once_at_its_point() -> None:
    ran: list[str] = []
    lock = threading.Lock()

    def note(name: str) -> None:
        with lock:
            ran.append(name)

    url = f"tcp://127.0.0.1:{faults.free_port()}"
    result = node_loss.run(
        url,
        name="tcp, no fault",
        count=120,
        large_count=1,  # (in place of one of the 120)
        large_bytes=6 << 20,
        faults=[node_loss.Fault(30, lambda: note("a"), "a"), node_loss.Fault(90, lambda: note("b"), "b")],
        timeout_s=60.0,
        drain_s=0.2,
    )
    print(node_loss.table([result]))
    assert result.ok, result
    assert (result.sent, result.received, result.lost, result.duplicated, result.corrupted) == (120, 120, 0, 0, 0)
    assert ran == ["a", "b"]
    assert result.mid_stream == [True, True]  # neither end had finished when a fault ran
    assert "| tcp, no fault |" in node_loss.table([result])
