"""Workload identity: certificates, the embedded local CA, the secret manager and HBONE TLS contexts."""
