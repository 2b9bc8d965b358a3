"""Where outpace keeps what it fetches, converts, builds and measures: $OUTPACE_HOME, else
~/.cache/outpace (downloads/, models/, kernels/, calibration/)."""
from __future__ import annotations

import os
from pathlib import Path


def outpace_home() -> Path:
    return Path(os.environ.get("OUTPACE_HOME") or Path.home() / ".cache" / "outpace").expanduser()
