"""Reading the files users hand to the command line, with one-line errors.

A file that is missing, empty, cut short or not what it claims to be raises :class:`InputFileError`,
whose message names the file and says what is wrong; the command line prints it as one line and
exits with status 2, without a traceback.  ``torch.load`` is only ever called with
``weights_only=True``, and its advice to retry without that (which would run code from the file) is
never passed on.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any


class InputFileError(ValueError):
    """A file given on the command line cannot be used; the message names it and says why."""


def existing_file(path: str | Path, what: str) -> Path:
    """``path`` as a Path; :class:`InputFileError` unless it is a readable file with content.

    ``what`` names the expected content, with its article (e.g. ``"a route_trace v1 CSV file"``).
    """
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"{path}: no such file (expected {what})")
    if path.is_dir():
        raise InputFileError(f"{path}: is a folder, expected {what}")
    if path.stat().st_size == 0:
        raise InputFileError(f"{path}: the file is empty (expected {what})")
    return path


def load_tensors(path: str | Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with one-line errors.

    Raises
    ------
    InputFileError
        Missing, empty, truncated or not a ``torch.save`` archive, or an archive holding Python
        objects other than tensors and plain containers (not loaded: that could run code).
    """
    import torch

    path = existing_file(path, what)
    if not zipfile.is_zipfile(path):
        raise InputFileError(
            f"{path}: not {what} (not a torch.save archive; a file cut short during copying also looks like this)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise InputFileError(
            f"{path}: not {what}: it holds Python objects other than tensors, numbers, strings, lists and dicts, "
            "and is not loaded because loading them could run code"
        ) from None
    except Exception as exc:  # torch raises many types for a damaged archive
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise InputFileError(
            f"{path}: not readable as {what} (the archive is damaged or cut short: {reason})"
        ) from None
