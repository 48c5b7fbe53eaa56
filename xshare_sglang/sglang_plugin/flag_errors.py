"""One-line refusals of bad pruner flag values (``--moe-pruner*``, ``--xshare-echo-*``).

Why: argparse's ``type=`` / ``choices=`` failures print the parser's whole usage text before the
error, which for SGLang's parser runs to hundreds of lines.  How: the flags check their values in
:class:`CheckedValue` instead, and the launch hook reports a refused setting through
:func:`usage_error`; either ends the launch as argparse would (exit code 2), but with one line on
stderr and none of the usage text.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

#: The program name SGLang's launcher parses under, and where its flags are listed.
LAUNCH_PROG = "sglang serve"
HELP_HINT = "see python -m sglang.launch_server --help"


def usage_error(message: str, prog: str = LAUNCH_PROG) -> NoReturn:
    """End the launch for a bad setting: one line ``prog: error: message; see ... --help`` on stderr
    and exit code 2, as argparse's ``error`` but without the usage text.

    Parameters
    ----------
    message : str
        Names the flag, the value and what is allowed; line breaks in it are joined into one line.
    prog : str
        The program name the line starts with.

    Raises
    ------
    SystemExit
        Always, with code 2.
    """
    line = re.sub(r"\s*\n\s*", " ", message.strip())
    sys.stderr.write(f"{prog}: error: {line}; {HELP_HINT}\n")
    sys.stderr.flush()
    raise SystemExit(2)


class CheckedValue(argparse.Action):
    """Store a flag's value after the flag's own check, refusing a bad value in one line.

    Stands in for argparse's ``type=`` and ``choices=``, whose failures make the parser print its
    whole usage text before the error.  The message keeps argparse's wording
    (``argument --moe-pruner-k0: must be >= 0, got -1``).  A parser built with
    ``exit_on_error=False`` gets the :class:`argparse.ArgumentError` instead.

    Parameters
    ----------
    convert : callable, optional
        Turns the typed text into the value; raises ``argparse.ArgumentTypeError`` or ``ValueError``
        naming what is allowed.  None keeps the text.
    allowed : sequence of str, optional
        The values accepted, after ``convert``.
    """

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        convert: Callable[[str], Any] | None = None,
        allowed: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.convert = convert
        self.allowed = tuple(allowed) if allowed is not None else None

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            value = values if self.convert is None else self.convert(values)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            self._refuse(parser, str(exc))
        if self.allowed is not None and value not in self.allowed:
            choices = ", ".join(repr(choice) for choice in self.allowed)
            self._refuse(parser, f"invalid choice: {value!r} (choose from {choices})")
        setattr(namespace, self.dest, value)

    def _refuse(self, parser: argparse.ArgumentParser, reason: str) -> NoReturn:
        error = argparse.ArgumentError(self, reason)
        if not getattr(parser, "exit_on_error", True):
            raise error
        usage_error(str(error), getattr(parser, "prog", None) or LAUNCH_PROG)
