"""The KV transfer, in one home with two sides (the shape of vLLM's KV connector).

- `producer.KVProducer` (the prefill's, one per process): exports the pool once, owns the event
  ring (acquire, record, quarantine, release), builds the REGISTER payload and keeps the leases.
- `consumer.KVConsumer` (the decode's, one per link): opens the peer's pool once, validates a
  HANDOFF, starts pulls (event wait + copy, ordered on the pull stream; on CUDA the reader waits
  on the returned event, and `completion.CompletionWaiter` reports the copy done for RELEASE),
  tracks pulls in flight, closes.

Both copy through `KVPool.copy_blocks_from`, the one block copy for every backend; the daemons
and `common.cache_manager.CacheManager` use the same objects. Messages cross between the sides only
as `common.protocol` frames (REGISTER → consumer, HANDOFF → consumer, RELEASE → producer).
"""

from common.transfer.consumer import KVConsumer, TransferRefused
from common.transfer.producer import KVProducer

__all__ = ["KVConsumer", "KVProducer", "TransferRefused"]
