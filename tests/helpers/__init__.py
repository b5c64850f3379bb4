"""What many test modules need, written once: `engines` (an LLMEngine over a test checkpoint),
`metrics` (reading a /metrics page), `processes` (waiting for a server process to answer
/health, stopping it), `properties` (hypothesis settings for properties over live servers).
Free ports are `tests.net.free_port`; test checkpoints are `tests.checkpoints` and
`tests.fp8_checkpoints`."""
