"""DP step time and peak memory against non-private training of the same model, in one process.

    python -m benchmarks.speed --models bert-base gpt2-small --seq-lens 128 512 --modes full lora

For every (model, T, mode) the arms — non-private, hf_private, Opacus hooks, Opacus ghost — run in alternating
rounds on the same batch, so machine load hits them alike; the table reports median step time and peak memory as
ratios to the non-private arm. Models are built from config (random init): speed does not depend on the weights.

Correlated noise (issue 50) against DP-SGD, on request: `--arms hf_private hf_private-band-mf
hf_private-band-inv-mf-store hf_private-band-inv-mf-regenerate` (b = `BANDS`, BandMF's strategy for `STRATEGY_STEPS`
steps; each arm's history warmed to b − 1 past steps first, so every timed step is a steady-state one).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from benchmarks.memory import peak_bytes, reset_peak
from hf_private import BitFitConfig
from hf_private.engine import PerExampleGradientEngine
from hf_private.integrations.losses import default_per_example_loss
from hf_private.optimizer import NoisyOptimizer
from hf_private.privacy.band_inv_mf import BandedInverseNoise
from hf_private.privacy.band_mf import BandedNoise, strategy
from hf_private.privacy.noise import GaussianNoise

logger = logging.getLogger("benchmarks.speed")

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "bert-base": lambda: BertForSequenceClassification(BertConfig(num_labels=2)),
    "roberta-base": lambda: RobertaForSequenceClassification(
        RobertaConfig(vocab_size=50265, max_position_embeddings=514, num_labels=2)
    ),
    "gpt2-small": lambda: GPT2LMHeadModel(GPT2Config()),
    # issue 47's shapes: a Qwen3 (q/k norms: the matched norm rule) and a Mixtral (the router and fused experts)
    "qwen3-8x512": lambda: Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=2048,
        )
    ),
    "mixtral-4x2": lambda: MixtralForCausalLM(
        MixtralConfig(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=2048,
        )
    ),
}
LORA_TARGETS = {
    "bert-base": ["query", "value"],
    "roberta-base": ["query", "value"],
    "gpt2-small": ["c_attn"],
    "qwen3-8x512": ["q_proj", "v_proj"],
    "mixtral-4x2": ["q_proj", "v_proj"],
}
CLIP, SIGMA = 1.0, 1.0
# the correlated-noise arms (issue 50): b, and the run length BandMF's strategy is optimised for (the SST-2 runs')
BANDS, STRATEGY_STEPS = 8, 234


def make_chunks(model: torch.nn.Module, batch_size: int, seq_len: int, grad_accum: int, device: torch.device):
    """`grad_accum` physical chunks of one logical batch. Position ids are explicit and batch-shaped for every
    arm alike, because Opacus' hooks fail on HF's broadcast [1, T] position ids (hf_private handles both)."""
    base = getattr(model, "get_base_model", lambda: model)()
    is_lm = type(base).__name__.endswith(("LMHeadModel", "ForCausalLM"))
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for _ in range(grad_accum):
        ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=gen)
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(seq_len).expand(batch_size, -1).contiguous(),
            "labels": ids.clone() if is_lm else torch.randint(0, 2, (batch_size,), generator=gen),
        }
        if not is_lm:
            batch["token_type_ids"] = torch.zeros_like(ids)
        chunks.append({k: v.to(device) for k, v in batch.items()})
    return chunks


def per_example_loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"])


class NonPrivate:
    name = "non-private"

    def __init__(self, model, batch_size):
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(self, chunks):
        self.optimizer.zero_grad(set_to_none=True)
        for batch in chunks:
            per_example_loss(self.model, batch).mean().backward()
        self.optimizer.step()


class HfPrivate:
    name = "hf_private"

    def __init__(self, model, batch_size):
        self.model = model
        self.engine = PerExampleGradientEngine(model, CLIP)
        self.engine.attach()
        device = next(model.parameters()).device
        inner = torch.optim.AdamW([p for _, p in self.engine.parameters], lr=1e-5)
        self.optimizer = NoisyOptimizer(
            inner,
            self.engine,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            expected_batch_size=batch_size,
            noise=GaussianNoise(device),
            may_step=lambda: True,
            on_step=lambda: None,
        )
        self.batch_size = batch_size

    def step(self, chunks):
        # as Trainer does after every optimizer step (model.zero_grad()): last step's released gradients are not kept
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.prepare_noise()  # as the trainer does: the noise is drawn while the chunks run
        for batch in chunks:
            with self.engine.recording(self.batch_size):
                per_example_loss(self.model, batch).sum().backward()
            self.engine.finish_backward()
        self.optimizer.step()


class HfPrivateBandMF(HfPrivate):
    """hf_private with amplified BandMF's correlated noise (`BANDS` bands, the optimised strategy for
    `STRATEGY_STEPS` steps), its history warmed to the b − 1 past steps that every step after the first b − 1 reads."""

    name = "hf_private-band-mf"

    def __init__(self, model, batch_size):
        super().__init__(model, batch_size)
        self.optimizer.banded_noise = BandedNoise(strategy(STRATEGY_STEPS, BANDS))
        _warm_history(self.optimizer)


class HfPrivateBandInvMFStore(HfPrivate):
    """hf_private with the banded-inverse (BISR) noise of `BANDS` bands, keeping the last b − 1 draws ("store"),
    its history warmed as BandMF's."""

    name = "hf_private-band-inv-mf-store"
    layout = "store"

    def __init__(self, model, batch_size):
        super().__init__(model, batch_size)
        source = self.optimizer.noise
        self.optimizer.banded_noise = BandedInverseNoise(
            source.random, BANDS, source.sampler.pairs, source.device, layout=self.layout
        )
        _warm_history(self.optimizer)


class HfPrivateBandInvMFRegenerate(HfPrivateBandInvMFStore):
    """As the store arm, re-drawing the last b − 1 draws from the ChaCha20 stream every step ("regenerate")."""

    name = "hf_private-band-inv-mf-regenerate"
    layout = "regenerate"


def _warm_history(optimizer: NoisyOptimizer) -> None:
    """b − 1 noise-only releases (zero sums) through the optimizer's own noise path, so that timed steps are
    steady-state ones: a correlated mechanism's step t < b reads only t − 1 past steps."""
    params = [p for _, p in optimizer.engine.parameters]
    for _ in range(BANDS - 1):
        optimizer.add_noise([torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params])


class OpacusHooks:
    name = "opacus-hooks"

    def __init__(self, model, batch_size):
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.module = GradSampleModule(model, loss_reduction="sum")
        inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.optimizer = DPOptimizer(
            inner, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=batch_size, loss_reduction="sum"
        )
        self.model = model

    def step(self, chunks):
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(chunks):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            default_per_example_loss(self.model, self.module(**inputs), batch["labels"]).sum().backward()
            if i < len(chunks) - 1:  # Opacus' own accumulation: clip this chunk, keep summed_grad, no noise
                self.optimizer.signal_skip_step(do_skip=True)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.step()


class OpacusGhost:
    name = "opacus-ghost"  # one pass over the logical batch (see step)

    def __init__(self, model, batch_size):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        self.module = GradSampleModuleFastGradientClipping(
            model, max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="sum"
        )
        inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.optimizer = DPOptimizerFastGradientClipping(
            inner, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=batch_size, loss_reduction="sum"
        )
        criterion = torch.nn.CrossEntropyLoss(reduction="sum")
        self.criterion = DPLossFastGradientClipping(self.module, self.optimizer, criterion, loss_reduction="sum")
        self.is_lm = isinstance(getattr(model, "get_base_model", lambda: model)(), GPT2LMHeadModel)

    def step(self, chunks):
        # Ghost clipping's second backward clears gradients, so it cannot accumulate chunks: it gets the whole
        # logical batch in one pass (same examples and work; more activation memory).
        batch = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
        self.optimizer.zero_grad(set_to_none=True)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = self.module(**inputs).logits
        if self.is_lm:
            logits, labels = logits[:, :-1].contiguous(), batch["labels"][:, 1:].contiguous()
            loss = self.criterion(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), shape=logits.shape)
        else:
            loss = self.criterion(logits, batch["labels"])
        loss.backward()
        self.optimizer.step()


CORRELATED_ARMS = (HfPrivateBandMF, HfPrivateBandInvMFStore, HfPrivateBandInvMFRegenerate)
ARM_CLASSES = {cls.__name__: cls for cls in (NonPrivate, HfPrivate, OpacusHooks, OpacusGhost, *CORRELATED_ARMS)}


COMPARED_ARMS = {
    "hf_private": HfPrivate,
    "opacus-hooks": OpacusHooks,
    "opacus-ghost": OpacusGhost,
    **{cls.name: cls for cls in CORRELATED_ARMS},
}


def arms_for(mode: str, compared: list[str] | None = None) -> list[tuple[str, type, str]]:
    """(label, arm class, what trains) for the speed table; the first, non-private, is the reference."""
    compared = list(COMPARED_ARMS) if compared is None else compared
    return [("non-private", NonPrivate, mode), *[(label, COMPARED_ARMS[label], mode) for label in compared]]


def noise_seconds(model: torch.nn.Module, device: torch.device, repeats: int = 5) -> float:
    """Median time to draw and add the noise of one step in the step (no `prepare`): one N(0, σ²C²) value per
    trainable coordinate, the work that drawing ahead moves off the step's critical path."""
    noise = GaussianNoise(device)
    buffers = [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in model.parameters() if p.requires_grad]
    noise.add_(buffers, SIGMA * CLIP)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        noise.add_(buffers, SIGMA * CLIP)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(model_name: str, mode: str, device: torch.device) -> torch.nn.Module:
    """The same weights every time (seeded init); `mode` picks what trains: full, lora or bitfit."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    for module in model.modules():  # dropout off: identical work in every arm
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if mode == "lora":
        task = "CAUSAL_LM" if type(model).__name__.endswith(("LMHeadModel", "ForCausalLM")) else "SEQ_CLS"
        model = get_peft_model(
            model, LoraConfig(task_type=task, r=8, lora_alpha=16, target_modules=LORA_TARGETS[model_name])
        )
    elif mode == "bitfit":
        BitFitConfig(noise_multiplier=SIGMA).build_method().prepare_model(model)
    return model.to(device).train()


def _make_arm(model_name, spec, batch_size, chunks, device, errors: dict):
    label, arm_cls, mode = spec
    try:
        arm = arm_cls(build(model_name, mode, device), batch_size)
        arm.step(chunks)  # warm-up (optimizer state allocated), and proof that the arm runs on this model
        return arm
    except Exception as err:  # an Opacus mode that does not support this model is reported, not fatal
        errors[label] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        logger.warning("%s does not run on %s/%s: %s", label, model_name, mode, errors[label])
        return None


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so the next peak starts low
    except OSError:
        pass


def _peak_worker(model_name, spec_names, seq_len, batch_size, grad_accum, device_name, queue) -> None:
    label, arm_name, mode = spec_names
    device = torch.device(device_name)
    spec = (label, ARM_CLASSES[arm_name], mode)
    chunks = make_chunks(build(model_name, mode, device), batch_size, seq_len, grad_accum, device)
    errors: dict[str, str] = {}
    arm = _make_arm(model_name, spec, batch_size, chunks, device, errors)  # includes a warm-up step
    _release_memory()
    reset_peak(device)
    arm.step(chunks)
    queue.put(peak_bytes(device))


def peak_in_fresh_process(model_name, spec, seq_len, batch_size, grad_accum, device) -> int:
    """Peak memory of one steady-state step with only this arm alive, in a new interpreter: in a long-lived
    process the high-water mark also counts pages that earlier arms freed but the allocator kept."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    names = (spec[0], spec[1].__name__, spec[2])
    process = context.Process(
        target=_peak_worker, args=(model_name, names, seq_len, batch_size, grad_accum, str(device), queue)
    )
    process.start()
    peak = queue.get()
    process.join()
    return peak


def bench_config(model_name, specs, seq_len, batch_size, grad_accum, steps, rounds, device) -> dict:
    """Time all arms in alternating rounds; then measure each arm's peak memory with only that arm alive."""
    chunks = make_chunks(build(model_name, specs[0][2], device), batch_size, seq_len, grad_accum, device)
    errors: dict[str, str] = {}
    arms = {spec[0]: _make_arm(model_name, spec, batch_size, chunks, device, errors) for spec in specs}
    arms = {label: arm for label, arm in arms.items() if arm is not None}
    times: dict[str, list[float]] = {label: [] for label in arms}
    # The process's CPU seconds too (every thread's): on a machine shared with other work, wall time counts the waits
    # for a core, CPU time much less.
    cpu_times: dict[str, list[float]] = {label: [] for label in arms}
    for _ in range(rounds):
        for label, arm in arms.items():
            for _ in range(steps):
                start, cpu_start = time.perf_counter(), time.process_time()
                arm.step(chunks)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[label].append(time.perf_counter() - start)
                cpu_times[label].append(time.process_time() - cpu_start)
    arms.clear()
    peaks = {
        label: peak_in_fresh_process(model_name, spec, seq_len, batch_size, grad_accum, device)
        for spec in specs
        if (label := spec[0]) in times
    }
    reference = specs[0][0]
    result = {
        "model": model_name,
        "mode": specs[1][2],
        "seq_len": seq_len,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "reference": reference,
        "arms": {},
        "errors": errors,
        "noise_s_per_step": noise_seconds(build(model_name, specs[1][2], device), device),
    }
    for label in times:
        median = statistics.median(times[label])
        result["arms"][label] = {
            "median_step_s": median,
            "step_s": times[label],
            "step_cpu_s": cpu_times[label],
            "peak_bytes": peaks[label],
            "time_ratio": median / statistics.median(times[reference]),
            "cpu_time_ratio": statistics.median(cpu_times[label]) / statistics.median(cpu_times[reference]),
            "memory_ratio": peaks[label] / peaks[reference],
        }
    return result


def print_table(results: list[dict], labels: list[str]) -> None:
    widths = {label: max(30, len(label) + 2) for label in labels[1:]}
    cells = "".join(f"{label:>{widths[label]}}" for label in labels[1:])
    header = f"{'model':<13}{'mode':<7}{'T':>5}{'B x GA':>8}" + cells
    print(header + "\n" + "-" * len(header))
    for r in results:
        cells = []
        for label in labels[1:]:
            a = r["arms"].get(label)
            cell = "n/a"
            if a:
                cell = f"{a['time_ratio']:.2f}x t {a['cpu_time_ratio']:.2f}x cpu {a['memory_ratio']:.2f}x mem"
            cells.append(f"{cell:>{widths[label]}}")
        ref = r["arms"][r["reference"]]
        row = f"{r['model']:<13}{r['mode']:<7}{r['seq_len']:>5}{r['batch_size']:>4}x{r['grad_accum']:<3}"
        print(
            row
            + "".join(cells)
            + f"   ({r['reference']} {ref['median_step_s'] * 1e3:.0f} ms, {ref['peak_bytes'] / 2**20:.0f} MiB;"
            + f" noise {r['noise_s_per_step'] * 1e3:.0f} ms/step)"
        )


def write_results(path: str, device: torch.device, results: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(), "results": results},
            f,
            indent=2,
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert-base", "gpt2-small"], choices=sorted(MODELS))
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--batch-size", type=int, default=4, help="physical batch (examples per backward)")
    parser.add_argument("--grad-accum", type=int, default=4, help="physical chunks per logical batch (one step)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the arms")
    parser.add_argument(
        "--arms",
        nargs="+",
        default=["hf_private", "opacus-hooks", "opacus-ghost"],
        choices=list(COMPARED_ARMS),
        help="arms compared with the non-private reference",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/speed.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    results = []
    for model_name in args.models:
        for seq_len in args.seq_lens:
            for mode in args.modes:
                logger.info("benchmarking %s %s T=%d", model_name, mode, seq_len)
                results.append(
                    bench_config(
                        model_name,
                        arms_for(mode, args.arms),
                        seq_len,
                        args.batch_size,
                        args.grad_accum,
                        args.steps,
                        args.rounds,
                        device,
                    )
                )
                write_results(args.out, device, results)  # after every configuration: a crash loses one
    print_table(results, [label for label, _, _ in arms_for("full", args.arms)])
    return results


if __name__ == "__main__":
    main()
