"""Structured outputs: grammars compiled per spec and a matcher per request
(structured_output.py), compiled off the event loop (grammar_pool.py), schemas closed
unless they say otherwise (closed_schema.py)."""
