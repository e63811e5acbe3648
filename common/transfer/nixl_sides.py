"""The NIXL transport's two sides in one import: `NixlProducer` (nixl_producer.py, the
prefill's) and `NixlConsumer` (nixl_consumer.py, the decode's), with what they share
(nixl_shared.py). common.transfer.nixl_transport registers them as the "tcp" link kind."""

from __future__ import annotations

from common.transfer.nixl_consumer import NixlConsumer
from common.transfer.nixl_producer import NixlProducer
from common.transfer.nixl_shared import TRANSFERS, byte_runs, check_region, push_tag

__all__ = ["TRANSFERS", "NixlConsumer", "NixlProducer", "byte_runs", "check_region", "push_tag"]
