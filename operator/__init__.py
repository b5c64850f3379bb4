"""The pdserve Kubernetes operator: reconciles ModelServing resources (see docs/operator.md)."""
