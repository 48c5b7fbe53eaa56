#!/usr/bin/env python
"""A/B serving comparison of pruner configurations against the unpruned SGLang server.

The same tool is installed as the console script ``xshare-ab-compare``; this file runs it from a
source checkout.  ``python scripts/ab_compare.py --help`` lists the flags; docs/serving.md, section "A/B
comparison" walks through a complete run and how to read its report.
"""

import sys

from xshare_sglang.serving.ab.ab_cli import main

if __name__ == "__main__":
    sys.exit(main())
