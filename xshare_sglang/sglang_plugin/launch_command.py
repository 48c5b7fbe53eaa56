"""The pruner settings a server's launch command asks for, read back from the command as SGLang
reports it (``/server_info``'s ``launch_command``).

Why: a tool that talks to a running server (``xshare-sglang calibrate``) needs to know whether and
how the server's pruner was configured.  How: the command is split back into its words
(:func:`launch_command_words`), parsed by the plugin's own parser and merged as the server merged
it (:func:`typed_settings_of_command`); a ``--moe-pruner-config`` that names a file on the server's
machine is not read.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ..errors import ConfigError
from .flag_merge import TypedSettings, typed_settings
from .flag_parser import add_flags


def launch_command_words(command: str) -> list[str]:
    """The arguments of a launch command as SGLang reports it (``/server_info``'s ``launch_command``).

    SGLang joins the arguments with single spaces and no quoting, so a JSON value typed for
    ``--moe-pruner-config`` appears with its spaces: a word (or a ``--flag=`` value) that starts a
    JSON object runs to the object's end.  Shell quotes around a word are removed.
    """
    decoder = json.JSONDecoder()
    words: list[str] = []
    pos = 0
    while (match := _WORD_START.search(command, pos)) is not None:
        start = match.start()
        flag = _FLAG_EQUALS.match(command, start)
        value_start = flag.end() if flag else start
        if command.startswith(("'", '"'), value_start):
            quote = command[value_start]
            close = command.find(quote, value_start + 1)
            if close > 0:
                words.append(command[start:value_start] + command[value_start + 1 : close])
                pos = close + 1
                continue
        if command.startswith("{", value_start):
            try:
                _, end = decoder.raw_decode(command, value_start)
            except ValueError:
                pass
            else:
                words.append(command[start:end])
                pos = end
                continue
        end = _WORD_END.search(command, start)
        pos = end.start() if end else len(command)
        words.append(command[start:pos])
    return words


_WORD_START = re.compile(r"\S")
_WORD_END = re.compile(r"\s")
_FLAG_EQUALS = re.compile(r"--[\w-]+=")


def typed_settings_of_command(command: str) -> TypedSettings | None:
    """What a launch command's own pruner flags ask for (:func:`typed_settings`), read as the server
    read them; None when they ask for nothing.  The environment of the server is not known here.

    Raises
    ------
    ConfigError
        The flags do not parse, or ``--moe-pruner-config`` names a file (on the server's machine) or
        holds text that is not a JSON object.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_flags(parser)
    try:
        args, _ = parser.parse_known_args(launch_command_words(command))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ConfigError("", f"the pruner's flags do not parse ({exc})") from None
    return typed_settings(args, read_config=_json_text_only)


def _json_text_only(text: str) -> dict[str, Any]:
    if not text.lstrip().startswith("{"):
        raise ConfigError("", f"{text} names a file on the server's machine, which is not read from here")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise ConfigError("", "holds text that is not read as a JSON object")
    return data
