"""AFTER ``sglang.srt.server_args.ServerArgs.add_cli_args`` (checked: server_args.py:351, 0.5.23).

Why: the ``--moe-pruner*`` flags must exist in ``python -m sglang.launch_server --help`` and parse
in ``launch_server`` and ``sglang serve``; SGLang builds its parser in this static method.
How: after SGLang added its own arguments, add ours to the same parser (a named argument group).
Remove when: SGLang offers plugins a declared way to contribute CLI arguments.
"""

from __future__ import annotations

from ..flag_parser import add_flags

TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
KIND = "after"


def hook(result, parser, *args, **kwargs):
    add_flags(parser)
    return None
