"""``python -m xshare_sglang.kernels.plan``: print the fused kernels' dispatch table (see :mod:`.table`)."""

from .table import main

raise SystemExit(main())
