"""Speculative decoding support: EAGLE-3 verify grouping, ECHO elastic draft budgets.

Not written yet.  Until it lands, ``xshare-spec`` and ``moe-spec`` take the request grouping as an
explicit ``tokens_per_request`` argument of :func:`xshare_sglang.select_experts_mask`.
"""
