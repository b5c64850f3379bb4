"""Flow control at the router: priority bands, fairness between tenants, per-tenant limits and a
bounded queue in front of the workers (issue 49). Off unless `--flow-control-max-inflight` is set.

    request ─▶ band (bands.py) ─▶ tenant (tenants.py) ─▶ token rate (limits.py) ─▶ queue
           (queue.py: by band, then the least-served tenant of the band) ─▶ a lease while it is served

What is refused is refused with 429, `Retry-After` and a reason (queue_full, queue_timeout,
displaced, tenant_token_rate); bad input (a priority outside the bands, a malformed tenant or
priority header) with 400.
"""

from pdserve.router.flow_control.bands import PRIORITY_HEADER, band_of
from pdserve.router.flow_control.config import FlowControlConfig
from pdserve.router.flow_control.queue import FlowController, Lease, Ticket
from pdserve.router.flow_control.tenants import FAIRNESS_HEADER, tenant_of

__all__ = ["FAIRNESS_HEADER", "PRIORITY_HEADER", "FlowControlConfig", "FlowController", "Lease", "Ticket", "band_of",
           "tenant_of"]
