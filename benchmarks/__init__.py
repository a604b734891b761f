"""Stand-alone benchmarks for tensorbus (run as modules, e.g. `python -m benchmarks.codec_bench`)."""
