"""One request inside the engine: its state (request.py), sampling parameters and structured-output
spec (sampling_params.py), stop strings, the outputs handed back, and the rule that one
request's failure inside a step stays that request's (isolation.py)."""
