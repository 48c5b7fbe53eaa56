"""Client-side tools for running SGLang servers: A/B serving comparisons and static-ranking calibration.

Nothing here is imported by the plugin; these modules start servers, drive SGLang's own benchmark and
evaluation clients, and read what the servers report.
"""
