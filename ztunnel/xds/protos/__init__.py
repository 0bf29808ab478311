"""Protobuf messages for istiod: the xDS envelope, Address, Authorization and the CA service.

The ``*.proto`` files are this project's own, with the reference field numbers; the ``*_pb2``
modules are protoc output (``scripts/gen-protos.sh``) and are checked in.
"""
