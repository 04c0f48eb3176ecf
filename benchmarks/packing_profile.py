"""Where a packed SST-2 chunk spends its time: one logical batch of 256 training sentences (seeded, length-sorted,
four chunks of 64) forward and backward through all-MiniLM-L6-v2's mean-pooled head, non-private, one thread, as
length-sorted padded chunks, as one packed row per chunk (PackedClassificationCollator), and as packed rows of at most
128 / 256 tokens (each row its own forward: what a bounded packing width would cost), then a torch.profiler table of
the padded and the one-row runs.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.packing_profile

Why: `benchmarks.packing_speed` found the packed SST-2 arm slower than the grouped one (the padding it saves is
outweighed by attention over the whole ~840-token row: scores, softmax and attention dropout are L² per head).
"""

from __future__ import annotations

import os
import time

import torch


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from benchmarks.packing_speed import DEFAULT_DATA_DIR
    from benchmarks.utility import find_model_dir
    from hf_private import MeanPooledBertForSequenceClassification
    from hf_private.data.files import read_data_file
    from hf_private.data.packing import PackedClassificationCollator

    model_dir = find_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = read_data_file(str(DEFAULT_DATA_DIR / "train.tsv")).shuffle(seed=0).select(range(256))
    encoded = tokenizer(list(data["sentence"]), truncation=True, max_length=128)
    features = sorted(
        (
            {"input_ids": i, "attention_mask": a, "label": label}
            for i, a, label in zip(encoded["input_ids"], encoded["attention_mask"], data["label"])
        ),
        key=lambda f: len(f["input_ids"]),
    )
    model = MeanPooledBertForSequenceClassification.from_pretrained(model_dir, num_labels=2).train()
    padded, packed = DataCollatorWithPadding(tokenizer), PackedClassificationCollator()

    def rows_of(width: int):
        def split(part: list[dict]) -> list[list[dict]]:
            rows, row, tokens = [], [], 0
            for feature in part:
                if tokens + len(feature["input_ids"]) > width and row:
                    rows.append(row)
                    row, tokens = [], 0
                row.append(feature)
                tokens += len(feature["input_ids"])
            return [*rows, row]

        return split

    def run(collate, split=None) -> None:
        for c in range(4):
            part = features[c * 64 : (c + 1) * 64]
            for group in [part] if split is None else split(part):
                model(**collate(group)).loss.backward()

    for name, collate, split in [
        ("padded, length-sorted", padded, None),
        ("packed, one row per chunk", packed, None),
        ("packed rows <= 128 tokens", packed, rows_of(128)),
        ("packed rows <= 256 tokens", packed, rows_of(256)),
    ]:
        run(collate, split)  # warm-up
        start = time.perf_counter()
        for _ in range(2):
            run(collate, split)
        print(f"{name:28s} {(time.perf_counter() - start) / 2 / 256 * 1e3:.1f} ms/example")
    for name, collate in [("padded, length-sorted", padded), ("packed, one row per chunk", packed)]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(collate)
        print("==", name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
