"""``xshare-sglang calibrate``: the calibration file from SGLang's expert-distribution recorder (a live
server or its dumps) or from ``xshare-trace`` files: expert counts, co-activation counts, budget curves."""
