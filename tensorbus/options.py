"""Options from keyword arguments, a URL's query string and TOML files, validated by name.

Each set of options (a producer's, a consumer's, each transport's) is a frozen dataclass whose field
names carry their unit (`_s`, `_bytes`) and whose defaults give their types; `merge` checks the values
once, and code reads them as attributes that mypy checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import tomllib

from .errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_SECRET_WORDS = ("secret", "key", "password", "token")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MonitoringOptions:
    """What every Producer and Consumer takes for monitoring (monitoring.py; docs/OPTIONS.md, Monitoring)."""

    metrics: bool = False  # Prometheus metrics (also on with TENSORBUS_METRICS=1)
    metrics_registry: Any = None  # a prometheus_client CollectorRegistry; None: its default one
    metrics_key_label: Callable[[str | None], str] | None = None  # key -> a bounded `key` label
    tracing: bool = False  # OpenTelemetry spans (also on with TENSORBUS_TRACING=1)


#: the longest wait the platform's locks take (`threading.TIMEOUT_MAX`): a longer timeout means no timeout
_TIMEOUT_MAX = threading.TIMEOUT_MAX


def finite_timeout(timeout: object, name: str = "timeout") -> float | None:
    """A public method's `timeout` argument, checked: a number of seconds (0 or more) or None (wait forever),
    where one too long for the platform's waits (e.g. `math.inf`) becomes None. Anything else is a
    `ConfigError` naming the argument, raised where the mistake is made rather than deep in a wait.

    NaN is refused: compared with anything it is neither less nor more, so a wait on it would never end.
    """
    if type(timeout) is float and 0 <= timeout < _TIMEOUT_MAX:  # (the commonest, in one comparison: NaN fails it)
        return timeout
    if timeout is None:
        return None
    if type(timeout) is float or type(timeout) is int:  # (first: the ABC check costs a small tensor's `recv` 7 %)
        seconds = float(timeout)
    elif isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ConfigError(f"{name} must be a number of seconds or None, got {timeout!r} ({type(timeout).__name__})")
    else:
        seconds = float(timeout)
    if math.isnan(seconds):
        raise ConfigError(f"{name} cannot be NaN")
    if seconds < 0:
        raise ConfigError(f"{name} must be 0 seconds or more (None: wait forever), got {timeout!r}")
    return None if seconds >= _TIMEOUT_MAX else seconds


def _is_size(name: str) -> bool:
    """Whether an option counts bytes, by its name (`max_frame_bytes`, `max_buffered_bytes_per_producer`)."""
    return name.endswith("_bytes") or "_bytes_per_" in name


def _coerce(name: str, text: str, default: Any) -> Any:
    """Turn a query-string value into the type of the option's default."""
    try:
        if isinstance(default, bool):
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError(text)
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if default is None:  # no default to copy the type from: the unit in the name says (max_frame_bytes)
            if _is_size(name):
                return int(text)
            if name.endswith("_s"):
                return float(text)
        return text
    except ValueError:
        raise ConfigError(f"option {name}={text!r} is not a valid {type(default).__name__}") from None


def _check_type(name: str, value: Any, default: Any) -> Any:
    """Refuse a keyword or TOML value of the wrong type for a numeric or boolean option (None always passes)."""
    if value is None:
        return value
    if isinstance(default, bool) or (default is None and name.startswith(("use_", "enable_"))):
        wanted: tuple[type, ...] = (bool,)
    elif isinstance(default, int) or (default is None and _is_size(name)):
        wanted = (int,)
    elif isinstance(default, float) or (default is None and name.endswith("_s")):
        wanted = (int, float)
    else:
        return value
    if not isinstance(value, wanted) or (bool not in wanted and isinstance(value, bool)):
        names = " or ".join(t.__name__ for t in wanted)
        raise ConfigError(f"option {name} must be {names}, got {value!r} ({type(value).__name__})")
    return value


def redact(url: str) -> str:
    """`url` with its password and secret query values (auth_secret, signing_key, ...) masked, for logs."""
    if "://" not in url and "@" in url:  # not a URL (e.g. "user:pw@host:5672"): whatever precedes "@" may be secret
        return "***@" + url.rpartition("@")[2]
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = [
        (name, "***" if any(word in name for word in _SECRET_WORDS) else value)
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ]
    if netloc == parts.netloc and all(value != "***" for _, value in query):
        return url  # nothing to hide: as written (unsplitting would turn unix:///path into unix:/path)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=urllib.parse.urlencode(query, safe="*/")))


class _Unset:
    """The default of a keyword-only option parameter: not given, so the URL's value or the option's default holds."""

    def __repr__(self) -> str:
        return "<default>"


#: what a keyword-only option parameter of Producer and Consumer defaults to (see `given`)
UNSET: Any = _Unset()


def given(options_type: type[DataclassInstance], arguments: dict[str, Any]) -> dict[str, Any]:
    """The options of `options_type` among a call's `arguments` (its `locals()`) that the caller passed."""
    return {f.name: arguments[f.name] for f in dataclasses.fields(options_type) if arguments[f.name] is not UNSET}


def defaults(options_type: type[DataclassInstance]) -> dict[str, Any]:
    """Each option of an options dataclass with its default, by name."""
    return {f.name: f.default for f in dataclasses.fields(options_type)}


def build(options_type: type[_T], values: dict[str, Any]) -> _T:
    """An options dataclass from merged values (those of its fields; the others are another set's)."""
    make: Callable[..., _T] = options_type
    return make(**{f.name: values[f.name] for f in dataclasses.fields(options_type)})


def merge(
    known: dict[str, Any], *, url: urllib.parse.SplitResult, kwargs: dict[str, Any], where: str
) -> dict[str, Any]:
    """Defaults, overridden by the URL query, overridden by keyword arguments; unknown names are errors."""
    options = dict(known)
    query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
    for source, values in (("URL query", query), ("keyword arguments", kwargs)):
        unknown = sorted(set(values) - set(known))
        if unknown:
            near = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
            hints = "".join(f" (did you mean {near[name][0]!r} for {name!r}?)" for name in unknown if near[name])
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)} in {source} for {where}{hints}; "
                f"known: {', '.join(sorted(known))}"
            )
        for name, value in values.items():
            if source == "URL query":
                options[name] = _coerce(name, value, known[name])
            else:
                options[name] = _check_type(name, value, known[name])
            _check_value(name, options[name])
            if name.endswith("_s") and isinstance(options[name], (int, float)) and options[name] > LONGEST_S:
                options[name] = LONGEST_S  # (as long as this platform's waits take: a socket's refuses inf)
    return options


#: durations that cannot be 0, and why
_NEVER_ZERO = {"connect_timeout_s": "a connection attempt of no time at all never completes"}
#: a duration option longer than this (`math.inf`, say) is taken as this: half the longest wait of a lock or a
#: socket here (~146 years), so that a deadline computed from it is still one they take
LONGEST_S = _TIMEOUT_MAX / 2


def _check_value(name: str, value: Any) -> None:
    """Refuse durations that are negative or NaN and sizes or counts that are not positive, by the unit in the name."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if name.endswith("_s") and not value >= 0:  # (NaN fails every comparison)
        raise ConfigError(f"option {name} must be a duration of 0 seconds or more, got {value!r}")
    if name in _NEVER_ZERO and value == 0:
        raise ConfigError(f"option {name} must be more than 0 seconds: {_NEVER_ZERO[name]}")
    if (_is_size(name) or name.endswith("_frames")) and not value > 0:
        raise ConfigError(f"option {name} must be positive, got {value!r}")


def load_config(path: str | Path, role: str) -> tuple[str | None, dict[str, Any]]:
    """Read `url` and options from a TOML file: top-level keys, then the `[producer]`/`[consumer]` table."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    sections = {"producer", "consumer"}
    options = {k: v for k, v in data.items() if k not in sections}
    role_options = data.get(role, {})
    if not isinstance(role_options, dict):
        raise ConfigError(f"[{role}] in {path} must be a table")
    options.update(role_options)
    return options.pop("url", None), options
