"""Renderers: each reads a FlowMap and writes one format. None of them computes anything new."""
