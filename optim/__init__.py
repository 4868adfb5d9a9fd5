"""Optax transforms backed by pallasopt's fused kernels."""
