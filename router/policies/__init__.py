"""Worker selection as a pipeline of small plugins, in the shape of llm-d's scheduler:

    known workers ─▶ pool filters (role, health, model, revision) ─▶ P/D decider
                 ─▶ per phase: filters ─▶ scorers, in priority order ─▶ picker ─▶ one worker

Every plugin is registered by kind and name (`PLUGINS`). A policy (`--policy`,
`--prefill-policy`, `--decode-policy`) names a preset profile of filters, scorers and a picker
(`PRESETS`). Scores are compared as tuples in scorer order: the first scorer decides, the next
breaks its ties, and the picker resolves what is left. Third-party plugins come through the
entry-point group `pdserve.router.plugins` (entry name "kind:name", value a factory taking a
`PolicyContext`); a third-party policy through `pdserve.router.policies` (a factory returning
an object with `choose(workers, request)`).
"""

from pdserve.router.policies.interfaces import (Decider, Filter, Picker, Policy, PolicyContext, PoolFilter, PoolQuery,
                                                RoutingRequest, Scorer)
from pdserve.router.policies.registry import (PLUGIN_GROUP, PLUGINS, POLICY_GROUP, PRESETS, Preset, available, create,
                                              needs_kv_index, plugin)

__all__ = ["Decider", "Filter", "Picker", "Policy", "PolicyContext", "PoolFilter", "PoolQuery", "RoutingRequest",
           "Scorer", "PLUGIN_GROUP", "PLUGINS", "POLICY_GROUP", "PRESETS", "Preset", "available", "create",
           "needs_kv_index", "plugin"]
