"""Helpers the command line's subcommand modules share (``cli`` and ``tiny.quality_cli``).

* :func:`_console` - a rich console at least 170 columns wide (the tables are wide);
* :func:`_progress` - the progress bar of a run over configurations;
* :func:`_configs_file` - the ``--configs`` file: a JSON list of :class:`~xshare_sglang.config.PrunerConfig`.

Nothing here imports a subcommand module, so every subcommand module can import it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .config import PrunerConfig

logger = logging.getLogger(__name__)


def _console():
    """A rich console at least 170 columns wide."""
    from rich.console import Console

    return Console(width=max(Console().width, 170))


def _progress(console):
    """A progress bar on ``console``: done / total, time spent and time left."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console,
    )


def _configs_file(path: str) -> list[PrunerConfig]:
    """The configurations of a ``--configs`` file (a non-empty JSON list of ``PrunerConfig`` objects).

    Raises
    ------
    ValueError
        When the file cannot be read, is not JSON or is not a non-empty list; the message names ``--configs``.
    """
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--configs {path}: not a readable JSON file ({exc})") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"--configs {path}: expected a non-empty JSON list of PrunerConfig objects")
    return [PrunerConfig.load(item) for item in items]
