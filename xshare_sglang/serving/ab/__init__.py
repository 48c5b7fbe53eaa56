"""``xshare-ab-compare``: A/B serving comparisons of pruner settings on live SGLang servers (arms,
the run plan, launching and probing servers, SGLang's own benchmark and GSM8K clients, the report)."""
