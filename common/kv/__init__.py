"""The KV cache's blocks: the pool and its layout (`pool`, `layout`), block ids and their copies
(`blockids`, `blockcopy`), the allocator with its leases and free runs (`allocator`, `leases`,
`free_runs`), and the prefix cache over it (`prefix_cache`, with the hash-chained block names of
`blockhash` and the name index of `block_names`)."""
