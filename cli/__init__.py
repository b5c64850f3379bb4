"""pdserve.cli: the `pdserve` console script and `pdserve up`, the local stack.

`main.py` dispatches subcommands to their components; `stack.py` plans the local stack's
processes (pure); `launcher.py` starts, watches and stops them.
"""
