"""Importable test helpers: the network-namespace test bed and small test apps (never product code)."""
