"""The transport comparison benchmark behind `tensorbus bench`.

`config` reads the settings, `runner` drives worker process pairs (`workers`) through interleaved
rounds on tensorbus transports (`links`) and the baselines users would write instead
(`baselines`), and `report` / `plot` turn the results into a table, JSON, CSV and a PNG.
"""
