"""The one error a bad setting raises, and the "did you mean" hint its messages end with.

Every message names the setting and, where one is close, the nearest valid name, on one line (the CLI
prints it as it is). Design notes: docs/config.md
"""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A recipe or command-line setting that does not fit the Config tree."""


def did_you_mean(name: str, candidates: list[str]) -> str:
    """"; did you mean 'x'?" for the candidate closest to `name`, or "" when none is close."""
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""
