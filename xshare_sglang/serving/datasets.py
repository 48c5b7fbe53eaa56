"""Offline workloads for SGLang's benchmark client, built from the evaluation sets shipped in the package.

SGLang's ``random`` dataset downloads ShareGPT, so on a firewalled GPU node the client can only use
``random-ids`` or ``custom`` (a local JSON-lines file of ``{"conversations": [{"content": prompt},
{"content": completion}]}``; the client sends the prompt and, with ``--sharegpt-output-len`` unset,
asks for as many tokens as the completion has).  This module writes such files:

``mt-bench``
    Every turn of the 80 MT-Bench questions as its own prompt (160 prompts).  MT-Bench ships no
    answers, so the output length is fixed (``--sharegpt-output-len``).
``gsm8k``
    GSM8K test questions as ``"Question: ...\\nAnswer:"`` with the reference solution as completion,
    so each request asks for as many tokens as the worked answer has.

and names the GSM8K file that SGLang's few-shot GSM8K evaluation reads with ``--data-path``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

# Workload names accepted by the A/B tool and the calibration command, with what each needs.
CUSTOM_DATASETS: tuple[str, ...] = ("mt-bench", "gsm8k")
DATASETS: tuple[str, ...] = ("random-ids", *CUSTOM_DATASETS)


def eval_sets_dir() -> Path:
    """Folder of the shipped evaluation sets (``xshare_sglang/data/eval_sets``)."""
    return Path(str(resources.files("xshare_sglang") / "data" / "eval_sets"))


def gsm8k_path() -> Path:
    """The shipped GSM8K test split (1319 JSON lines with ``question`` and ``answer``)."""
    return eval_sets_dir() / "gsm8k_test.jsonl"


def mt_bench_path() -> Path:
    """The shipped MT-Bench questions (80 JSON lines with ``turns``)."""
    return eval_sets_dir() / "mt_bench_question.jsonl"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def custom_conversations(name: str) -> list[dict]:
    """The conversations of one shipped workload, in the ``custom`` dataset layout.

    Parameters
    ----------
    name : {"mt-bench", "gsm8k"}

    Returns
    -------
    list of dict
        ``{"conversations": [{"content": prompt}, {"content": completion}]}`` per request; the
        completion is empty for MT-Bench (no reference answers shipped).
    """
    if name == "mt-bench":
        return [
            {"conversations": [{"content": turn}, {"content": ""}]}
            for question in _read_jsonl(mt_bench_path())
            for turn in question["turns"]
        ]
    if name == "gsm8k":
        return [
            {"conversations": [{"content": f"Question: {item['question']}\nAnswer:"}, {"content": item["answer"]}]}
            for item in _read_jsonl(gsm8k_path())
        ]
    raise ValueError(f"dataset {name!r} is not a shipped custom workload; allowed: {', '.join(CUSTOM_DATASETS)}")


def write_custom_dataset(name: str, path: str | Path) -> Path:
    """Write one shipped workload as a ``custom`` dataset file for ``sglang.benchmark.serving``.

    Parameters
    ----------
    name : {"mt-bench", "gsm8k"}
    path : path
        The JSON-lines file to write (its folder is created).

    Returns
    -------
    Path
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = custom_conversations(name)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
