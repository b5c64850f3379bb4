"""pdserve.worker: the inference engine and its OpenAI server.

Kept import-light on purpose: the `pdserve` CLI lives here and must not pull in torch for
`pdserve router` or `pdserve operator`.
"""
