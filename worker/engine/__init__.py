"""The engine loop (llm_engine.py) and its asyncio face (async_engine.py), the scheduler, the
block manager with its prefix cache, and the incremental detokenizer."""
