"""A small multiple-choice lm-eval task over the example chat model's facts, written where a test says: a task
YAML file (its data a local JSONL file, so nothing is downloaded) in a folder to give as eval.harness.include_path."""

from __future__ import annotations

import json
from pathlib import Path

FACTS = [("What color is the sky?", 1, ["The sky is green.", "The sky is blue.", "The sky is red."]),
         ("What is the capital of France?", 1, ["The capital of France is Rome.", "The capital of France is Paris.",
                                                "The capital of France is Cairo."]),
         ("How many legs does a dog have?", 2, ["A dog has eight legs.", "A dog has two legs.",
                                                "A dog has four legs."]),
         ("What do bees make?", 0, ["Bees make honey.", "Bees make water.", "Bees make stone."])]


def write_task(folder: Path, name: str = "facts") -> Path:
    tasks = folder / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w") as f:
        for q, answer, choices in FACTS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (tasks / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tasks
