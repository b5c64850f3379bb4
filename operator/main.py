"""`pdserve operator`: run the ModelServing operator against the current kubeconfig or in-cluster."""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable); default: the kubeconfig context's namespace")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--kubeconfig", default=None, metavar="PATH",
                        help="kubeconfig to use (default: in-cluster credentials in a pod, else KUBECONFIG)")
    parser.add_argument("--resync-seconds", type=float, default=None,
                        help="full reconcile period per ModelServing (default 15, env PDSERVE_OPERATOR_RESYNC_SECONDS)")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    import kopf

    from pdserve.operator.config import OperatorConfig, kubeconfig_namespace
    from pdserve.operator.handlers import build_registry

    try:
        config = OperatorConfig.from_env(namespaces=tuple(args.namespace) or None,
                                         all_namespaces=args.all_namespaces,
                                         resync_interval_s=args.resync_seconds, kubeconfig=args.kubeconfig)
    except ValueError as e:
        print(f"pdserve operator: {e}", file=sys.stderr)
        return 2
    namespaces = config.namespaces
    if not config.all_namespaces and not namespaces:
        namespaces = (kubeconfig_namespace(config.kubeconfig),)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One operator per cluster is the deployment model (the chart runs one replica), so no
    # peering objects are needed.
    kopf.run(registry=build_registry(config), standalone=True, clusterwide=config.all_namespaces,
             namespaces=() if config.all_namespaces else namespaces, liveness_endpoint=args.liveness)
    return 0
