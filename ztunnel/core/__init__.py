"""Pure value types shared by every layer: addresses, SPIFFE identities, errors. No I/O."""
