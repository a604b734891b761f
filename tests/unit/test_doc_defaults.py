"""Every default the docs name is the default in the code: docs/OPTIONS.md's default column, the README's and the
other docs' "`option` (N)" mentions, and docs/FORMAT.md's acknowledgement numbers, against the options dataclasses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from tensorbus.transports.stream import SocketOptions
from tests.unit.test_options_doc import OPTIONS_MD, SECTIONS

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
#: a default cell that says the value is worked out (or required): the dataclass holds None (or "") for it
WORKED_OUT = (
    "the transport's",
    "the client's",
    "(required)",
    "`tensorbus-TOPIC`",
    "3, or the live brokers",
    "2 with 3 replicas",
    "16 MiB, grown to hold",
)


def value(text: str) -> Any:
    """A documented default as a Python value: None, True, "quorum", 262,144, 8 MiB, 16 MiB minus 4 KiB, 0.001."""
    text = text.strip()
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if re.fullmatch(r'`"[^"]*"`', text):
        return text[2:-2]
    if re.fullmatch(r"`[\w-]+`", text):  # (a name: `kafka-python`)
        return text[1:-1]
    terms = [term.strip() for term in text.split("\N{MINUS SIGN}")]
    total = 0.0
    for sign, term in zip([1] + [-1] * (len(terms) - 1), terms, strict=True):
        match = re.fullmatch(r"([\d,]+(?:\.\d+)?)(?: (KiB|MiB|GiB))?", term)
        assert match, f"cannot read the documented default {text!r}"
        total += sign * float(match.group(1).replace(",", "")) * UNITS.get(match.group(2) or "", 1)
    return int(total) if total.is_integer() else total


def rows() -> list[tuple[str, str, str]]:
    """(section, option name, its default cell) for every option row of docs/OPTIONS.md."""
    out = []
    for section, body in re.findall(r"^## (.+)\n((?:(?!^## ).*\n?)*)", OPTIONS_MD.read_text(), flags=re.MULTILINE):
        for line in body.splitlines():
            if line.startswith("| `"):
                cells = line.split("|")
                names = re.findall(r"`(\w+)`", cells[1])
                defaults = [cells[2]] if len(names) == 1 else cells[2].split(", ")
                assert len(defaults) in (1, len(names)), line
                out += [(section, name, defaults[min(i, len(defaults) - 1)]) for i, name in enumerate(names)]
    return out


@pytest.mark.parametrize(("section", "name", "cell"), rows(), ids=lambda x: str(x)[:40])
def test_options_md_gives_each_options_default_as_the_code_has_it(section: str, name: str, cell: str) -> None:
    default = {f.name: f.default for f in dataclasses.fields(SECTIONS[section])}[name]
    cell = cell.strip()
    if cell.startswith(WORKED_OUT) or cell.startswith("None:"):
        assert default in (None, ""), f"{name}: docs say {cell!r}, the code {default!r}"
        return
    assert value(re.split(r", (?=\D)", cell)[0]) == default, f"{name}: docs say {cell!r}, the code {default!r}"


def mentioned() -> list[tuple[str, str, str]]:
    """(file, option, number) for every "`option` (N)" in the README and docs/ outside OPTIONS.md."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path != OPTIONS_MD:
            for name, number in re.findall(r"`(\w+)` \((\d[\d,.]*(?: [KMG]iB)?)\)", path.read_text()):
                found.append((path.name, name, number))
    return found


def test_the_other_docs_name_defaults_the_code_has() -> None:
    every: dict[str, set[Any]] = {}
    for options in SECTIONS.values():
        for field in dataclasses.fields(options):
            every.setdefault(field.name, set()).add(field.default)
    # (an option whose default is None is worked out at run time, e.g. min_insync_replicas: OPTIONS.md says how)
    checked = [(where, name, number) for where, name, number in mentioned() if every.get(name, {None}) != {None}]
    assert len(checked) >= 5  # (the README names several: send_timeout_s, connect_timeout_s, ...)
    wrong = [(where, name, number) for where, name, number in checked if value(number) not in every[name]]
    assert not wrong, f"defaults the docs name that no options class has: {wrong}"


def test_format_md_gives_the_acknowledgement_numbers_the_code_uses() -> None:
    text = (ROOT / "docs" / "FORMAT.md").read_text()
    match = re.search(r"every ([\d,]+) frames / (\d+ MiB)", text)
    assert match, "docs/FORMAT.md no longer says how often a socket consumer acknowledges"
    assert value(match.group(1)) == SocketOptions.ack_every_frames
    assert value(match.group(2)) == SocketOptions.ack_every_bytes
