"""The shipped tiny MoE models at work: loading them with a routing hook, the demo, speculative
decoding with the tiny draft (``spec-eval``), and the teacher-forced quality measures (``quality``).

The trace-based tools these build on (the trace format, replay, the cost model, plots) are in
:mod:`xshare_sglang.replay`.  Nothing here imports SGLang; ``transformers`` loads the models.
"""
