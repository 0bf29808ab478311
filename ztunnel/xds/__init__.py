"""The control plane: delta ADS client for istiod, and protobuf -> state model conversion.

The only package that sees protobuf (``protos/`` holds the .proto files and protoc's output).
"""
