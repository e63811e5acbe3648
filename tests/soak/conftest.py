"""The soaks' machinery is the benches' (bench/soak.py, bench/api_soak.py: they also print the
figures); bench/ is scripts, not a package: its modules import by their file names."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
