"""What every DP method is made of: a config (data, saved as dp_config.json) and a method (behaviour), registered
under one canonical name.

As in PEFT (`PeftConfig` vs the tuner model, `register_peft_method`): the config holds the privacy knobs every
method shares plus its own fields, validates them and round-trips through JSON; the method decides what trains,
which stages its run has, and what it does at their boundaries. Clipping, noise and accounting stay the engine's,
the optimizer's and the ledger's: a method never re-implements them.

Adding a method is adding one folder, `hf_private/methods/<name>/`: `config.py` (a `MethodConfig` subclass; every
method's config derives from this base, none from another method's), `method.py` (a `DPMethod` subclass decorated with
`register_dp_method`), the method's own parts (DP-FROST's `reducer.py`, DP-FP's `forward_noise.py`), and an
`__init__.py` that imports them, which registers the method. `hf_private.methods` finds the folder by itself (it
imports every subpackage) and serves its config class by name. The folder imports from here, from `shared.py` (what
several methods use) and from the rest of hf_private, never from another method's folder. The only other edit is the
method's row in the conformance table (tests/methods/test_method_conformance.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..data.users import check_privacy_unit
from ..engine import PerExampleGradientEngine, Reducer, trainable_parameters
from ..logs import get_logger
from ..optimizer import NoisyOptimizer
from ..privacy.accountants import check_accountant
from ..privacy.adaptive_clip import check_adaptive_settings, initial_clip_norm
from ..privacy.band_mf import check_band_mf_settings
from ..privacy.noise import GaussianNoise
from ..privacy.plan import PrivacyPlan, Stage, check_budget, check_target_delta, resolve_delta

logger = get_logger(__name__)

CONFIG_NAME = "dp_config.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class RecipeDefaults:
    """A method's starting hyperparameters for the GLUE recipe, with where they come from."""

    expected_batch_size: int
    num_train_epochs: float
    learning_rate: float
    clip_norm: float
    max_seq_length: int
    source: str
    from_paper: bool = True
    method_fields: dict[str, Any] = field(default_factory=dict)  # defaults for the method's own config fields


@dataclass
class MethodConfig:
    """The privacy knobs every method shares; a method's config adds its own fields (with `help` metadata)."""

    method: ClassVar[str] = ""

    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget ε for the whole planned run. Exactly one of this and noise_multiplier."},
    )
    target_delta: float | None = field(
        default=None,
        metadata={"help": "δ of the (ε, δ) guarantee. None means 1/(2N), always below 1/N."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "σ: noise std is σ·max_grad_norm. Alternative to target_epsilon (then ε is reported)."},
    )
    max_grad_norm: float | str = field(
        default=1.0,
        metadata={
            "help": "Per-example clipping norm C over all trainable tensors (one flat clip), or 'adaptive': C "
            "follows a private estimate of the target_quantile of the per-example norms (Andrew et al. 2021; "
            "DPConfig and DPLoRAConfig), starting at initial_max_grad_norm."
        },
    )
    initial_max_grad_norm: float | None = field(
        default=None,
        metadata={
            "help": "max_grad_norm='adaptive': the starting C, measured on public inputs with "
            "hf_private.median_gradient_norm (required; never measure it on the private data)."
        },
    )
    target_quantile: float = field(
        default=0.5,
        metadata={"help": "max_grad_norm='adaptive': the share of examples C aims to leave unclipped (0.5: median)."},
    )
    clip_learning_rate: float = field(
        default=0.2,
        metadata={"help": "max_grad_norm='adaptive': η of the geometric update C ← C·exp(−η(b̃ − γ)) (paper: 0.2)."},
    )
    clip_count_noise: float = field(
        default=0.05,
        metadata={
            "help": "max_grad_norm='adaptive': noise std on the released unclipped fraction; the count's noise "
            "is σ_b = this × expected batch (paper: expected batch / 20). Paid for by the gradient noise, not ε."
        },
    )
    noise_mechanism: str = field(
        default="dp-sgd",
        metadata={
            "help": "'dp-sgd' (independent noise each step) or 'band-mf': amplified banded matrix factorization "
            "(Choquette-Choo et al. 2023; DPConfig and DPLoRAConfig): correlated noise over `bands` steps, the "
            "data split into `bands` partitions, step t sampling partition t mod bands at q̂ = bands·B/N; or "
            "'band-inv-mf': banded-inverse MF (BISR, Kalinin et al. 2026), noise a filter of the last `bands` "
            "draws, the same partitions, accounted WITHOUT amplification (one Gaussian at σ / sensitivity)."
        },
    )
    bands: int | str = field(
        default=1,
        metadata={
            "help": "The number of bands b of 'band-mf' or 'band-inv-mf' (1 is DP-SGD exactly; at most the steps); "
            "'auto' (with a target_epsilon): the b of least expected prefix-sum error (`band_auto`), 1 (DP-SGD) where "
            "no b lowers it."
        },
    )
    accountant: str = field(
        default="prv", metadata={"help": "'prv' (tight upper bound, default) or 'rdp' (conservative)."}
    )
    noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "INSECURE test mode: seed the noise and Poisson sampling reproducibly. Anyone who knows it "
            "can remove the noise, so the guarantee is void. Leave None for real training."
        },
    )

    privacy_unit: str = field(
        default="example",
        metadata={
            "help": "'example' (one training example, or the trainer's own unit: a conversation, a preference "
            "pair) or 'user' (all the examples of one person, identified by user_column)."
        },
    )
    user_column: str | None = field(
        default=None, metadata={"help": "The training set's column naming each example's user (privacy_unit='user')."}
    )
    user_sampling: str = field(
        default="user",
        metadata={
            "help": "At user level: 'user' (ULS: Poisson-sample users, clip each user's summed gradient) or "
            "'example' (ELS: cap each user's examples, Poisson-sample examples, account for the user)."
        },
    )
    examples_per_user: int = field(
        default=1,
        metadata={
            "help": "ULS: a sampled user contributes the summed gradient of up to this many of their examples "
            "(drawn secretly each step), clipped as one."
        },
    )
    max_examples_per_user: int | None = field(
        default=None,
        metadata={
            "help": "ELS: each user keeps at most this many examples (drawn secretly once); ε is accounted for "
            "a user with this many."
        },
    )

    def __post_init__(self) -> None:
        check_budget(self.target_epsilon, self.noise_multiplier)
        check_target_delta(self.target_delta)
        check_privacy_unit(self)
        check_adaptive_settings(self)
        check_band_mf_settings(self)
        if not isinstance(self.max_grad_norm, str) and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm (per-example clip C) must be > 0, got {self.max_grad_norm}.")
        check_accountant(self.accountant)

    @property
    def initial_clip_norm(self) -> float:
        """C at the start: max_grad_norm, or initial_max_grad_norm when max_grad_norm='adaptive'."""
        return initial_clip_norm(self)

    def resolve_delta(self, dataset_size: int) -> float:
        """δ for a dataset of this size (None → 1/(2N)); a δ ≥ 1/N would allow publishing one record outright."""
        return resolve_delta(dataset_size, self.target_delta)

    def build_method(self) -> DPMethod:
        """The behaviour registered for this config's method."""
        return method_class(self.method)(self)

    @classmethod
    def own_fields(cls) -> list[dataclasses.Field]:
        """The fields this method adds to the shared ones (its recipe flags)."""
        shared = {f.name for f in dataclasses.fields(MethodConfig)}
        return [f for f in dataclasses.fields(cls) if f.name not in shared]

    # ------------------------------------------------------------------ dp_config.json
    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodConfig:
        """The registered config for data["method"], which must be `cls` or derive from it: `MethodConfig.from_dict`
        reads any registered method's file, `DPConfig.from_dict` (or `BitFitConfig`'s ...) only its own method's. Keys
        this version does not know are dropped with a warning (a file written by a newer hf_private), as PEFT does."""
        data = dict(data)
        version = data.pop("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            logger.warning(
                "dp_config.json has format_version %s, newer than this hf_private's %s.", version, FORMAT_VERSION
            )
        config_cls = method_class(data.pop("method", cls.method)).config_class
        if not issubclass(config_cls, cls):
            raise ValueError(
                f"This dp_config is for method {config_cls.method!r} ({config_cls.__name__}), not a {cls.__name__}: "
                f"read it with MethodConfig.from_dict / from_pretrained (any registered method) or "
                f"{config_cls.__name__}'s."
            )
        known = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            logger.warning("Ignoring unknown %s keys %s in dp_config.json.", config_cls.__name__, unknown)
        return config_cls(**{k: v for k, v in data.items() if k in known})

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> MethodConfig:
        with open(os.path.join(directory, CONFIG_NAME)) as f:
            return cls.from_dict(json.load(f))


@runtime_checkable
class MethodRun(Protocol):
    """All a method may do with its run (`DPMethod.before_step`): draw a Poisson sample of one of its planned stages,
    collect per-example terms with a reducer of its choice, and release a noisy vector of that stage.

    The run implements it (`hf_private.run.method_view.MethodView`) and keeps what makes a release private: the sample
    is drawn at the stage's planned rate from a secret generator, and the noise is the stage's planned σ times the
    reducer's sensitivity, drawn from a secret source and recorded in the ledger before the method sees the result. No
    member takes a σ or a noise source: a method chooses what to measure, never how much noise it gets.
    """

    @property
    def model(self) -> nn.Module:
        """The model being trained (a method changes what trains through requires_grad)."""
        ...

    @property
    def plan(self) -> PrivacyPlan:
        """The run's plan: every stage's q, σ and steps, and the planned training steps."""
        ...

    def poisson_sample(self, stage: str) -> list[dict[str, Any]]:
        """This process's share of one Poisson sample of the privacy unit at `stage`'s planned rate, collated in
        physical chunks (none when the sample is empty: its release is then noise alone)."""
        ...

    def new_engine(self, reducer: Reducer) -> PerExampleGradientEngine:
        """An engine on the currently trainable parameters that hands its terms to `reducer`; detach it when done."""
        ...

    def accumulate(self, engine: PerExampleGradientEngine, chunks: list[dict[str, Any]]) -> None:
        """Forward and backward every chunk in training mode, one per-example loss each, into `engine`'s reducer."""
        ...

    def releases(self, stage: str) -> int:
        """Releases of `stage` the ledger holds (a resumed run's included)."""
        ...

    def release(self, stage: str, values: torch.Tensor, sensitivity: float) -> torch.Tensor:
        """`values` plus Gaussian noise of σ_stage · `sensitivity` per coordinate (the L2 sensitivity of `values` under
        add/remove of one privacy unit, the reducer's), summed over processes and recorded in the ledger."""
        ...


class DPMethod:
    """A method's behaviour. The defaults are plain DP-SGD on whatever the model has trainable."""

    #: the config this method reads (set by `register_dp_method`)
    config_class: ClassVar[type[MethodConfig]]

    def __init__(self, config: MethodConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.config.method

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The model the trainer trains, e.g. a PeftModel around the user's model (DP-LoRA); the model by default."""
        return model

    def prepare_model(self, model: nn.Module) -> None:
        """Select what trains (requires_grad) for the first stage."""

    def stages(self) -> list[Stage]:
        """The data-dependent mechanisms this method releases, in order (see `hf_private.privacy.plan`): the plan
        calibrates their noise jointly; the last training stage runs to the end of training."""
        return [Stage(self.name, sensitivity="flat L2 clip C over every trainable tensor")]

    def attach_engine(self, engine: PerExampleGradientEngine) -> None:
        """Called for every engine the trainer builds (at the start and at each stage switch): set a reducer or add
        term transforms applied before the per-example norm (e.g. `engine.add_term_transform(p, lambda t:
        terms.zero_rows(t, rows))`). Nothing by default."""

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
        """Called once the noisy optimizer exists: add gradient transforms applied after the noise
        (`optimizer.add_gradient_transform`) and step-end hooks (`optimizer.add_step_end_hook`). Nothing by
        default."""

    def attach_forward_mechanisms(
        self, model: nn.Module, noise: GaussianNoise, plan: PrivacyPlan
    ) -> list[RemovableHandle]:
        """Forward hooks releasing clipped, noised representations (DP-FP: its `ClippedNoisyOutput`, in
        `methods/dpfp/forward_noise.py`), drawing from `noise`, the run's secret noise source, with their noise set from
        `plan` (the run's q, steps and δ); a release that the ledger must count is a stage of `stages()`. None by
        default."""
        return []

    def before_step(self, run: MethodRun, step: int) -> None:
        """Called at the start of every logical batch, before training step `step` (0-based, counted from the ledger,
        so a resumed run continues where it stopped): release the method's own planned stages through `run` (DP-FROST's
        selection rounds) and change what trains (requires_grad). It must be idempotent for a given `step` and state.
        Nothing by default."""

    def trained_parameter_names(self, model: nn.Module) -> set[str]:
        """The tensors the current trainable set actually trains (what a saved adapter must hold): the trainable ones
        by default. A method whose trainable set is a candidate set until a data-dependent selection says otherwise."""
        return {name for name, _ in trainable_parameters(model)}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold for a resumed run to go on exactly (DP-FROST: the selections made, which were
        paid for in the ledger and must not be drawn again). JSON-serialisable; empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` from a checkpoint (called before training resumes)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint holds {sorted(state)}.")

    def report(self) -> dict[str, Any]:
        """Method-specific facts for the privacy report and the card (DP-FROST: the selected partitions). Only
        released (post-processed) values belong here. Nothing by default."""
        return {}

    def figures_without_guarantee(self) -> dict[str, dict[str, Any]]:
        """Numbers a run without a formal guarantee may still show, each {"value", "what"}: what it is, and why it is
        not a bound on this model's privacy loss (DP-FP paper mode: the paper's CLT figure). The first is what the
        method's paper claims, which an audit tests. Nothing by default."""
        return {}

    def start_stage(self, index: int, model: nn.Module) -> None:
        """Called between logical batches when stage `index` (≥ 1) begins: re-select what trains."""
        raise NotImplementedError(f"{type(self).__name__} has a single stage.")

    def citations(self) -> tuple[str, ...]:
        return (
            "Abadi et al., *Deep Learning with Differential Privacy*, CCS 2016.",
            "Gopi, Lee, Wutschitz, *Numerical Composition of Differential Privacy* (PRV accountant), NeurIPS 2021.",
        )

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        """The published hyperparameters for a GLUE task (the SST-2 row, marked not from a paper, for others)."""
        raise NotImplementedError(f"{cls.__name__} gives no recipe defaults.")


_METHODS: dict[str, type[DPMethod]] = {}

FIELDS_HEADING = "Fields (keyword arguments; the privacy knobs every method shares come first):"


def document_fields(config_class: type[MethodConfig]) -> None:
    """Write every field's `help` into the class docstring, once: pydoc never reads dataclass metadata, so without
    this `help(BitFitConfig)` shows a bare signature. A field without help is refused, so a new method cannot
    register undocumented knobs."""
    doc = inspect.cleandoc(config_class.__dict__.get("__doc__") or "")
    if FIELDS_HEADING in doc:
        return
    if doc.startswith(f"{config_class.__name__}("):
        doc = ""  # the signature @dataclass writes for a class without a docstring: help() shows it anyway
    entries = []
    for f in dataclasses.fields(config_class):
        if not f.metadata.get("help"):
            raise ValueError(
                f"{config_class.__name__}.{f.name} has no help text: declare it with "
                "field(..., metadata={'help': '<what it means>'})."
            )
        default = "" if f.default is dataclasses.MISSING else f", default {f.default!r}"
        entries.append(f"{f.name} ({f.type}{default})\n    {f.metadata['help']}")
    config_class.__doc__ = "\n\n".join(part for part in (doc, FIELDS_HEADING, *entries) if part)


def register_dp_method(config_class: type[MethodConfig]):
    """Class decorator: register a `DPMethod` subclass under its config's canonical `method` name."""

    def register(method_cls: type[DPMethod]) -> type[DPMethod]:
        name = config_class.method
        if not name:
            raise ValueError(f"{config_class.__name__} needs a canonical `method` name.")
        if name in _METHODS and _METHODS[name] is not method_cls:
            raise ValueError(f"A DP method named {name!r} is already registered ({_METHODS[name].__name__}).")
        document_fields(config_class)
        method_cls.config_class = config_class
        _METHODS[name] = method_cls
        return method_cls

    return register


def method_class(name: str) -> type[DPMethod]:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"Unknown DP method {name!r}; registered: {', '.join(registered_methods())}.") from None


def registered_methods() -> tuple[str, ...]:
    return tuple(_METHODS)
