"""The KV transfer, in one home with two sides (the shape of vLLM's KV connector).

- `interface`: what every transport does (`Producer`, the prefill's, one per process;
  `Consumer`, the decode's, one per link) and what it declares it can do (`Capabilities`).
- `registry`: the transport of each link kind ("unix", "tcp"), its producer and, once per
  daemon, the resources its consumers share; the daemons get their sides only from here.
- The IPC pair for one host: `producer.KVProducer` (exports the pool once, owns the event ring),
  `consumer.KVConsumer` (maps the peer's pool once per link; on CUDA `completion` reports a
  pull's copy done for RELEASE), `regions` (export once / open once); `unix_transport`.
- The NIXL pair across hosts: `nixl_producer`, `nixl_consumer` (`nixl_sides` imports both),
  `nixl_agent` + `nixl_worker` (one agent per process); `nixl_transport`.

Messages cross between the sides only as `common.protocol` frames (REGISTER → consumer, HANDOFF
→ consumer, RELEASE → producer, and a transport's own frames through `handle_frame`).
`common.transfer.cache_manager.CacheManager` uses the same IPC objects as the daemons.
"""

from common.transfer.consumer import KVConsumer
from common.transfer.interface import Capabilities, Consumer, Producer, TransferRefused
from common.transfer.producer import KVProducer

__all__ = ["Capabilities", "Consumer", "KVConsumer", "KVProducer", "Producer", "TransferRefused"]
