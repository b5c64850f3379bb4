"""KV transfer between prefill and decode workers.

Two halves, as in vLLM: the engine (scheduler side) decides which blocks a request pins, pulls
or frees; this package moves the bytes. `connector.KVConnector` is the worker-side entry
point; transports (`tcp_transport`, `nixl_transport`) share one side channel (`side_channel`)
for authentication, leasing and release.
"""
