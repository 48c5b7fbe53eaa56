"""Triton selection kernels and their graph-safe launch wrappers.

Not written yet: until they land, every caller uses the torch reference in
:mod:`xshare_sglang.policies`, which computes the same masks.
"""
