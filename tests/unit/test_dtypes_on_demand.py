"""ml_dtypes is imported on the first use of one of its dtypes, not with tensorbus (its import is slow:
docs/PERFORMANCE.md): each case runs in a fresh interpreter, where nothing imported it yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np

import tensorbus as tb
from tensorbus.codec import native


def run_fresh(code: str) -> str:
    """Run `code` in a new interpreter; its standard output."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_tensorbus_and_a_numpy_tensors_round_trip_leave_ml_dtypes_unimported() -> None:
    out = run_fresh(
        """
        import sys
        import numpy as np
        import tensorbus as tb
        with tb.Consumer("memory://plain") as consumer, tb.Producer("memory://plain") as producer:
            producer.send("k", np.arange(4, dtype=np.float32))
            assert consumer.recv("k", timeout=10).tolist() == [0, 1, 2, 3]
        print("ml_dtypes" in sys.modules)
        """
    )
    assert out == "False"


def test_a_frame_of_an_ml_dtype_imports_it_and_the_c_decoder_then_takes_such_frames() -> None:
    """The receiving interpreter never imported ml_dtypes: the first bfloat16 frame goes to Python, which imports it
    and widens the C decoder's table, so that the next one is decoded in C (where it is built and on)."""
    sent = tb.dumps(np.arange(5).astype(ml_dtypes.bfloat16))
    out = run_fresh(
        f"""
        import sys
        import tensorbus as tb
        from tensorbus.codec.native import NATIVE
        frame = {bytes(sent)!r}
        assert "ml_dtypes" not in sys.modules
        got = tb.loads(frame)
        fast = None if NATIVE is None else NATIVE.decode(memoryview(frame), None, 1 << 20, 1 << 20, 32)
        print(got.dtype.name, got.astype("float32").tolist(), "ml_dtypes" in sys.modules, fast is not None)
        """
    )
    assert out == f"bfloat16 [0.0, 1.0, 2.0, 3.0, 4.0] True {native.NATIVE is not None}"


def test_sending_an_ml_dtype_first_widens_the_whitelist_for_what_comes_back() -> None:
    out = run_fresh(
        """
        import ml_dtypes
        import numpy as np
        import tensorbus as tb
        array = np.arange(6).astype(ml_dtypes.float8_e4m3fn).reshape(2, 3)
        with tb.Consumer("memory://f8") as consumer, tb.Producer("memory://f8") as producer:
            producer.send("k", array)
            got = consumer.recv("k", timeout=10)
        print(got.dtype.name, got.shape, (got == array).all())
        """
    )
    assert out == "float8_e4m3fn (2, 3) True"
