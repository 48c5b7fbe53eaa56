"""Which commit of this package produced a result, for benchmark and A/B records."""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["package_commit"]


def _checkout_root() -> Path | None:
    """The git checkout holding this package (an editable install), or ``None``."""
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return folder
    return None


def package_commit() -> str | None:
    """Commit of this package, or ``None`` when it cannot be told.

    From the git checkout that holds the package (an editable install): ``HEAD``, with ``-dirty`` when
    tracked files have uncommitted changes.  Otherwise the commit pip recorded when it installed the
    package from a VCS URL.  The lookup does not depend on the working directory.
    """
    root = _checkout_root()
    if root is not None:
        try:
            head = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            )
            if head.returncode == 0:
                changes = subprocess.run(
                    ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.strip()
                return head.stdout.strip() + ("-dirty" if changes else "")
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        direct = metadata.distribution("xshare-sglang").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if direct:
        commit = json.loads(direct).get("vcs_info", {}).get("commit_id")
        return commit if isinstance(commit, str) else None
    return None
