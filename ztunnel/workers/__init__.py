"""Data-plane workers: N processes serving every pod's listeners beside one supervisor that owns
the control plane (ZDS, xDS, the CA, admin, metrics). See ARCHITECTURE.md "Workers"."""
