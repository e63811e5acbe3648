"""Cross-host tests need NIXL (the `pdkv[nixl]` extra, installed by `make install`)."""

from __future__ import annotations

import pytest

from common.transfer.nixl_agent import NIXL_MISSING, nixl_available

if not nixl_available():
    pytest.skip(NIXL_MISSING, allow_module_level=True)
