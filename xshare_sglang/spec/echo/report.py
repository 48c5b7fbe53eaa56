"""The calibration report, as ``echo-calibrate`` and ``spec-eval`` print it."""

from __future__ import annotations

import math

from .calibrate import EchoCalibration


def calibration_table(calibration: EchoCalibration):
    """A ``rich`` table: per depth, samples, accepted share, AUC, threshold, Youden J, TPR, FPR, gated."""
    from rich.table import Table

    table = Table(
        title=f"ECHO calibration: {calibration.records} verify steps, {calibration.num_steps} draft steps x "
        f"top-{calibration.topk}, {calibration.num_draft_tokens} draft tokens",
        title_justify="left",
    )
    for column in ("depth", "samples", "accepted share", "AUC", "threshold", "Youden J", "TPR", "FPR", "gated"):
        table.add_column(column, justify="right")
    for row in calibration.depths:
        table.add_row(
            str(row.depth),
            str(row.samples),
            f"{row.positives / max(row.samples, 1):.1%}",
            "n/a" if math.isnan(row.auc) else f"{row.auc:.3f}",
            f"{row.threshold:.4g}" if math.isfinite(row.threshold) else "none",
            f"{row.youden_j:.3f}",
            f"{row.tpr:.3f}",
            f"{row.fpr:.3f}",
            "yes" if row.gated else "no",
        )
    return table
