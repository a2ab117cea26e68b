"""The benchmarks' command lines: their plain flags written as a table of defaults.

Most flags of a benchmark are a name and a default (`--rounds 2`, `--max-tokens 64`, `--model`
with none); `parser(__doc__, rounds=2, max_tokens=64, model=None)` declares them in one call, the
type of each flag taken from its default. Flags with more to say (help text, `required`, a choice
of actions) stay `add_argument` calls on the parser it returns.
"""

from __future__ import annotations

import argparse


def add_flags(ap: argparse.ArgumentParser, **defaults: int | float | str | None) -> None:
    """One `--name` flag a keyword, underscores spelled as dashes (`max_tokens` is
    `--max-tokens`): an int or float default parses the value as that type, a string or None
    default keeps it a string."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):  # argparse's type=bool takes any non-empty string as True
            raise TypeError(f"{flag}: a bool default needs an explicit action")
        if isinstance(default, int | float):
            ap.add_argument(flag, type=type(default), default=default)
        else:
            ap.add_argument(flag, default=default)


def parser(
    doc: str | None = None, /, **defaults: int | float | str | None
) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of `doc` (a module docstring; no description
    without one), with a flag for each default (`add_flags`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    add_flags(ap, **defaults)
    return ap
