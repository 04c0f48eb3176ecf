"""recipes/glue.py: the offline demo, paper defaults, local data files in every format, GLUE metrics through the
shipped evaluate module, clear errors for bad input, and a 2-process `accelerate launch`."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from tests.support import tiny
from tests.support.launch import accelerate_launch

ROOT = Path(__file__).resolve().parents[2]
SHARED_SST2 = ROOT.parent / "shared" / "data" / "sst2"
sys.path.insert(0, str(ROOT / "recipes"))
import glue  # noqa: E402
import glue_data  # noqa: E402
from paper_defaults import split_batch  # noqa: E402

from hf_private.methods import method_class, registered_methods  # noqa: E402

QUIET = ["--disable_tqdm", "true", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true"]
FAST = [*QUIET, "--accountant", "rdp"]  # RDP calibrates in a fraction of PRV's time; the demo tests keep PRV
SAVED = {
    "dp-sgd": "model.safetensors",
    "dp-lora": "adapter_model.safetensors",
    "dp-bitfit": "private_adapter.safetensors",
    "dp-frost": "private_adapter.safetensors",
    "sparse-lowrank": "adapter_model.safetensors",
    "dp-fp": "private_adapter.safetensors",
}


@pytest.mark.parametrize("method", sorted(SAVED))
def test_demo_runs_and_writes_adapter_ledger_and_card(tmp_path, method, caplog):
    with caplog.at_level("INFO"):
        result = glue.main(["--output_dir", str(tmp_path), "--max_steps", "3", "--method", method, *QUIET])
    assert 0 < result["epsilon"] <= 8.0 and 0.0 <= result["accuracy"] <= 1.0
    assert "DEMO" in caplog.text and "not GLUE" in caplog.text
    assert (tmp_path / SAVED[method]).is_file() and (tmp_path / "dp_config.json").is_file()
    card = ModelCard.load(tmp_path / "README.md")
    privacy = card.data.to_dict()["privacy"]
    assert privacy["guarantee"] == "formal" and privacy["epsilon"] == pytest.approx(result["epsilon"])
    assert "generated demo sentiment data" in card.text and "eval_accuracy" in card.text
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    training = {phase["mechanism"] for phase in privacy["phases"]}
    assert sum(m["steps"] for m in ledger["mechanisms"] if m["name"] in training) == 3 == result["steps"]
    assert privacy["method"] == method and set(ledger["mechanisms"][0]) >= {"name", "noise_multiplier", "steps"}


def test_demo_task_caps_accuracy_below_one_and_needs_word_order():
    """The demo's label is the last sentiment word's, flipped for about 5% of reviews: no model reaches 1.0."""
    from demo_task import LABEL_NOISE, sentiment_splits

    from hf_private.demos import sentiment as demo

    data = sentiment_splits()
    both = disagree = 0
    for split in ("train", "validation"):
        for text, label in zip(data[split]["sentence"], data[split]["label"]):
            sentiment = [word in demo.POSITIVE for word in text.split() if word in demo.POSITIVE + demo.NEGATIVE]
            both += len(set(sentiment)) == 2
            disagree += int(sentiment[-1]) != label
    reviews = data.num_rows["train"] + data.num_rows["validation"]
    assert both > reviews / 4  # the word order matters for many reviews
    assert abs(disagree / reviews - LABEL_NOISE) < 0.01


@pytest.mark.parametrize("method", ["dp-adam", "full", "sparse"])
def test_unregistered_methods_are_refused_naming_the_registered_ones(tmp_path, method):
    with pytest.raises(SystemExit, match=f"--method must be one of {', '.join(registered_methods())}, got"):
        glue.main(["--output_dir", str(tmp_path), "--method", method])


def test_short_method_names_are_the_registered_ones(tmp_path):
    common = ["--model_name_or_path", "unused", "--output_dir", str(tmp_path), "--use_cpu", "true"]
    recipe, args, _ = glue.parse_args([*common, "--method", "frost", "--task", "qnli"])
    assert recipe.method == "dp-frost" and recipe.method_fields["unfreeze_ratio"] == 0.25**2
    assert (recipe.expected_batch_size, args.num_train_epochs, args.learning_rate, recipe.clip_norm) == (
        1593,
        6,
        1e-3,
        "auto",
    )
    assert glue.parse_args([*common, "--method", "bitfit"])[0].method == "dp-bitfit"
    recipe, args, _ = glue.parse_args([*common, "--method", "dpfp"])
    assert (
        recipe.method,
        recipe.method_fields["mode"],
        recipe.expected_batch_size,
        args.learning_rate,
        recipe.max_seq_length,
    ) == ("dp-fp", "sound", 1, 5e-6, 128)
    recipe, args, _ = glue.parse_args([*common, "--method", "sparse_lowrank", "--variant", "rgp"])
    assert (
        recipe.method,
        recipe.method_fields["variant"],
        recipe.expected_batch_size,
        args.num_train_epochs,
        args.learning_rate,
        recipe.clip_norm,
    ) == ("sparse-lowrank", "rgp", 2000, 20, 1e-3, "auto")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "adam"], "--method must be one of"),
        (["--task", "wnli"], "Unknown --task"),
        (["--task", "mnli"], "offline demo is a sentiment task"),
        (["--train_file", "train.tsv"], "give --model_name_or_path"),
        (["--clip_norm", "large"], "--clip_norm must be a positive number or 'auto'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        glue.main(["--output_dir", str(tmp_path), *argv])


# ---------------------------------------------------------------- paper defaults
def test_paper_defaults_apply_and_flags_override(tmp_path):
    common = ["--model_name_or_path", "unused", "--output_dir", str(tmp_path), "--use_cpu", "true"]
    recipe, args, demo = glue.parse_args([*common, "--task", "qnli", "--method", "dp-bitfit"])
    assert not demo and (args.learning_rate, args.num_train_epochs, recipe.clip_norm) == (5e-3, 6, "auto")
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 2000 == recipe.expected_batch_size
    assert args.per_device_train_batch_size <= 32 and recipe.max_seq_length == 256

    recipe, args, _ = glue.parse_args(
        [
            *common,
            "--method",
            "dp-lora",
            "--learning_rate",
            "2e-4",
            "--lora_r",
            "4",
            "--per_device_train_batch_size",
            "100",
            "--clip_norm",
            "10",
        ]
    )
    assert (args.learning_rate, recipe.method_fields["lora_r"], recipe.clip_norm, args.num_train_epochs) == (
        2e-4,
        4,
        "10",
        20,
    )
    assert recipe.method_fields["lora_alpha"] == 16  # the paper's, declared by the method
    with pytest.raises(ValueError, match="lora_r"):  # a method's own flag belongs to that method only
        glue.parse_args([*common, "--method", "dp-sgd", "--lora_r", "4"])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (100, 20)

    _, args, _ = glue.parse_args([*common, "--gradient_accumulation_steps", "3"])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (32, 3)


def test_help_lists_the_methods_and_says_the_paper_defaults_need_a_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        glue.parse_args(["--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"DP method: one of {', '.join(registered_methods())}, or a short name" in shown
    assert "registered_methods()" not in shown
    assert (
        f"--quick [QUICK] A CPU-sized run: the paper defaults capped at a logical batch of {glue.QUICK_BATCH}, "
        f"{glue.QUICK_EPOCHS} epochs, {glue.QUICK_SEQ_LENGTH} tokens and the first {glue.QUICK_TRAIN_SAMPLES:,} "
        "training rows"
    ) in shown
    assert "The paper defaults themselves (e.g. dp-lora's batch of 2,000 for 20 epochs) need a GPU." in shown
    assert "--head {auto,cls,mean}" in shown


@pytest.mark.parametrize("method", sorted(SAVED))
def test_quick_caps_the_paper_defaults_and_flags_still_override(tmp_path, method):
    common = ["--model_name_or_path", "unused", "--output_dir", str(tmp_path), "--use_cpu", "true", "--method", method]
    paper_recipe, paper_args, _ = glue.parse_args(common)
    recipe, args, _ = glue.parse_args([*common, "--quick"])
    assert recipe.expected_batch_size == min(paper_recipe.expected_batch_size, glue.QUICK_BATCH)
    assert args.num_train_epochs == min(paper_args.num_train_epochs, glue.QUICK_EPOCHS)
    assert recipe.max_seq_length == min(paper_recipe.max_seq_length, glue.QUICK_SEQ_LENGTH)
    assert recipe.max_train_samples == glue.QUICK_TRAIN_SAMPLES and paper_recipe.max_train_samples is None
    assert (args.learning_rate, recipe.clip_norm, recipe.method_fields) == (
        paper_args.learning_rate,
        paper_recipe.clip_norm,
        paper_recipe.method_fields,
    )
    recipe, args, _ = glue.parse_args([*common, "--quick", "--num_train_epochs", "1", "--max_train_samples", "500"])
    assert (args.num_train_epochs, recipe.max_train_samples) == (1, 500)


def test_paper_tables_and_batch_split():
    defaults = {name: method_class(name).recipe_defaults for name in registered_methods()}
    assert astuple(defaults["dp-bitfit"]("sst2"))[:4] == (1000, 3, 5e-3, 0.1)
    assert astuple(defaults["dp-sgd"]("mnli"))[:4] == (6000, 18, 5e-4, 0.1)
    assert astuple(defaults["dp-lora"]("qnli"))[:4] == (2000, 20, 1e-3, 10.0)
    assert not defaults["dp-bitfit"]("cola").from_paper and defaults["dp-lora"]("sst2").from_paper
    assert split_batch(1000, 32, 1) == (25, 40)
    assert split_batch(6000, 64, 2) == (60, 50)
    assert split_batch(256, 256, 2) == (128, 1)
    physical, steps = split_batch(997, 32, 1)  # prime: no exact split, nearest reported
    assert physical <= 32 and abs(physical * steps - 997) < steps


# ---------------------------------------------------------------- local data
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A "pre-trained" encoder without a task head, like roberta-base: the recipe adds a new head."""
    path = tmp_path_factory.mktemp("tiny-roberta")
    tiny.roberta().roberta.save_pretrained(path)
    tiny.tokenizer().save_pretrained(path)
    return str(path)


def _sentences(n: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    labels = [rng.randint(0, 1) for _ in range(n)]
    texts = [
        " ".join(rng.choices(tiny.NEUTRAL, k=4) + rng.choices(tiny.POSITIVE if y else tiny.NEGATIVE, k=2))
        for y in labels
    ]
    return texts, labels


def _write(path: Path, columns: dict[str, list]) -> str:
    import pandas as pd

    frame = pd.DataFrame(columns)
    suffix = path.suffix
    if suffix == ".tsv":
        frame.to_csv(path, sep="\t", index=False)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix in (".json", ".jsonl"):
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".tsv", ".csv", ".jsonl", ".parquet"])
def test_every_file_format_loads_with_checked_labels(tmp_path, suffix):
    texts, labels = _sentences(20, 0)
    train = _write(tmp_path / f"train{suffix}", {"sentence": texts, "label": labels})
    raw = glue_data.load_local(train, None)
    data = glue_data.prepare(raw, "sst2", ("sentence",), "label", {"train": train})
    assert data["train"]["label"] == labels and data["train"].column_names == ["sentence", "label"]


def test_spelled_out_labels_and_pairs_are_mapped(tmp_path):
    path = _write(
        tmp_path / "dev.csv",
        {"sentence1": ["a", "b"], "sentence2": ["c", "d"], "label": ["not_entailment", "entailment"]},
    )
    data = glue_data.prepare(glue_data.load_local(path, None), "rte", ("sentence1", "sentence2"), "label", {})
    assert data["train"]["label"] == [1, 0]


@pytest.mark.parametrize(
    "columns, suffix, message",
    [
        ({"text": ["a"], "label": [0]}, ".csv", r"lacks column\(s\) \['sentence'\]"),
        ({"sentence": ["a"], "label": [-1]}, ".csv", "unlabelled test split"),
        ({"sentence": ["a"], "label": [3]}, ".csv", r"outside 0\.\.1"),
        ({"sentence": ["a"], "label": ["great"]}, ".csv", "are not sst2 labels"),
        ({"sentence": ["a"], "label": [0]}, ".txt", "supported formats"),
    ],
)
def test_bad_data_files_get_clear_errors(tmp_path, model_dir, columns, suffix, message):
    path = tmp_path / f"train{suffix}"
    _write(path.with_suffix(".csv"), columns)
    if suffix != ".csv":
        shutil.move(path.with_suffix(".csv"), path)
    with pytest.raises(SystemExit, match=message):
        glue.main(["--model_name_or_path", model_dir, "--train_file", str(path), "--output_dir", str(tmp_path)])


def test_missing_file_and_offline_hub_say_what_to_do(tmp_path, model_dir):
    with pytest.raises(SystemExit, match="does not exist"):
        glue.main(
            [
                "--model_name_or_path",
                model_dir,
                "--train_file",
                str(tmp_path / "nope.tsv"),
                "--output_dir",
                str(tmp_path),
            ]
        )
    with pytest.raises(SystemExit, match="HF_HUB_OFFLINE.*--train_file"):
        glue.main(["--model_name_or_path", model_dir, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize(
    "task, suffix, metric", [("sst2", ".tsv", "accuracy"), ("mrpc", ".jsonl", "f1"), ("stsb", ".parquet", "pearson")]
)
def test_local_files_train_a_pretrained_model_and_report_the_glue_metric(tmp_path, model_dir, task, suffix, metric):
    files = {}
    for split, n in (("train", 48), ("dev", 24)):
        texts, labels = _sentences(n, seed=len(split))
        if task == "sst2":
            table = {"sentence": texts, "label": labels}
        else:
            table = {
                "sentence1": texts,
                "sentence2": list(reversed(texts)),
                "label": [float(y) * 5 for y in labels] if task == "stsb" else labels,
            }
        files[split] = _write(tmp_path / f"{split}{suffix}", table)
    # sst2 reads GLUE's layout through --data_dir (train.tsv + dev.tsv), the others name their files.
    data = (
        ["--data_dir", str(tmp_path)]
        if task == "sst2"
        else ["--train_file", files["train"], "--validation_file", files["dev"]]
    )
    result = glue.main(
        [
            "--model_name_or_path",
            model_dir,
            "--task",
            task,
            "--method",
            "dp-bitfit",
            *data,
            "--max_steps",
            "1",
            "--expected_batch_size",
            "16",
            "--max_seq_length",
            "16",
            "--output_dir",
            str(tmp_path / "out"),
            *FAST,
        ]
    )
    assert metric in result["metrics"] and result["steps"] == 1
    assert result["clip_norm"] > 0  # --clip_norm auto (the default): measured on generated sentences
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert f"eval_{metric}" in card.text
    assert card.data.base_model is None and "path is withheld" in card.text  # a local path, not a Hub id:
    assert model_dir not in (tmp_path / "out" / "README.md").read_text()  # never written (issue 18)


def test_quick_trains_on_the_first_rows_of_a_pretrained_model_and_says_so_on_the_card(tmp_path, model_dir):
    files = {}
    for split, n in (("train", 300), ("dev", 24)):
        texts, labels = _sentences(n, seed=len(split))
        files[split] = _write(tmp_path / f"{split}.tsv", {"sentence": texts, "label": labels})
    result = glue.main(
        [
            "--model_name_or_path",
            model_dir,
            "--data_dir",
            str(tmp_path),
            "--quick",
            "--max_train_samples",
            "280",
            "--output_dir",
            str(tmp_path / "out"),
            *FAST,
        ]
    )
    assert result["steps"] > 0 and "accuracy" in result["metrics"]
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "its first 280 training rows" in card.text
    ledger = json.loads((tmp_path / "out" / "privacy_ledger.json").read_text())
    assert ledger["dataset_size"] == 280


@pytest.fixture(scope="module")
def mean_pooling_model_dir(tmp_path_factory, model_dir):
    """The encoder of `model_dir` as a sentence-transformers checkpoint that pools by mean (like all-MiniLM-L6-v2)."""
    path = tmp_path_factory.mktemp("tiny-roberta-mean")
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    (path / "modules.json").write_text(
        json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return str(path)


def test_head_is_chosen_as_sentence_classifier_does_and_the_flag_overrides(
    tmp_path, model_dir, mean_pooling_model_dir, caplog
):
    def head(path, *flags):
        recipe, _, _ = glue.parse_args(
            ["--model_name_or_path", path, "--output_dir", str(tmp_path), "--use_cpu", "true", *flags]
        )
        return type(glue._load_model(recipe)[1]).__name__

    assert head(mean_pooling_model_dir) == "MeanPooledRobertaForSequenceClassification"
    assert head(mean_pooling_model_dir, "--head", "cls") == "RobertaForSequenceClassification"
    assert head(model_dir) == "RobertaForSequenceClassification"  # no pooling config: the CLS head
    assert head(model_dir, "--head", "mean") == "MeanPooledRobertaForSequenceClassification"
    with pytest.raises(SystemExit):
        glue.parse_args(["--model_name_or_path", model_dir, "--head", "max"])


@pytest.mark.skipif(not SHARED_SST2.is_dir(), reason="shared/data/sst2 is not on this machine")
def test_shared_sst2_layout_works_as_is():
    """The real SST-2 files (sentence<TAB>label, bare quotes in sentences) load row for row through --data_dir."""
    train, dev = glue_data.find_data_files(str(SHARED_SST2))
    assert (Path(train).name, Path(dev).name) == ("train.tsv", "dev.tsv")
    data = glue_data.prepare(glue_data.load_local(train, dev), "sst2", ("sentence",), "label", {})
    assert (len(data["train"]), len(data["validation"])) == (67349, 872)
    assert set(data["validation"]["label"]) == {0, 1}
    assert data["validation"][0]["sentence"].startswith("it 's a charming and often affecting journey")


# ---------------------------------------------------------------- accelerate
def test_a_finished_run_exits_zero_after_the_exit_handlers_with_its_output_flushed(tmp_path):
    """`exit_after_success` (the recipes' last call) skips only the interpreter's native teardown: Python's exit
    handlers still run, and output still buffered in the streams is written."""
    marker = tmp_path / "handler-ran"
    script = (
        "import atexit, pathlib, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'recipes')!r})\n"
        "from process_group import exit_after_success\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
        "sys.stdout.write('buffered, no newline')\n"
        "sys.stderr.write('and on stderr')\n"
        "exit_after_success()\n"
        "print('never reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "buffered, no newline", "and on stderr")
    assert marker.read_text() == "yes"


def test_recipe_runs_unchanged_under_a_two_process_accelerate_launch(tmp_path):
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate CLI not on PATH")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = accelerate_launch(
        "recipes/glue.py",
        *("--method", "dp-bitfit", "--max_steps", "2", "--output_dir", str(tmp_path), *FAST),
        launcher=(accelerate, "launch"),
    )
    run = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    privacy = ModelCard.load(tmp_path / "README.md").data.to_dict()["privacy"]
    assert sum(m["steps"] for m in privacy["mechanisms"]) == 2
    assert "× 2 processes" in run.stderr, "the launch did not start two processes"
