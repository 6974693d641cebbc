"""Thin gRPC servicers: each method calls the pipeline and a translator, nothing more."""
