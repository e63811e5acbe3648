"""What a daemon stands on, whichever its role: the loop, signals and listening sockets
(`lifecycle`), the server scaffolding (`server`), the shared settings (`config`), the model
runtime and torch thread (`runtime`; each daemon brings its own warm-up), the runtime dir, logs,
sd_notify, heap and CPU-slice tuning, the kernel cache and the throughput meter."""
