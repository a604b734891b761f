"""The TLS context of a tcps://, amqps:// or kafkas:// endpoint, built from its `ssl_*` file options.

One home for the rule that a missing, unreadable or malformed file is the user's configuration, reported
as a `ConfigError` naming the files when the endpoint is made, not an `OSError` from deep in a connect.
"""

from __future__ import annotations

import ssl

from ..errors import ConfigError


def context_from_files(
    cafile: str | None,
    certfile: str | None,
    keyfile: str | None,
    password: str | None = None,
    *,
    server_side: bool = False,
) -> ssl.SSLContext:
    """A default context trusting `cafile` (the system's CAs without one), with `certfile`/`keyfile` loaded."""
    try:
        purpose = ssl.Purpose.CLIENT_AUTH if server_side else ssl.Purpose.SERVER_AUTH
        context = ssl.create_default_context(purpose, cafile=cafile)
        if certfile:
            context.load_cert_chain(certfile, keyfile, password)
    except OSError as exc:  # a file missing or unreadable; or an ssl.SSLError (an OSError): no certificate or key in it
        files = {"ssl_cafile": cafile, "ssl_certfile": certfile, "ssl_keyfile": keyfile}
        named = ", ".join(f"{name}={path!r}" for name, path in files.items() if path)
        raise ConfigError(f"cannot load the TLS files ({named}): {exc}") from None
    return context
