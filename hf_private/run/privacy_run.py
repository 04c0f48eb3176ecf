"""The run's privacy state, apart from any Trainer: what a private training run has planned, spent and may still do.

One object reads the method config once and owns the plan (q, steps, each stage's σ), the ledger, the run's secret
streams, the per-example gradient engine of the current trainable set, the stage switches, the budget and the report.
The Trainer glue (`trainer/mixin.py`) calls it at Trainer's hook points and never decides a privacy question itself;
a method sees only `MethodRun` (`method_view.py`), and what the run says about its privacy is `report.py`'s. It imports
nothing of the trainer: what it needs of the data and the forward/backward pass comes through `TrainingSteps`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import Sampler

from ..audit import AuditResult
from ..clip_norm import ClipNormCheck
from ..data.sampling import sampling_random
from ..data.units import PrivacyUnits
from ..data.user_cap import UserExamples
from ..data.users import UserIndex, cap_examples, sampled_unit, stages_for, user_level_facts
from ..engine import PerExampleGradientEngine, trainable_parameters
from ..evaluation.prediction_collapse import RunSettings
from ..integrations import trainer_name
from ..logs import get_logger
from ..methods import DPMethod, MethodConfig
from ..models.peft import auxiliary_parameter_names
from ..optimizer import NoisyOptimizer
from ..privacy import GaussianNoise, PrivacyLedger, PrivacyPlan
from ..privacy.adaptive_clip import ADAPTIVE
from ..privacy.rng import test_stream_seed
from ..release.adapters import private_adapter_names
from ..release.checkpoints import (
    load_dp_config_dict,
    load_ledger,
    load_method_state,
    load_user_cap,
    save_privacy_record,
    save_user_cap,
)
from ..release.model_card import base_model_name, public_base_model
from .adaptive_clip import AdaptiveClip
from .band_mf import CORRELATED, BandMF, band_mf_stages, resolve_bands
from .forks import find_fork
from .method_view import MethodView, TrainingPasses
from .report import plan_lines, privacy_report

logger = get_logger(__name__)


class Instrument(Protocol):
    """Something attached to every training engine and optimizer of a run besides its method (the audit's gradient
    canaries): `PrivacyRun.add_instrument`."""

    def attach_engine(self, engine: PerExampleGradientEngine) -> None: ...

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None: ...


class TrainingSteps(TrainingPasses, Protocol):
    """What the run needs of the trainer: its arguments, and the data and passes a method's measurement uses."""

    args: Any


class PrivacyRun:
    """A private run's plan, ledger, secret streams, engine, stages and budget (see the module docstring)."""

    def __init__(
        self,
        config: MethodConfig,
        method: DPMethod,
        model: nn.Module,
        steps: TrainingSteps,
        dataset_size: int,
        delta: float,
        expected_batch_size: int,
        dataset_fingerprint: str | None = None,
        unit: str = "example",
    ) -> None:
        """`dataset_size`, `delta` (resolved from the config) and `expected_batch_size` as
        `hf_private.trainer.preflight` checked them; `unit` is the privacy unit as the trainer's family names it
        (`hf_private.integrations`)."""
        args = steps.args
        self._config = config  # saved with every checkpoint and compared on resume; its fields are read here only
        self.method, self.model, self.dataset_size = method, model, dataset_size
        self.max_grad_norm, self.accountant = config.initial_clip_norm, config.accountant
        self.target_epsilon, self.test_seed = config.target_epsilon, config.noise_seed
        self.device = args.device
        self.delta, self.expected_batch_size = delta, expected_batch_size
        schedule = {"steps": args.max_steps} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
        stages = stages_for(method.stages(), config)
        self._bands, self._auto_bands = resolve_bands(config, schedule, delta, expected_batch_size, dataset_size)
        if config.noise_mechanism in CORRELATED:  # the training stage at q̂ = b·B/N, accounted as BandMF or BISR
            stages = band_mf_stages(stages, self._bands, expected_batch_size, dataset_size, config.noise_mechanism)
        self.plan = PrivacyPlan(
            dataset_size,
            self.expected_batch_size,
            **schedule,
            delta=self.delta,
            accountant=self.accountant,
            target_epsilon=self.target_epsilon,
            noise_multiplier=config.noise_multiplier,
            stages=stages,
        )
        self.band_mf = self._band_mf(args)  # None for independent noise (DP-SGD)
        self.stage = self.plan.stage_at(0)
        self.ledger = PrivacyLedger(dataset_size, self.delta, self.accountant)
        # what the guarantee is about, in the report, the ledger and the card
        self.subject = {
            "unit": unit,
            "trainer": trainer_name(type(steps)),
            "base_model": public_base_model(base_model_name(model)),
            **user_level_facts(config),
        }
        self.ledger.subject = dict(self.subject)
        self.optimizer: NoisyOptimizer | None = None
        self._instruments: list[Instrument] = []
        self.engine = self._new_engine()
        self.add_instrument(ClipNormCheck(sampled_unit(config, unit)))  # warns once if C is far above the norms
        self.adaptive_clip = self._adaptive_clip()  # None for a fixed C
        self._engine_suspended = False
        self.needs_independence_probe = True  # on the first chunk of ≥ 2, and again after every trainable-set switch
        self.method_view = MethodView(
            model,
            self.plan,
            steps,
            max_grad_norm=self.max_grad_norm,
            noise=self.noise("method noise"),
            random=self.sampling_random("method sampling"),
            ledger=lambda: self.ledger,
            record_release=self.record_release,
            suspend_training_engine=self.suspend_training_engine,
        )
        self.forward_mechanisms = method.attach_forward_mechanisms(model, self.noise("forward noise"), self.plan)
        # Every tensor trained in any stage: what a saved adapter must contain.
        self.trained_parameter_names = method.trained_parameter_names(model)
        self._dataset_fingerprint = dataset_fingerprint
        self._audits: list[AuditResult] = []
        self._step_limit: int | None = None
        self._requested_steps = self.plan.planned_steps
        self.budget_exhausted = False
        self._early_stop_reason: str | None = None  # why the budget stops training before the plan, if it will
        self.kept_examples: np.ndarray | None = None  # ELS: the examples every user keeps, drawn once (kept_by_users)
        self._user_cap: dict[str, list[str]] | None = None  # ELS: the same, by content, as checkpoints keep it
        self._resumed_cap: dict[str, list[str]] | None = None  # ELS: the checkpoint's, when resuming

    @property
    def sample_rate(self) -> float:
        return self.plan.sample_rate

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    @property
    def planned_steps(self) -> int:
        return self.plan.planned_steps

    # ------------------------------------------------------------------ secret streams
    def noise(self, stream: str) -> GaussianNoise:
        """A secret noise source (in insecure test mode: the test seed's `stream`)."""
        return GaussianNoise(self.device, test_seed=test_stream_seed(self.test_seed, stream))

    def sampling_random(self, stream: str):
        return sampling_random(test_stream_seed(self.test_seed, stream))

    # ------------------------------------------------------------------ stages, engine, optimizer
    @property
    def noise_multiplier(self) -> float:
        """σ of the current training stage; 0 for a stage that claims no guarantee and adds no gradient noise (DP-FP in
        paper mode)."""
        if self.stage.noise_multiplier is None and self.stage.stage.no_guarantee is not None:
            return 0.0
        return self.stage.release_noise_multiplier()

    @property
    def mechanism_name(self) -> str:
        return self.stage.name

    def training_steps(self) -> int:
        """Training steps released so far (the ledger may also hold a method's own releases, e.g. selection)."""
        return self.plan.training_steps(self.ledger.mechanisms)

    def record_release(self, stage: str, steps: int = 1) -> None:
        """A method's own release of one of its planned stages (e.g. DP-FROST's selection rounds) joins the ledger."""
        event = self.plan.event(stage, steps, self.max_grad_norm)
        if self.adaptive_clip is not None and self.plan[stage].training:
            event = self.adaptive_clip.event(event)  # the step's joint release: one Gaussian at the effective σ
        self.ledger.record_event(event)

    @property
    def gradient_noise_multiplier(self) -> float:
        """σ of the gradient noise: the stage's σ, or under adaptive clipping its z_Δ > σ, so that the clipped sum and
        the noisy unclipped count together are one Gaussian release at σ (`privacy.adaptive_clip`)."""
        if self.adaptive_clip is None:
            return self.noise_multiplier
        return self.adaptive_clip.gradient_noise_multiplier

    def _adaptive_clip(self) -> AdaptiveClip | None:
        """Adaptive clipping's instrument when the config asks for it, attached to every training engine and
        optimizer; None for a fixed C."""
        if self._config.max_grad_norm != ADAPTIVE:
            return None
        clip = AdaptiveClip(
            self._config,
            self.noise_multiplier,
            self.expected_batch_size,
            self.noise("clip count"),
            on_clip=self._set_clip_norm,
        )
        self.add_instrument(clip)
        return clip

    def _band_mf(self, args: Any) -> BandMF | None:
        """BandMF's strategy, noise state and partitions when the config asks for it (`run.band_mf`)."""
        if self._config.noise_mechanism not in CORRELATED:
            return None
        random = self.sampling_random("band partitions")
        return BandMF(self._bands, self.plan, args, random, self._config.noise_mechanism, self._auto_bands)

    def _set_clip_norm(self, clip: float) -> None:
        """The adapted C for the next step: the engine's clip, the optimizer's noise scale, and every later engine."""
        self.max_grad_norm = clip
        self.engine.max_grad_norm = clip
        if self.optimizer is not None:
            self.optimizer.max_grad_norm = clip

    def clip_to_log(self, logs: dict[str, float]) -> None:
        """Under adaptive clipping, the C the latest step clipped at, on every training log line (a released value)."""
        if self.adaptive_clip is not None and "loss" in logs:
            logs["max_grad_norm"] = self.adaptive_clip.last_used

    def noisy_optimizer(self, inner: torch.optim.Optimizer) -> NoisyOptimizer:
        """`inner` behind the noisy step: noise once per logical batch at the stage's σ, each step in the ledger."""
        self.optimizer = NoisyOptimizer(
            inner,
            self.engine,
            noise_multiplier=self.gradient_noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.expected_batch_size,
            noise=self.noise("training noise"),
            may_step=self.may_step,
            on_step=lambda: self.record_release(self.mechanism_name),
        )
        self.method.attach_optimizer(self.optimizer)
        if self.band_mf is not None:
            self.band_mf.attach_optimizer(self.optimizer)
        for instrument in self._instruments:
            instrument.attach_optimizer(self.optimizer)
        return self.optimizer

    def training_sampler(
        self,
        units: PrivacyUnits,
        view: Any,
        num_chunks: int,
        lengths: torch.Tensor | None,
        share: Callable[[torch.Tensor], torch.Tensor],
    ) -> Sampler[list[int]]:
        """The training batches from `view` (the unit's): Poisson at q, or under BandMF partition t mod b at q̂, t the
        ledger's training steps when the batch is drawn (its partitions drawn once and `share`d from the main
        process)."""
        random = self.sampling_random("training sampling")
        if self.band_mf is None:
            return units.poisson_sampler(view, self.sample_rate, self.steps_per_epoch, num_chunks, random, lengths)
        rank, world_size = units.args.process_index, units.args.world_size
        return self.band_mf.sampler(
            len(view), self.steps_per_epoch, num_chunks, random, lengths, self.training_steps, share, rank, world_size
        )

    def prepare_noise(self) -> None:
        """Once the logical batch's trainable set and σ are known: draw its noise while forward and backward run."""
        if self.optimizer is not None:
            self.optimizer.prepare_noise()

    def _new_engine(self) -> PerExampleGradientEngine:
        """The engine for the current trainable set, with the method's reducer and term transforms."""
        engine = PerExampleGradientEngine(self.model, self.max_grad_norm)
        engine.attach()
        self.method.attach_engine(engine)
        for instrument in self._instruments:
            instrument.attach_engine(engine)
        return engine

    def add_instrument(self, instrument: Instrument) -> None:
        """Attach `instrument` to the current training engine and optimizer and to every later one (a stage switch
        or a method's re-selection builds a new engine): the audit's gradient canaries."""
        self._instruments.append(instrument)
        instrument.attach_engine(self.engine)
        if self.optimizer is not None:
            instrument.attach_optimizer(self.optimizer)

    def start_next_stage(self) -> None:
        """Between logical batches: switch to the next training stage's trainable set once its step is reached."""
        stage = self.plan.stage_at(self.training_steps())
        if stage.name == self.stage.name:
            return
        self.stage = stage
        self.method.start_stage(self.plan.training_stages.index(stage), self.model)
        self._rebuild_engine()
        logger.info(
            "Stage %s starts after %d training steps: %d trainable tensors, σ=%.4g.",
            self.mechanism_name,
            self.training_steps(),
            len(self.engine.parameters),
            self.noise_multiplier,
        )

    def before_step(self) -> None:
        """At the start of a logical batch: the method's own releases and re-selection (`DPMethod.before_step`)."""
        self.engine.reset()  # an interrupted batch never joins the next
        if not self.may_step():
            return
        before = [name for name, _ in trainable_parameters(self.model)]
        self.method.before_step(self.method_view, self.training_steps())
        if self._engine_suspended or [name for name, _ in trainable_parameters(self.model)] != before:
            self._rebuild_engine()

    def suspend_training_engine(self) -> None:
        """Detach the training engine while a method records with its own (`MethodRun.new_engine`)."""
        if not self._engine_suspended:
            self.engine.detach()
            self._engine_suspended = True

    def _rebuild_engine(self) -> None:
        """A new training engine for the current trainable set; the optimizer keeps every stage's parameters (those
        not trainable now get no gradient)."""
        if not self._engine_suspended:
            self.engine.detach()
        self.engine = self._new_engine()
        self._engine_suspended = False
        self.needs_independence_probe = True  # a new trainable set: probe it again
        self.trained_parameter_names |= self.method.trained_parameter_names(self.model)
        if self.optimizer is not None:
            self.optimizer.engine, self.optimizer.noise_multiplier = self.engine, self.gradient_noise_multiplier

    # ------------------------------------------------------------------ budget
    def may_step(self) -> bool:
        return self._step_limit is None or self.training_steps() < self._step_limit

    def resume(self, checkpoint: str, output_dir: str) -> None:
        """Continue the checkpoint's ledger and method state; say what changed and whether this forks the run."""
        if self._els:  # before anything else: without its cap, the run cannot resume at all
            self._resumed_cap = load_user_cap(checkpoint, self._config)
            self.kept_examples = None  # mapped from the cap onto this training set's rows (kept_by_users)
        self.ledger = load_ledger(checkpoint, self.dataset_size, self.delta, self.accountant)
        self.ledger.subject = dict(self.subject)
        if self.band_mf is not None:
            self.band_mf.load(checkpoint)  # the same noise sequence and partitions; refused with another b
        if self.adaptive_clip is not None and self.ledger.clip_norm:
            self.adaptive_clip.load_state_dict(self.ledger.clip_norm)  # continue from the adapted C
        self._warn_if_config_changed(checkpoint)
        self._note_fork(output_dir, checkpoint)
        self.method.load_state_dict(load_method_state(checkpoint))
        # what the earlier run trained stays in every adapter saved from here on (a selection made before, say)
        self.trained_parameter_names |= private_adapter_names(checkpoint)

    def begin(self, requested_steps: int, resumed: bool) -> bool:
        """At train(): the steps the target still allows from the ledger; whether any is left."""
        self._requested_steps = requested_steps
        allowed = self.plan.max_training_steps(self.ledger.mechanisms)
        self._step_limit = None if allowed is None else self.training_steps() + allowed
        self.budget_exhausted = not self.may_step()
        if self.budget_exhausted:
            return False
        self._warn_if_budget_ends_early(self.ledger if resumed else None)
        self.engine.reset()  # an earlier train() interrupted mid-batch must not release its sums with this one's
        return True

    def stop_for_budget(self) -> None:
        """Once the target allows no further step. At the planned end that is the normal end (`finish` logs ε at
        INFO); before it, a WARNING says why (`begin` said so at the start too)."""
        asked = self._requested_steps
        early = self.training_steps() < asked
        if not self.budget_exhausted and early and not self.has_formal_guarantee:
            logger.warning(
                "The planned budget allows no further step after %d of %d steps (insecure test mode: the "
                "accounting bounds nothing). Stopping training.",
                self.training_steps(),
                asked,
            )
        elif not self.budget_exhausted and early:
            logger.warning(
                "Privacy budget reached after %d of the %d steps asked for: ε=%.4g of target %.4g. Stopping training "
                "so the budget is not exceeded (%s).",
                self.training_steps(),
                asked,
                self.ledger.epsilon(),
                self.target_epsilon,
                self._early_stop_reason or "the schedule changed after calibration",
            )
        self.budget_exhausted = True

    def _warn_if_budget_ends_early(self, resumed: PrivacyLedger | None) -> None:
        """Say before the first step when the target will stop training short of the plan, and why."""
        self._early_stop_reason = None
        asked = self._requested_steps
        if self._step_limit is None or self._step_limit >= asked:
            return
        if resumed is not None and resumed.total_steps:
            self._early_stop_reason = (
                f"the checkpoint's ledger already holds {self.training_steps()} training steps taken at its own σ "
                f"(ε={resumed.epsilon():.4g} spent), while this run's σ={self.noise_multiplier:.4g} was calibrated "
                f"for all {self.plan.planned_steps} planned steps from the start: to train them all, resume with the "
                "max_steps / num_train_epochs and target the checkpoint was planned with"
            )
        else:
            self._early_stop_reason = (
                f"σ={self.noise_multiplier:.4g} was calibrated for the {self.plan.planned_steps} steps planned at "
                f"construction; TrainingArguments now asks for {asked}"
            )
        logger.warning(
            "The target ε=%g allows %d training steps in all, fewer than the %d asked for, so training will "
            "stop at step %d: %s.",
            self.target_epsilon,
            self._step_limit,
            asked,
            self._step_limit,
            self._early_stop_reason,
        )

    def _warn_if_config_changed(self, checkpoint: str) -> None:
        """A resume with another dp_config keeps the accounting honest (one ledger), but say what changed."""
        saved = load_dp_config_dict(checkpoint)
        if saved is None:
            return
        current = self._config.to_dict()
        changed = {k: (saved.get(k), v) for k, v in current.items() if k != "format_version" and saved.get(k) != v}
        if changed:
            logger.warning(
                "Resuming from %s with a different dp_config: %s. The ledger carries on (ε already spent: %.4g over "
                "%d releases) and this run's steps add to it under the new settings.",
                checkpoint,
                ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changed.items()),
                self.ledger.epsilon(),
                self.ledger.total_steps,
            )

    def _note_fork(self, output_dir: str, checkpoint: str) -> None:
        """Resuming behind the newest checkpoint starts a second line of training on the same data: warn, record it."""
        fork = find_fork(output_dir, checkpoint, self.ledger)
        if fork is None:
            return
        self.ledger.record_fork(fork)
        logger.warning(
            "Resuming from %s although %s is newer: this starts a second line of training on the same data. Anything "
            "released from the later checkpoints (hub_strategy='every_save' pushes each one) stays public, and its "
            "privacy loss composes with this run's; the report and the card of this run say so%s.",
            fork["resumed_from"],
            fork["newer_checkpoint"],
            " and count both lines in epsilon_with_forks" if self.has_formal_guarantee else "",
        )

    def spent_already(self, checkpoint: str | None) -> dict[str, float]:
        """No step is possible at train(): say so; the metrics train() returns."""
        where = f" of {checkpoint}" if checkpoint else ""
        if not self.has_formal_guarantee:
            logger.warning(
                "The planned budget allows no step after the %d training steps recorded in the ledger%s "
                "(insecure test mode), so train() takes no step.",
                self.training_steps(),
                where,
            )
            return {"steps_taken": 0}
        epsilon = self.ledger.epsilon()
        logger.warning(
            "The privacy budget is already spent: ε=%.4g of target ε=%.4g after the %d training steps recorded in the "
            "ledger%s, so train() takes no step. Raising target_epsilon would spend more privacy on the same data; "
            "otherwise use the model as it is.",
            epsilon,
            self.target_epsilon,
            self.training_steps(),
            where,
        )
        return {"epsilon": epsilon, "delta": self.delta, "steps_taken": 0}

    def finish(self, metrics: dict[str, float]) -> None:
        """At the end of train(): ε and δ into its metrics, and the line that says what was spent."""
        report = self.privacy_report()
        if "epsilon" not in report:
            logger.warning(
                "Trained WITHOUT a differential privacy guarantee after %d steps: %s",
                report["steps"],
                report["guarantee_note"],
            )
            return
        metrics.update(epsilon=report["epsilon"], delta=report["delta"])
        target = self.target_epsilon
        logger.info(
            "Trained privately: ε=%.4g%s, δ=%.3g (%s) after %d of %d planned steps.",
            report["epsilon"],
            "" if target is None else f" of target {target:g}",
            report["delta"],
            report["accountant"],
            report["steps"],
            self.plan.planned_steps,
        )

    def epsilon_to_log(self, logs: dict[str, float]) -> None:
        """ε into a training log line and the final metrics: the ε the released steps have spent, the number
        `privacy_report()` gives at that point (never a bound for steps not yet taken, which would read as budget
        already spent); none without a formal guarantee (a number would read as one). One accountant evaluation per
        logging step, cached until the next release (PRV, on the demo's mechanism and 2 CPU cores: 0.03 s at 20 steps,
        0.1 s at 234, 0.5 s at 3,000)."""
        if self.has_formal_guarantee and ("loss" in logs or "train_loss" in logs):
            logs["epsilon"] = self.ledger.epsilon()

    def log_plan(self, users: UserIndex | None = None) -> None:
        """The plan, once, from the main process, at WARNING so that transformers' default verbosity shows it: the one
        line a DP user must read. At user level (`users`, the training set's) it says what happens to the data."""
        for line in plan_lines(
            self.plan,
            self._config,
            self.subject["unit"],
            users,
            mechanism=self.mechanism_name,
            noise_multiplier=self.noise_multiplier,
        ):
            logger.warning("%s", line)
        if self.band_mf is not None and self.band_mf.bands > 1:  # what an Adam-type optimizer sees of the correlation
            logger.warning("%s", self.band_mf.step_noise_line(self.noise_multiplier))
        for line in self.engine.rule_lines():  # which per-example gradient rule each trainable module uses
            logger.warning("%s", line)

    # ------------------------------------------------------------------ report, audits, checkpoints
    @property
    def has_formal_guarantee(self) -> bool:
        """Whether this run's ε is a guarantee: not when a release has none (DP-FP paper mode), nor in insecure test
        mode (whoever knows `noise_seed` replays the noise). Without one, no ε is logged, reported or carded."""
        return self.plan.has_guarantee and self.test_seed is None

    def privacy_report(self) -> dict[str, Any]:
        """ε, δ and what they rest on, as the card states them (`trainer.privacy_report()`): every key is described at
        `hf_private.run.report.privacy_report`."""
        trained = self.method.trained_parameter_names(self.model)
        report = privacy_report(
            self.ledger,
            self.plan,
            self._config,
            self.subject,
            self.method,
            self._audits,
            noise_multiplier=self.noise_multiplier,
            trainable_fraction=round(self.share_of_model(trained), 6),
        )
        if self.adaptive_clip is not None:
            report["adaptive_clipping"] = self.adaptive_clip.report()
        if self.band_mf is not None:
            report["band_mf"] = self.band_mf.report()
        return report

    def attach_audit(self, result: AuditResult) -> None:
        """Put an audit on the card; one run on the training data (the default) is composed into ε from now on.

        Attaching the same result again changes nothing. An attached audit cannot be removed: its run is spent.
        """
        if not isinstance(result, AuditResult):
            raise TypeError(
                f"attach_audit takes the AuditResult run_audit returned, got {type(result).__name__}: a card entry "
                "alone would leave the audit run's mechanisms out of ε."
            )
        fingerprint = self._dataset_fingerprint
        if result.audit_data != "private" and fingerprint is not None and result.dataset_fingerprint == fingerprint:
            raise ValueError(
                f"The audit was declared to run on {result.audit_data} data, but it trained on this trainer's "
                "training set (same fingerprint). Run it with audit_data='private' so it is composed into ε."
            )
        if result in self._audits:
            return
        self._audits.append(result)
        report = self.privacy_report()
        if "epsilon" not in report:
            logger.info("Audit attached (%s); this run has no guarantee, so the card reports no ε.", result.declaration)
            return
        target = self.target_epsilon
        if result.audit_data == "private" and target is not None and report["epsilon"] > target:
            logger.warning(
                "The audit ran on the training data, so its run is composed into the guarantee: ε=%.4g (training "
                "alone %.4g) now exceeds the target ε=%.4g.",
                report["epsilon"],
                report["training_epsilon"],
                target,
            )
        logger.info("Audit attached (%s); the card reports ε=%.4g.", result.declaration, report["epsilon"])

    @property
    def audit(self) -> dict[str, Any] | None:
        """The card's `privacy.audit` block: the last attached audit's entry (a lower bound, never the guarantee)."""
        return self._audits[-1].card_entry() if self._audits else None

    @audit.setter
    def audit(self, result: AuditResult) -> None:
        self.attach_audit(result)

    def save(self, output_dir: str) -> None:
        """The ledger, the method config and the method's state beside the weights (what a resume continues); under
        ELS also which examples every user kept."""
        if self.adaptive_clip is not None:
            self.ledger.clip_norm = self.adaptive_clip.state_dict()
        save_privacy_record(output_dir, self.ledger, self._config, self.method.state_dict())
        if self.band_mf is not None:
            self.band_mf.save(output_dir)
        if self._user_cap is not None:
            save_user_cap(output_dir, self._user_cap, self._config)

    @property
    def _els(self) -> bool:
        return self._config.privacy_unit == "user" and self._config.user_sampling == "example"

    def kept_by_users(self, index: UserIndex, dataset: Any, share: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """ELS: the rows of `dataset` every user keeps (at most max_examples_per_user each), drawn from the secret
        stream on the first call (on resume: the checkpoint's examples, found by content) and `share`d from the main
        process, so every process trains on the same ones."""
        if self.kept_examples is None:
            k = self._config.max_examples_per_user
            if k is None:  # check_privacy_unit: never under ELS
                raise ValueError("kept_by_users is for ELS runs, which cap every user at max_examples_per_user.")
            examples = UserExamples.of(dataset, index)
            kept = (
                examples.kept_from(self._resumed_cap, k)
                if self._resumed_cap is not None
                else cap_examples(index, k, self.sampling_random("user cap"))
            )
            self.kept_examples = share(kept)
            self._user_cap = examples.record(self.kept_examples)
        return self.kept_examples

    def collapse_settings(self, learning_rate: float) -> RunSettings:
        """What a collapse warning names as likely causes."""
        trained, total = self.values_of(self.trained_parameter_names)
        return RunSettings(self.max_grad_norm, learning_rate, self.dataset_size, trained, total, self.training_steps())

    def values_of(self, names: set[str]) -> tuple[int, int]:
        """(values of the named tensors, values of the model), training scaffolding (`auxiliary_parameter_names`)
        aside."""
        auxiliary = auxiliary_parameter_names(self.model)
        params = {n: p for n, p in self.model.named_parameters() if n not in auxiliary}
        return sum(params[n].numel() for n in names if n in params), sum(p.numel() for p in params.values())

    def share_of_model(self, names: set[str]) -> float:
        named, total = self.values_of(names)
        return named / total
