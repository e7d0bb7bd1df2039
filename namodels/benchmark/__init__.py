"""Throughput benchmark."""
