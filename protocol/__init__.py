"""pdserve.protocol: what the components say to each other and to clients.

The OpenAI request/response/chunk models, the one error table, SSE and client-disconnect
helpers, body reading and API-key checks, the typed `KVTransferParams` of the P/D handshake,
the KV-event wire format, the contract constants (labels, ports, environment names), and
`flags.py`, which turns each component's frozen config dataclass into its command-line flags.
The worker and the router both import this package; neither imports the other.
"""
