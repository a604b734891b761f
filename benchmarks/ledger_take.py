"""A receive's cost with its tensor buffered already: the share of the take's booking in the consumer's ledger.

What it measures
    An intake (the consumer's table and ledger, as a consumer makes them) is handed `--tensors` whole 4 KB
    frames through the C delivery, booked as a Kafka consumer books them (`Stream.record_admitted_run`);
    then `recv_message` takes each (the table's C take, `_take_buffered`). Two intakes alike, in interleaved
    rounds: `hook` (as a consumer is: the take's hook, `Intake._taken` then `Ledger.taken`, books the take)
    and `none` (no hook, no ledger: the floor). Printed: each one's median µs per receive, and the median of
    same-round ratios `none` ÷ `hook`.

Run
    python -m benchmarks.ledger_take [--tensors 200] [--rounds 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tensorbus.buffers import aligned
from tensorbus.codec.frame import FLAG_CHECKSUM, NATIVE, Limits
from tensorbus.intake import Intake
from tensorbus.ledger import Stream


def intake(how: str) -> tuple[Intake, Stream]:
    """An intake and one ledger stream, its takes booked as `how` says."""
    made = Intake(
        limits=Limits(),
        max_buffered_bytes=1 << 30,
        max_reassembly_bytes=1 << 30,
        reassembly_timeout_s=30,
        dedup_window=100_000,
        dedup_file=None,
        signing_key=None,
        like="numpy",
        name="bench",
    )
    if how == "none":
        made.table.on_delivered_to_application = None
    return made, made.ledger.stream()


def one_round(made: Intake, stream: Stream, n: int, first: int) -> float:
    """Deliver and book `n` tensors at `first`, `first + 1`, ...; µs per receive taking them."""
    assert NATIVE is not None and made.fast is not None, "needs the C extensions built"
    array, ids = np.ones(1024, np.float32), []
    for i in range(n):
        built = NATIVE.ndarray_frame(array, "k", {"i": i}, ("bench" * 3 + "!", first + i), FLAG_CHECKSUM)
        message = made.fast(aligned(bytes(built[0])), None, None)
        assert message is not None, "the C delivery did not take a plain frame"
        ids.append(message.message_id)
    stream.record_admitted_run(first, ids)
    recv = made.table.recv_message
    started = time.perf_counter()
    for _ in range(n):
        recv("k", 60)
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=200, help="tensors a round")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    ways = {how: intake(how) for how in ("hook", "none")}
    times: dict[str, list[float]] = {how: [] for how in ways}
    first = 0
    for _ in range(args.rounds):
        for how, (made, stream) in ways.items():
            times[how].append(one_round(made, stream, args.tensors, first))
            first += args.tensors
    medians = ", ".join(f"{how} {statistics.median(t):.2f} µs" for how, t in times.items())
    ratio = statistics.median(a / b for a, b in zip(times["none"], times["hook"], strict=True))
    print(f"recv_message of a buffered 4 KB tensor: {medians}; same-round ratio none/hook {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
