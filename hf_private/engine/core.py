"""Per-example gradient engine: hooks on the model's own modules, one backward pass, terms handed to a reducer.

Forward hooks keep a layer's input only when a weight-type parameter of that layer is trainable, and keep it as
autograd keeps its own saved tensors (`_Stash`): under activation checkpointing it is dropped after the forward and
recomputed when backward reads it, so the engine holds no more than checkpointing does; a hook on the
layer output receives the output gradient and turns it into per-example terms: factored for the ghost norm, or
instantiated at once where that is cheaper (biases are always reduced to B×p at once). When backward has finished
for the whole chunk, `finish_backward` checks the terms, applies the chunk transforms (the audit's gradient
canaries) and a method's term transforms (masks: before any norm) and hands them to `engine.reducer` (reducers.py;
by default DP-SGD's flat clip: every example's norm over *all* trainable tensors, the clip factors and the clipped
sums), then drops everything: nothing is kept across chunks but what the reducer accumulates.

Autograd's own parameter gradients would be computed and thrown away, so while a chunk is recorded the
trainable parameters are flagged `requires_grad=False` ("ghost differentiation"): backward then only
propagates activation gradients. The first chunk runs with autograd's gradients on and checks that the
engine's unclipped sums reproduce them, which catches a parameter used outside its module's forward.

Every term must cover exactly the units `recording` was told about: one row per example, or (multiple choice, a DPO
pair) a fixed number of consecutive rows per example, or (a user) each unit's own number of consecutive rows, summed
into one term. Anything else is refused, since per-example clipping would silently become per-row clipping. A layer
once seen without a per-example batch dimension (UMT5's relative_attention_bias, looked up with [query, key] positions)
stays refused, as its shape can coincide with the chunk's; the trainer's independence probe (units alone) exposes it.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import operator
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from ..data.packing import PackedLayout
from ..logs import get_logger
from .layers import UnsupportedLayerError, handler_for, rule_for
from .layers.base import LayerHandler
from .layers.moe import refuse_parameter_wrappers
from .packed_tokens import PackedTokens
from .reducers import ChunkTerms, ClippedSumReducer, FlatL2ClipReducer, Reducer, flat_norms
from .sharding import ShardedCheck, is_sharded, local_parts
from .terms import (
    Term,
    accumulation_dtype,
    cast_term,
    clipped_sum,
    format_sizes,
    group_rows,
    squared_norm,
    unit_sizes,
    vars_tensors,
)

logger = get_logger(__name__)

#: a method's map of one parameter's per-example term to another (a mask); it must act on each example alone
TermTransform = Callable[[Term], Term]
#: an observer of every training chunk's per-unit norms, as the reducer clipped them (read-only)
NormHook = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class ChunkUnits:
    """What a chunk transform may know of the chunk: each unit's rows, in order, and whether the rows are packed
    (several examples end to end in one row, so the model's rows are not the units')."""

    unit_rows: tuple[int, ...]
    packed: bool


#: the audit's map of a whole chunk's terms to others (gradient canaries: a canary unit's gradient replaced by the
#: one inserted for it); it must act on each unit alone and keep the number of units
ChunkTransform = Callable[[ChunkTerms, ChunkUnits], ChunkTerms]
# Self-check tolerance: relative to the parameter's gradient norm, floored by a small share of the total. Float64 is
# held to float32's rounding of a sum, not its own: many modules compute in float32 whatever their input (the RMSNorm
# variants), so autograd's own float64 reference carries float32 rounding.
_CHECK_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
_CHECK_TOLERANCE_LOW_PRECISION = 5e-2


@dataclass
class _HookedLayer:
    name: str
    module: nn.Module
    handler: LayerHandler
    trainable: dict[str, nn.Parameter]  # parameter name in the module → parameter
    save_input: bool
    unbatched: str | None = None  # the rows it once had without a per-example batch dimension: refused from then on


class _InstanceForward:
    """The handle of a forward set on a module instance (`_own_forward`): removing it restores the class's."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        vars(self.module).pop("forward", None)


@dataclass(frozen=True)
class _Chunk:
    """What `recording` was told about the chunk: the terms must cover exactly these units.

    `rows_per_example`: every unit's rows, an int when all units have that many (one row per example; a fixed number
    of choice rows), else a tuple of each unit's rows in order (a user's examples: a varying number of rows).
    """

    examples: int
    rows_per_example: int | tuple[int, ...]
    probe: bool
    packed: bool = False

    @property
    def total_rows(self) -> int:
        """The rows the model sees: the units' rows, one unit after the other."""
        if isinstance(self.rows_per_example, int):
            return self.examples * self.rows_per_example
        return sum(self.rows_per_example)

    @property
    def units(self) -> ChunkUnits:
        rows = self.rows_per_example
        return ChunkUnits((rows,) * self.examples if isinstance(rows, int) else rows, self.packed)

    @property
    def grouped(self) -> bool:
        """Whether a unit spans several rows (terms of `total_rows` rows are then summed per unit)."""
        if isinstance(self.rows_per_example, int):
            return self.rows_per_example > 1
        return self.total_rows != self.examples

    def matches(self, rows: int) -> bool:
        return rows in (self.examples, self.total_rows)

    def describe(self) -> str:
        if isinstance(self.rows_per_example, int):
            each = f" of {self.rows_per_example} rows each" if self.rows_per_example > 1 else ""
            return f"{self.examples} example{'' if self.examples == 1 else 's'}{each}"
        units = f"{self.examples} unit{'' if self.examples == 1 else 's'}"
        return f"{units} of {format_sizes(self.rows_per_example)} rows ({self.total_rows} rows in all)"

    def check_rows(self, rows: list[tuple[_HookedLayer, int]]) -> None:
        """Every term must have the chunk's rows; a layer once seen without a per-example batch dimension never again.

        A mismatch has two causes. Several examples packed into one row: every layer then has fewer rows than the
        chunk's. A parameter used for the whole batch at once (UMT5's `relative_attention_bias`: an nn.Embedding
        looked up with [query, key] position buckets that every example shares): that layer alone has other rows
        (q) than the layers fed with the examples. Its gradient is a sum over the batch and it has no per-example
        term; when q happens to equal the chunk's size the shapes cannot show it, so such a layer is remembered and
        refused from then on, and the independence probe (one example alone, unpadded: q ≠ 1 rows) reveals it.
        """
        batched = any(self.matches(count) for layer, count in rows if layer.unbatched is None)
        for layer, count in rows:
            if layer.unbatched is None and self.matches(count):
                continue
            if layer.unbatched is None and (batched or count > self.total_rows):
                layer.unbatched = f"{count} rows where its chunk held {self.describe()}"
            if layer.unbatched is not None:
                raise UnsupportedLayerError(
                    f"{layer.name} is used without a per-example batch dimension (it computed gradients for "
                    f"{layer.unbatched}): its trainable parameter(s) {sorted(layer.trainable)} serve the whole "
                    "batch at once, e.g. UMT5's relative_attention_bias, looked up with [query, key] positions that "
                    "every example shares. Their gradient is a sum over the batch, so no per-example gradient exists, "
                    "per-example clipping cannot bound them and the privacy guarantee would not hold; the layer stays "
                    "refused even when a chunk's size happens to equal that dimension. Freeze these parameters "
                    "(requires_grad=False) before creating the trainer."
                )
            raise ValueError(
                f"{layer.name} computed gradients for {count} rows, but the chunk holds {self.describe()}: its rows "
                "are not the chunk's examples, so per-example clipping would become per-row clipping and the privacy "
                "guarantee would not hold. Feed the model one row per example (pad with DataCollatorWithPadding), or "
                "one packed row of whole examples with engine.recording(packed=their lengths), and pass the chunk's "
                "number of examples to engine.recording(). If the layer's parameters are used without a per-example "
                "batch dimension (e.g. UMT5's relative_attention_bias), freeze them (requires_grad=False)."
            )


class _Stash(torch.autograd.Function):
    """Holds a layer's saved inputs as autograd holds its own saved tensors, through the saved-tensor hooks in force:
    inside a non-reentrant activation-checkpointed segment they are dropped after the forward and recomputed when
    backward reads them, under `save_on_cpu` they wait on the host; elsewhere they are kept as they are."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (grad, *(None for _ in ctx.saved_tensors))


_STASHED = object()


def _shapes(saved: Any) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tree_flatten(saved)[0] if isinstance(t, torch.Tensor))


@dataclass
class _SavedInput:
    """A layer's saved input (a tensor or a structure of tensors), stashed through `_Stash` until its backward."""

    holder: torch.Tensor  # the stash's output: its grad_fn holds the tensors
    spec: TreeSpec | None  # None: the saved input is one tensor
    leaves: list  # the structure's leaves, each tensor's place marked _STASHED (the tensors live in the stash)

    @classmethod
    def stash(cls, saved: Any) -> _SavedInput | None:
        if saved is None:
            return None
        leaves, spec = ([saved], None) if isinstance(saved, torch.Tensor) else tree_flatten(saved)
        tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        with torch.enable_grad():
            holder = _Stash.apply(torch.empty(0, requires_grad=True), *tensors)
        return cls(holder, spec, [_STASHED if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])

    def unstash(self, layer_name: str) -> Any:
        """The saved input, read once in backward (recomputed there when the layer's segment was checkpointed)."""
        node: Any = self.holder.grad_fn  # the stash's backward node
        try:
            tensors = iter(node.saved_tensors)
        except RuntimeError as error:
            if "inplace operation" not in str(error):
                raise
            raise RuntimeError(
                f"The input of {layer_name} was modified in place after the forward pass; its per-example gradient "
                "cannot be computed."
            ) from error
        if self.spec is None:
            return next(tensors)
        return tree_unflatten([next(tensors) if leaf is _STASHED else leaf for leaf in self.leaves], self.spec)


@dataclass
class _Call:
    layer: _HookedLayer
    order: int  # the call's place in the forward pass: terms are reduced in this order, checkpointed or not
    saved: _SavedInput | None
    terms: dict[str, Term] = field(default_factory=dict)


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class PerExampleGradientEngine:
    """Collects per-example gradient terms for every trainable parameter of `model` and hands them to a reducer.

    The default reducer is DP-SGD's `FlatL2ClipReducer(max_grad_norm)`, whose clipped sums `pop_clipped_sums`
    releases to the optimizer; a method may set `engine.reducer` to another (DP-FROST's selection: its partition
    magnitude reducer, `methods/frost/reducer.py`) between logical batches, and register term transforms
    (`add_term_transform`).
    """

    def __init__(self, model: nn.Module, max_grad_norm: float, *, reducer: Reducer | None = None) -> None:
        self.model = model
        self.parameters = trainable_parameters(model)
        if not self.parameters:
            raise ValueError("The model has no trainable parameters (nothing has requires_grad=True).")
        self.layers = self._find_layers()
        self.batch_norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._reducer: Reducer = FlatL2ClipReducer(max_grad_norm)
        self._reducer.bind(self.parameters)
        if reducer is not None:
            self.reducer = reducer
        self._term_transforms: dict[nn.Parameter, OrderedDict[int, TermTransform]] = {}
        self._chunk_transforms: OrderedDict[int, ChunkTransform] = OrderedDict()
        self._norm_hooks: OrderedDict[int, NormHook] = OrderedDict()
        self._calls: list[_Call] = []  # the calls whose terms backward has formed, this chunk
        self._call_order = itertools.count()
        self._rows: int | None = None  # rows the model sees while a chunk is recorded (None: not recording)
        self._packed: PackedTokens | None = None  # a packed chunk's examples, while it is recorded
        self._chunk: _Chunk | None = None  # the chunk that `finish_backward` will reduce
        self._handles: list = []
        self.verified = False  # set after the first chunk's per-example sums matched autograd

    # ------------------------------------------------------------------ reducer and term transforms
    @property
    def reducer(self) -> Reducer:
        """What `finish_backward` hands each chunk's terms to. Swap it only when nothing is pending."""
        return self._reducer

    @reducer.setter
    def reducer(self, reducer: Reducer) -> None:
        if reducer is not self._reducer and self._reducer.pending():
            raise RuntimeError(
                f"The current reducer ({type(self._reducer).__name__}) holds results not yet released: pop them "
                "(or engine.reset()) before switching, so that no logical batch mixes two reducers."
            )
        reducer.bind(self.parameters)
        self._reducer = reducer

    @property
    def max_grad_norm(self) -> float:
        """C of the flat clip (the current reducer's `max_grad_norm`)."""
        return self._reducer.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._reducer.max_grad_norm = float(value)

    @property
    def clipped_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        """The clipped sums accumulated since the last `pop_clipped_sums` (a gradient-sum reducer's `sums`)."""
        return self._gradient_sums_reducer().sums

    @clipped_sums.setter
    def clipped_sums(self, sums: dict[nn.Parameter, torch.Tensor]) -> None:
        self._gradient_sums_reducer().sums = sums

    def _gradient_sums_reducer(self) -> ClippedSumReducer:
        if not isinstance(self._reducer, ClippedSumReducer):
            raise TypeError(
                f"The engine's reducer is a {type(self._reducer).__name__}, which accumulates no clipped gradient "
                "sums: nothing from it may reach the optimizer. Pop its own result and set engine.reducer back to a "
                "clipping reducer (FlatL2ClipReducer) before the next training step."
            )
        return self._reducer

    def add_term_transform(self, parameter: nn.Parameter, transform: TermTransform) -> RemovableHandle:
        """Apply `transform` to every per-example term of `parameter` before any norm, clip or sum.

        The transform receives one term (OuterTerm, IndexTerm or SampleTerm; one row per unit, the rows of a
        multi-row unit (choices, a pair, a user's examples) already grouped) and returns a term of any of these kinds
        for the same parameter, e.g. `lambda t: terms.zero_rows(t, rows)`. It must treat every unit alone and depend
        on no data (a mask from public or already-released weights): it is a change of the mechanism, not a
        post-processing. The engine's self-check against autograd sees the terms before any transform. Several
        transforms of one parameter apply in the order added; `handle.remove()` drops one.
        """
        if not any(parameter is p for _, p in self.parameters):
            raise ValueError(
                f"add_term_transform: a parameter of shape {tuple(parameter.shape)} is not one this "
                "engine trains (requires_grad=True when the engine was created)."
            )
        transforms = self._term_transforms.setdefault(parameter, OrderedDict())
        handle = RemovableHandle(transforms)
        transforms[handle.id] = transform
        return handle

    def add_chunk_transform(self, transform: ChunkTransform) -> RemovableHandle:
        """Apply `transform` to every training chunk's terms (units grouped, before the term transforms and the
        reducer; never to a probe chunk). The audit's gradient canaries use it to replace a canary unit's gradient by
        an inserted one, which then meets the method's masks and the clip as any unit's would. Like a term transform
        it changes the mechanism: it must treat every unit alone and keep their number."""
        handle = RemovableHandle(self._chunk_transforms)
        self._chunk_transforms[handle.id] = transform
        return handle

    def add_norm_hook(self, hook: NormHook) -> RemovableHandle:
        """Call `hook(norms)` with each training chunk's per-unit norms as the reducer returned them (never a probe
        chunk's). It must only read them: the check that C is not far above them (`clip_norm.ClipNormCheck`)."""
        handle = RemovableHandle(self._norm_hooks)
        self._norm_hooks[handle.id] = hook
        return handle

    def _transformed(self, param: nn.Parameter, terms: list, examples: int) -> list:
        for transform in self._term_transforms.get(param, {}).values():
            terms = [transform(term) for term in terms]
            if any(term.batch_size != examples for term in terms):
                raise ValueError(
                    f"A term transform of a parameter of shape {tuple(param.shape)} changed the number "
                    f"of examples ({examples}): a transform must map each example's gradient alone."
                )
        return terms

    # ------------------------------------------------------------------ set-up
    def _find_layers(self) -> list[_HookedLayer]:
        refuse_parameter_wrappers(self.model)  # LoRA on parameters: used outside any module's forward
        names = {id(p): n for n, p in self.parameters}
        owners: dict[int, list[str]] = defaultdict(list)
        layers: list[_HookedLayer] = []
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            own = {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}
            if not own:
                continue
            module_name, module, own, handler = self._claiming_owner(module_name, module, own)
            if any(layer.module is module for layer in layers):
                continue  # the same module reached through a second path
            label = f"{module_name or '<root>'} ({type(module).__name__})"
            handler = handler or rule_for(module, set(own))
            try:
                handler.check(module, set(own))
            except UnsupportedLayerError as error:
                raise UnsupportedLayerError(f"{label}: {error}") from None
            layers.append(_HookedLayer(label, module, handler, own, handler.needs_input(set(own))))
            for p in own.values():
                owners[id(p)].append(label)
        missing = [n for i, n in names.items() if i not in owners]
        if missing:
            raise UnsupportedLayerError(f"Trainable parameters not owned by any module: {missing}.")
        return layers

    def _claiming_owner(self, name: str, module: nn.Module, own: dict[str, nn.Parameter]):
        """The outermost ancestor whose dedicated rule claims these parameters of it, with all it claims, in the
        module's place (T5's attention claims its relative_attention_bias: the bias gets a batch dimension only in the
        attention's forward; PEFT's ParamWrapper its adapters' factors, used as ΔW inside the base module's forward);
        else the module itself, without a rule yet."""
        parts = name.split(".") if name else []
        for depth in range(len(parts)):
            ancestor_name, child = ".".join(parts[:depth]), ".".join(parts[depth:])
            ancestor = self.model.get_submodule(ancestor_name)
            rule = handler_for(ancestor)
            claimed = rule.claimed(ancestor) if rule is not None else {}
            if claimed and all(f"{child}.{n}" in claimed for n in own):
                return ancestor_name, ancestor, claimed, rule
        return name, module, own, None

    def rule_lines(self) -> list[str]:
        """Which per-example gradient rule each trainable module uses: one line per rule, counted by module type."""
        by_rule: dict[str, Counter[str]] = defaultdict(Counter)
        for layer in self.layers:
            by_rule[layer.handler.rule][type(layer.module).__name__] += 1
        return [
            f"Per-example gradient rule {rule}: {sum(types.values())} module(s) "
            f"({', '.join(f'{name} ×{count}' for name, count in sorted(types.items()))})"
            for rule, types in by_rule.items()
        ]

    def attach(self) -> None:
        if self._handles:
            return
        for layer in self.layers:
            if layer.handler.owns_forward:
                self._handles.append(self._own_forward(layer))
            if type(layer.handler).before_forward is not LayerHandler.before_forward:
                pre_hook = self._pre_forward_hook(layer)
                self._handles.append(layer.module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._handles.append(layer.module.register_forward_hook(self._forward_hook(layer), with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._calls.clear()

    # ------------------------------------------------------------------ hooks
    def _own_forward(self, layer: _HookedLayer) -> _InstanceForward:
        """While a chunk is recorded the rule computes the module's output (`LayerHandler.owns_forward`); otherwise
        the module's own forward runs."""
        module = layer.module
        if "forward" in vars(module):
            raise UnsupportedLayerError(
                f"{layer.name}: its forward is already replaced on the instance (an accelerate dispatch hook, another "
                f"library's wrapper), and the {layer.handler.rule} rule computes that forward itself while a chunk is "
                "recorded. Train the model on one device without hooks on this module, or freeze it."
            )
        own = module.forward

        def forward(*args, **kwargs):
            if self._rows is None:
                return own(*args, **kwargs)
            return layer.handler.forward(module, args, kwargs)

        module.forward = forward
        return _InstanceForward(module)

    def _pre_forward_hook(self, layer: _HookedLayer):
        def hook(module, args, kwargs):
            # also without gradients: a reentrant checkpointed segment's first forward must compute what its
            # recompute will (T5's bias expanded to the chunk's rows, passed on to every later layer)
            if self._rows is None:
                return None
            return layer.handler.before_forward(module, args, kwargs, self._rows)

        return hook

    def _forward_hook(self, layer: _HookedLayer):
        def hook(module, args, kwargs, output):
            if self._rows is None or not torch.is_grad_enabled():
                return None
            if self._packed is not None and layer.handler.packed_refusal:
                raise UnsupportedLayerError(f"{layer.name}: {layer.handler.packed_refusal}")
            saved, watched = layer.handler.on_forward(module, args, kwargs, output, self._rows, layer.save_input)
            # the values only, never the forward graph; recomputed in backward when the layer is checkpointed
            call = _Call(layer, next(self._call_order), _SavedInput.stash(saved))
            if not watched.requires_grad:  # nothing trainable upstream: start the backward graph here
                if not isinstance(output, torch.Tensor):
                    raise UnsupportedLayerError(
                        f"{layer.name}: the output its rule watches does not depend on anything that trains."
                    )
                watched = watched.detach().requires_grad_(True)
            watched.register_hook(self._grad_hook(call))
            # a tensor output may be replaced (an expanded broadcast); a tuple's element is watched where it lies, and
            # a rule that owns the forward watches a tensor inside it
            replaced = isinstance(output, torch.Tensor) and watched is not output and not layer.handler.owns_forward
            return watched if replaced else None

        return hook

    def _grad_hook(self, call: _Call):
        def hook(grad_output: torch.Tensor) -> None:
            # read while the chunk's rows are set: a checkpointed segment's recompute must stash as its forward did
            saved = call.saved.unstash(call.layer.name) if call.saved is not None else None
            call.saved = None
            packed = self._packed
            # one example per row, as a padded chunk (a token layer's output gradient is [rows, width, features])
            if packed is not None and not (grad_output.dim() >= 3 and packed.holds(grad_output)):
                packed = None  # a layer whose output has no packed token axis: its rows already are the examples
            if packed is not None:
                if saved is not None and not (isinstance(saved, torch.Tensor) and packed.holds(saved)):
                    raise ValueError(
                        f"{call.layer.name} reads an input of shape {_shapes(saved)} in a packed chunk of "
                        f"{packed.tokens} tokens: without the packed row's token axis its examples' gradients cannot "
                        "be separated. Pad each example to a row of its own for this model."
                    )
                grad_output = packed.split(grad_output)
                saved = packed.split(saved) if saved is not None else None
            rows, self._rows = self._rows, None  # a rule that replays the module's forward must not be recorded
            try:
                call.terms = call.layer.handler.terms(call.layer.module, saved, grad_output, set(call.layer.trainable))
            finally:
                self._rows = rows
            if packed is not None:  # a factored term's sum then runs over the examples' own tokens
                call.terms = packed.marked(call.terms)
            self._calls.append(call)  # a call whose backward never comes (a recompute's own graph) is never reduced

        return hook

    @contextmanager
    def recording(
        self,
        batch_size: int,
        rows_per_example: int | Sequence[int] = 1,
        probe: bool = False,
        packed: PackedLayout | Sequence[int] | torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Record per-unit terms for the forward/backward of one physical chunk of `batch_size` privacy units.

        `batch_size` must come from the data (the sampler/collator), not from a tensor the model builds: every
        term is checked against it. `rows_per_example` > 1 when the model spreads a unit over several rows
        (a multiple-choice head: one row per choice; DPO: a chosen and a rejected row); each unit's term then sums
        its rows. A sequence of `batch_size` ints gives every unit its own number of rows, consecutive and in order
        (user-level DP: a user's examples), summing to the chunk's rows. Terms may have one row per unit or the
        chunk's rows. `probe=True` computes norms only (see `finish_backward`), with autograd's own gradients off.
        `packed`: the chunk's examples lie end to end in rows (`hf_private.data.packing.PackedLayout`; a sequence of
        lengths: one row, these many tokens each); each layer's tokens are regathered one example per row before its
        terms are formed, so every count above is in examples, as for a padded chunk.
        """
        if isinstance(rows_per_example, numbers.Integral) and not isinstance(rows_per_example, bool):
            rows_per_example = int(rows_per_example)
            if batch_size < 0 or rows_per_example < 1:
                raise ValueError(
                    f"recording() needs batch_size >= 0 and rows_per_example >= 1, got {batch_size}, "
                    f"{rows_per_example}."
                )
            rows = batch_size * rows_per_example
        else:
            try:
                rows_per_example = unit_sizes(rows_per_example)
            except (TypeError, ValueError) as error:
                raise type(error)(
                    f"recording(): rows_per_example must be an int >= 1 or one int >= 1 per unit of the chunk. {error}"
                ) from None
            if len(rows_per_example) != batch_size:
                raise ValueError(
                    f"recording() was given {len(rows_per_example)} unit sizes for a chunk of "
                    f"{batch_size} units: rows_per_example needs one entry (that unit's rows) per unit."
                )
            rows = sum(rows_per_example)
        training_bn = [n for n in self.batch_norms if self.model.get_submodule(n).training]
        if training_bn:
            raise ValueError(
                f"BatchNorm in train mode ({training_bn}) mixes examples in a batch, so per-example gradients "
                "and the privacy guarantee break. Replace it with GroupNorm/LayerNorm (opacus "
                "ModuleValidator.fix) or keep it in eval mode."
            )
        frozen_for_chunk = [p for _, p in self.parameters] if self.verified or probe else []
        for p in frozen_for_chunk:
            p.requires_grad_(False)
        tokens = None
        if packed is not None:
            tokens = PackedTokens(packed if isinstance(packed, PackedLayout) else PackedLayout(packed))
            if tokens.examples != rows:
                raise ValueError(
                    f"recording() was told of {tokens.examples} packed examples for a chunk whose "
                    f"units hold {rows}: every packed example must be one of the chunk's."
                )
        self._chunk = _Chunk(batch_size, rows_per_example, probe, tokens is not None)
        self._rows = tokens.rows if tokens is not None else rows  # the rows the model sees
        self._packed = tokens
        try:
            yield
        except BaseException:  # Ctrl-C, an out-of-memory error: nothing of the broken chunk may reach a release
            self.discard_chunk()
            raise
        finally:
            self._rows = None
            self._packed = None
            for p in frozen_for_chunk:
                p.requires_grad_(True)

    # ------------------------------------------------------------------ reduction
    @torch.no_grad()
    def finish_backward(self) -> torch.Tensor:
        """Hand the chunk's per-example terms (after the term transforms) to the reducer; return its norms.

        With the default reducer: clip every example to max_grad_norm over all trainable tensors and add to the
        running sums; an example whose norm is not finite (a NaN label, an overflow) contributes exactly zero. A
        probe chunk (`recording(probe=True)`) returns the flat per-example L2 norms and leaves the reducer untouched.
        """
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            raise RuntimeError("finish_backward() must follow a backward pass run inside engine.recording().")
        by_param: dict[nn.Parameter, list] = defaultdict(list)
        rows = []
        for call in sorted(self._calls, key=operator.attrgetter("order")):
            for name, term in call.terms.items():
                by_param[call.layer.trainable[name]].append(term)
                rows.append((call.layer, term.batch_size))
            # The output's autograd node keeps the hook closure (and so this call) alive after backward:
            # drop the call's references now, or every chunk's activations and gradients would linger.
            call.terms, call.saved = {}, None
        self._calls.clear()
        try:
            chunk.check_rows(rows)
            self._check_coverage(by_param)
            if not self.verified and not chunk.probe:
                self._check_against_autograd(by_param)
        finally:
            for _, p in self.parameters:
                p.grad = None  # autograd's un-clipped gradient must never reach the optimizer, refused chunk or not
        if chunk.grouped:
            by_param = {
                p: [t if t.batch_size == chunk.examples else group_rows(t, chunk.rows_per_example) for t in terms]
                for p, terms in by_param.items()
            }
        reduced = ChunkTerms(examples=chunk.examples, terms=dict(by_param))
        del by_param  # the reducer may drop each parameter's terms once used
        if not chunk.probe:
            for transform in self._chunk_transforms.values():
                reduced = transform(reduced, chunk.units)
                if reduced.examples != chunk.examples:
                    raise ValueError(
                        f"A chunk transform changed the number of units ({chunk.examples} → "
                        f"{reduced.examples}): it must map each unit's gradient alone."
                    )
        if self._term_transforms:
            reduced.terms = {p: self._transformed(p, terms, chunk.examples) for p, terms in reduced.terms.items()}
        if chunk.probe:
            return flat_norms(reduced).detach()
        norms = self._reducer.reduce(reduced).detach()
        for hook in list(self._norm_hooks.values()):
            hook(norms)
        return norms

    def _sharded_check(self) -> ShardedCheck | None:
        params = [p for _, p in self.parameters]
        return ShardedCheck(self.model, params) if is_sharded(params) else None

    def _check_coverage(self, by_param: dict) -> None:
        has_grad = [p.grad is not None for _, p in self.parameters]
        has_terms = [p in by_param for _, p in self.parameters]
        sharded = self._sharded_check()
        if sharded is not None:  # FSDP2: a gradient on any process's shard, terms on none, decided alike everywhere
            has_grad, has_terms = sharded.anywhere(has_grad), sharded.anywhere(has_terms)
        for (name, _), grad, terms in zip(self.parameters, has_grad, has_terms):
            if grad and not terms:
                raise UnsupportedLayerError(
                    f"Parameter {name} received a gradient outside the forward of the module that owns it, so "
                    "its per-example gradient is unknown. Freeze it or use it through its module."
                )

    def _check_against_autograd(self, by_param: dict) -> None:
        """Σ_b g_b from the engine must equal autograd's gradient, or some use of a parameter is invisible.

        The rounding of a sum scales with its summands, not with the result: a gradient that cancels to zero
        (a multiple-choice head's bias: Σ_c ∂ℓ/∂logit_c = 0) is compared on the scale Σ_rows ‖g_row‖.
        A chunk holding a non-finite example (or gradient) defers the check to the next chunk: the clip drops that
        example, and whether training fails must not depend on one record.
        Under FSDP2 each process compares its shard of the sums over processes, with every norm below and the
        deferral summed over the processes (`ShardedCheck`): all of them reach the same verdict together.
        """
        sharded = self._sharded_check()
        grads = local_parts(p.grad for _, p in self.parameters if p.grad is not None)
        terms_seen = [t for terms in by_param.values() for t in terms]
        finite = all(bool(torch.isfinite(x).all()) for x in [*vars_tensors(terms_seen), *grads])
        if not (finite if sharded is None else sharded.everywhere(finite)):
            return
        pairs = []
        for name, p in self.parameters:
            terms = [cast_term(t, accumulation_dtype(p)) for t in by_param.get(p, [])]
            ours = torch.zeros(p.shape, dtype=accumulation_dtype(p), device=p.device)
            for term in terms:
                ours = clipped_sum(term, ours.new_ones(term.batch_size), p.shape, out=ours)
            if sharded is None:
                reference = p.grad.to(ours.dtype) if p.grad is not None else torch.zeros_like(ours)
            else:
                ours, reference = sharded.shards(ours, p)
            low_precision = any(t.dtype in (torch.float16, torch.bfloat16) for t in vars_tensors(by_param.get(p, [])))
            summands = sum(squared_norm(t).double().clamp(min=0).sqrt().sum() for t in terms)
            pairs.append((name, ours, reference, low_precision, summands))
        if sharded is None:
            total = torch.sqrt(functools.reduce(operator.add, (r.double().pow(2).sum() for _, _, r, _, _ in pairs)))
            norms = [((o - r).double().norm(), r.double().norm() + s, low) for _, o, r, low, s in pairs]
        else:
            norms, total = sharded.summed_norms([(o, r, low, s) for _, o, r, low, s in pairs])
        for (name, _, reference, _, _), (error, scale, low_precision) in zip(pairs, norms):
            tol = _CHECK_TOLERANCE_LOW_PRECISION if low_precision else _CHECK_TOLERANCE.get(reference.dtype, 1e-3)
            if error > tol * (scale + 1e-4 * total):
                raise UnsupportedLayerError(
                    f"Parameter {name}: the per-example gradients seen by hooks do not add up to its gradient "
                    f"(relative error {error / scale.clamp(min=1e-30):.2e}). It is used outside "
                    "its module's forward (or by an unsupported operation); freeze it or use it through its module."
                )
        self.verified = True

    # ------------------------------------------------------------------ state
    def pop_clipped_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        """The clipped sums since the last pop, handed over (the optimizer noises them); the reducer starts afresh.

        Refused when the reducer accumulates no gradient sums (DP-FROST's partition magnitude reducer).
        """
        return self._gradient_sums_reducer().pop_clipped_sums()

    def discard_chunk(self) -> None:
        """Forget the chunk being recorded: its terms and autograd's un-clipped gradients."""
        for call in self._calls:
            call.terms, call.saved = {}, None
        self._calls.clear()
        self._chunk = None
        for _, p in self.parameters:
            p.grad = None

    def reset(self) -> None:
        """Forget everything not yet released, so an interrupted logical batch never joins the next one."""
        self.discard_chunk()
        self._reducer.reset()
