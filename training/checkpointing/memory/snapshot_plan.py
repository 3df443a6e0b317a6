"""The memory tier's fast path: a snapshot that does not walk the model and the optimizer.

Why: at a snapshot every step, the tier's snapshot of the demo cost ~2 ms, ~12 % of its step, and
most of it was Python: ``model.state_dict()`` and ``optimizer.state_dict()`` walk every module and
every parameter's state, :func:`~training.checkpointing.codec.split_tree` walks what they return,
the slot's layout is looked up by a signature of every tensor.  The tensors those walks find are
the same objects at every snapshot: parameters, buffers and the optimizer's moments are updated in
place.  A plan finds them once, through those very walks; after that a snapshot checks that they
are still what the model and the optimizer hold and copies them, and walks only the small rest
(step, RNG, LR scheduler, AMP scaler, cursor, stream position, the optimizer's ``param_groups``).

Rules (numbered; cited in code and tests):

1. **The same bytes.**  A slot written through a plan is, byte for byte, the slot the full walk
   writes (tested step by step): restore does not know plans exist.
2. **Checked at every snapshot.**  The train state still holds the plan's model and optimizer;
   every module of the tree is still its parent's child; every entry of every module's
   ``_parameters`` and ``_buffers`` (None ones too) and of every parameter's optimizer state is
   still the same object, every tensor at the same address with the same shape, strides and dtype;
   the optimizer's ``state`` and ``param_groups`` and each group's parameters are the same; and
   every container, state-dict hook tables included, has as many entries as when the plan was made.
   A buffer reassigned out of place or set from None, ``p.data = ...``, an in-place transpose, a
   parameter, module or hook added, optimizer state loaded: the check fails and the snapshot takes
   the full walk, which makes a new plan.  A check or a making that raises (a model with a custom
   ``state_dict`` it did not foresee) is a plan that does not hold: the full walk, not a crash.
3. **Only what a plan can see.**  A model whose ``state_dict`` holds a non-tensor (``get_extra_state``)
   or has state-dict hooks, an optimizer with state-dict hooks or non-tensor per-parameter state
   (its value could change while every tensor stays): no plan, the full walk every time.
4. **Adopted only when it agrees.**  A new plan's first output is compared with the full walk's
   (skeletons equal, the same layout, the same bytes); one that does not agree is not used.  A
   run whose plans keep failing the check (a model that reassigns a buffer every step) stops
   making them: a rebuild costs more than the walk it saves.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from training.checkpointing.codec import split_tree
from training.checkpointing.memory.slot_layout import Flat, Group, Layout, Layouts, signature

if TYPE_CHECKING:
    import torch

    from training.checkpointing.memory.source import SnapshotSource

#: The checkpoint part that holds model and optimizer (``SnapshotSource.checkpoint_parts``).
PART = "state"
#: Plans broken (rule 2) before the tier stops making them (rule 4).
MAX_REBUILDS = 3
_VERSION = operator.attrgetter("_version")
#: What a plan's check or making may raise on a model or optimizer it did not foresee (a custom
#: ``state_dict``, a replaced ``param_groups``; torch's out-of-memory is a RuntimeError): a plan
#: that does not hold, the full walk decides and the snapshot is still taken.
PLAN_ERRORS = (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError)


@dataclass(frozen=True)
class Split:
    """A state's checkpoint parts split for a slot: each part's JSON skeleton and its tensors."""

    skeletons: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]

    def flat(self) -> Flat:
        """The tensors in the slot's order."""
        t = self.tensors
        return [(part, key, t[part][key]) for part in sorted(t) for key in sorted(t[part])]


@dataclass(frozen=True)
class SlotContent:
    """What a snapshot writes into a slot: the skeletons, and the tensors in their groups."""

    skeletons: dict[str, Any]  # JSON values and orjson fragments
    groups: list[Group]
    layout: Layout

    @classmethod
    def of(cls, split: Split, layouts: Layouts) -> SlotContent:
        flat = split.flat()
        layout = layouts.of(flat)
        return cls(split.skeletons, layout.groups(flat), layout)


def skeleton_bytes(skeletons: dict[str, Any]) -> bytes:
    """The skeletons as a slot holds them (after its tensors' bytes)."""
    return orjson.dumps(skeletons, option=orjson.OPT_SORT_KEYS)


def split_parts(parts: dict[str, Any]) -> Split:
    """The full walk: every part through :func:`split_tree`."""
    skeletons, tensors = {}, {}
    for part, tree in parts.items():
        skeletons[part], tensors[part] = split_tree(tree)
    return Split(skeletons, tensors)


@dataclass(frozen=True)
class _Watch:
    """What rule 2 checks, as parallel tuples: compared in C loops, not one Python test each."""

    holders: tuple[dict[Any, Any], ...]  # dicts that hold an object...
    names: tuple[Any, ...]  # ...under these keys...
    held: tuple[Any, ...]  # ...which must be these objects
    lists: tuple[tuple[list[Any], tuple[Any, ...]], ...]  # lists that must hold exactly these objects
    sized: tuple[Any, ...]  # containers that must keep...
    sizes: tuple[int, ...]  # ...these lengths
    tensors: tuple[Any, ...]  # tensors that must keep...
    addresses: tuple[int, ...]  # ...their data pointers...
    shapes: tuple[Any, ...]  # ...shapes...
    strides: tuple[Any, ...]  # ...strides (an in-place transpose keeps address and shape)...
    dtypes: tuple[Any, ...]  # ...and dtypes (so does ``p.data = p.data.view(other dtype)``)

    def holds(self) -> bool:
        import torch

        # dict.get, not [] : the optimizer's state is a defaultdict, which [] would add to.
        return (
            all(map(operator.is_, map(dict.get, self.holders, self.names), self.held))
            and tuple(map(len, self.sized)) == self.sizes
            and all(len(now) == len(then) and all(map(operator.is_, now, then)) for now, then in self.lists)
            and tuple(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses
            and tuple(t.shape for t in self.tensors) == self.shapes
            and tuple(map(torch.Tensor.stride, self.tensors)) == self.strides
            and tuple(t.dtype for t in self.tensors) == self.dtypes
        )


@dataclass(frozen=True)
class _Light:
    """A tensor of the walked rest (an RNG state): where it goes, and what it must look like."""

    group: int
    position: int
    part: str
    key: str
    dtype: Any
    shape: Any


class SnapshotPlan:
    """Rank 0's snapshot without the walks: model and optimizer tensors found once (above)."""

    def __init__(
        self, parts: tuple[Any, Any], static_skeleton: dict[str, Any], watch: _Watch, groups: list[list[int]]
    ) -> None:
        #: The model and optimizer the plan watches: a train state holding others has no plan.
        self.parts = parts
        #: The skeletons of the model and of the optimizer's per-parameter state (all tensors), as
        #: JSON fragments.
        self.static_skeleton, self.watch = static_skeleton, watch
        #: Each parameter group's parameter numbers, as ``optimizer.state_dict()`` packs them.
        self.groups = groups
        self.layout: Layout | None = None
        #: Each dtype group's tensors: the watched ones as 1-D views, None where a walked one goes.
        self.templates: list[list[Any]] = []
        self.light: list[_Light] = []
        #: The model's parameters, whose versions tell an in-place change (rule 7 of the tier)...
        self.stepped: tuple[Any, ...] = ()
        #: ...and the places, (group, position), of the tensors an optimizer step does not change:
        #: buffers, which a forward may update, and the walked rest (RNG states, a stream's position).
        self.unstepped: list[tuple[int, int]] = []
        #: Of those, the buffers' places.
        self.buffers: list[tuple[int, int]] = []
        #: Whether every watched tensor is in host memory (what a copy beside the loop copies).
        self.on_cpu = False

    # ------------------------------------------------------------------ making one
    @classmethod
    def build(cls, state: SnapshotSource, full: Split) -> SnapshotPlan | None:
        """A plan for ``state``, whose full walk gave ``full``; None where rule 3 or 4 says no."""
        model, optimizer = state.parts.model, state.parts.optimizer
        if optimizer._optimizer_state_dict_pre_hooks or optimizer._optimizer_state_dict_post_hooks:
            return None
        watch = _Collector()
        static: dict[str, torch.Tensor] = {}
        buffers: set[str] = set()
        if not _watch_model(model, watch, static, buffers) or not _watch_optimizer(optimizer, watch, static):
            return None
        skeleton = full.skeletons[PART]
        static_skeleton = {  # serialised once, as the slot's skeletons are (keys sorted)
            name: orjson.Fragment(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS))
            for name, tree in (("model", skeleton["model"]), ("optimizer.state", skeleton["optimizer"]["state"]))
        }
        groups = [list(g["params"]) for g in optimizer.state_dict()["param_groups"]]
        watch.size(optimizer.param_groups)
        for g in optimizer.param_groups:
            watch.hold(g, "params", g["params"])
            watch.lists.append((g["params"], tuple(g["params"])))
        plan = cls((model, optimizer), static_skeleton, watch.done(), groups)
        plan._lay_out(full.flat(), static, buffers)
        return plan if plan.agrees(state, full) else None

    def _lay_out(self, flat: Flat, static: dict[str, torch.Tensor], buffers: set[str]) -> None:
        """The slot's layout, with the watched tensors' 1-D views in place."""
        self.layout = Layout.of(signature(flat))
        stepped = []
        for g, (_dtype, _offset, _numel, idx) in enumerate(self.layout.order):
            template: list[Any] = []
            for i in idx:
                part, key, t = flat[i]
                if part == PART and key in static:
                    if key in buffers:
                        self.unstepped.append((g, len(template)))
                        self.buffers.append((g, len(template)))
                    elif key.startswith("model."):
                        stepped.append(static[key])
                    template.append(static[key].reshape(-1))
                else:
                    self.unstepped.append((g, len(template)))
                    self.light.append(_Light(g, len(template), part, key, t.dtype, t.shape))
                    template.append(None)
            self.templates.append(template)
        self.stepped = tuple(stepped)
        self.on_cpu = not any(t.is_cuda for t in static.values())

    def holds(self) -> bool:
        """Rule 2's check; one that raises (a container it did not foresee) does not hold."""
        try:
            return self.watch.holds()
        except PLAN_ERRORS:
            return False

    def versions(self) -> tuple[int, ...]:
        """The version counters of the model's parameters: an in-place change to one (but
        through ``.data``, which autograd does not see) moves its counter.  The optimizer's state
        is left out: only its ``step`` changes it."""
        return tuple(map(_VERSION, self.stepped))

    def detached(self, content: SlotContent) -> SlotContent:
        """``content`` (this plan's) with every tensor an optimizer step does not change copied
        now: buffers and the walked rest may change before the next step does (memory tier rule 7)."""
        groups = [(d, o, n, list(ts)) for d, o, n, ts in content.groups]
        for g, position in self.unstepped:
            groups[g][3][position] = groups[g][3][position].clone()
        return SlotContent(content.skeletons, groups, content.layout)

    def agrees(self, state: SnapshotSource, full: Split) -> bool:
        """Rule 4: this plan's content for ``state`` is the full walk's ``full``, bytes and all."""
        import torch

        mine = self.content(state, _rank_of(full))
        if mine is None or skeleton_bytes(mine.skeletons) != skeleton_bytes(full.skeletons):
            return False
        theirs = SlotContent.of(full, Layouts())
        if mine.layout.places != theirs.layout.places:
            return False
        for a, b in zip(mine.groups, theirs.groups, strict=True):
            if a[:3] != b[:3] or len(a[3]) != len(b[3]):
                return False
            for x, y in zip(a[3], b[3], strict=True):  # pair by pair: no second copy of the state
                if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
                    return False
                if x.data_ptr() != y.data_ptr() and not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                    return False  # compared as bytes: a NaN is equal to itself here
        return True

    # ------------------------------------------------------------------ using one
    def content(self, state: SnapshotSource, rank: int) -> SlotContent | None:
        """Rank ``rank``'s snapshot of ``state``, as the full walk would lay it out, or None when
        the model or optimizer is no longer what the plan saw (rule 2)."""
        light = self.light_parts(state, rank)
        return None if light is None else self.lay_out(light)

    def light_parts(self, state: SnapshotSource, rank: int) -> dict[str, Any] | None:
        """Rule 2's check, then the walked rest of ``state`` as checkpoint parts (step, RNG
        states, scheduler, scaler, cursor, stream position, the optimizer's ``param_groups``):
        what :meth:`lay_out` lays out.  None when the plan does not hold."""
        model, optimizer = self.parts
        if state.parts.model is not model or state.parts.optimizer is not optimizer or not self.holds():
            return None
        light = state.checkpoint_parts(rank, include_replicated=True, sharded=True)
        light[PART]["optimizer"] = {
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": idx}
                for g, idx in zip(optimizer.param_groups, self.groups, strict=True)
            ]
        }
        return light

    def lay_out(self, light: dict[str, Any], templates: list[list[Any]] | None = None) -> SlotContent | None:
        """The slot content of ``light`` (:meth:`light_parts`) with the watched tensors of
        ``templates`` (the plan's own by default, :meth:`frozen_templates`' for a copy made
        later); None when a tensor appeared in the walked rest (the full walk lays it out)."""
        walked = split_parts(light)
        tensors = walked.tensors
        if sum(map(len, tensors.values())) != len(self.light):
            return None
        groups = [list(t) for t in templates or self.templates]
        for w in self.light:
            t = tensors[w.part].get(w.key)
            if t is None or t.dtype != w.dtype or t.shape != w.shape:
                return None
            groups[w.group][w.position] = t.reshape(-1)
        skeletons = walked.skeletons
        skeletons[PART]["model"] = self.static_skeleton["model"]
        skeletons[PART]["optimizer"]["state"] = self.static_skeleton["optimizer.state"]
        assert self.layout is not None
        order = self.layout.order
        return SlotContent(
            skeletons, [(d, o, n, g) for (d, o, n, _i), g in zip(order, groups, strict=True)], self.layout
        )

    def frozen_templates(self) -> list[list[Any]]:
        """The plan's templates with each buffer copied now: a forward may update one in place
        before a copy made beside the loop reads it (memory tier rule 7)."""
        templates = [list(t) for t in self.templates]
        for g, position in self.buffers:
            templates[g][position] = templates[g][position].clone()
        return templates


def _rank_of(split: Split) -> int:
    """The rank whose parts ``split`` holds (its one ``rank-<r>`` part)."""
    (part,) = split.skeletons.keys() - {PART}
    return int(part.removeprefix("rank-"))


class _Collector:
    """Gathers a :class:`_Watch` entry by entry."""

    def __init__(self) -> None:
        self.holders: list[Any] = []
        self.names: list[Any] = []
        self.lists: list[tuple[list[Any], tuple[Any, ...]]] = []
        self.held: list[Any] = []
        self.sized: list[Any] = []
        self.tensors: list[Any] = []

    def hold(self, holder: Any, name: Any, obj: Any) -> None:
        self.holders.append(holder)
        self.names.append(name)
        self.held.append(obj)

    def size(self, container: Any) -> None:
        self.sized.append(container)

    def tensor(self, t: Any) -> None:
        self.tensors.append(t)

    def done(self) -> _Watch:
        return _Watch(
            tuple(self.holders),
            tuple(self.names),
            tuple(self.held),
            tuple(self.lists),
            tuple(self.sized),
            tuple(map(len, self.sized)),
            tuple(self.tensors),
            tuple(t.data_ptr() for t in self.tensors),
            tuple(t.shape for t in self.tensors),
            tuple(t.stride() for t in self.tensors),
            tuple(t.dtype for t in self.tensors),
        )


def _watch_model(model: Any, watch: _Collector, static: dict[str, Any], buffers: set[str]) -> bool:
    """Rule 2's entries for the model, its state-dict tensors by checkpoint key (the keys of its
    buffers into ``buffers``); False where rule 3 says no plan."""
    import torch

    for _path, module in model.named_modules(remove_duplicate=False):
        hooks = (module._state_dict_hooks, module._state_dict_pre_hooks)
        if any(hooks):
            return False
        for container in (module._modules, module._parameters, module._buffers, module._non_persistent_buffers_set):
            watch.size(container)
        for container in hooks:  # one added later ends the plan
            watch.size(container)
        for entries in (module._modules, module._parameters, module._buffers):
            for name, entry in entries.items():  # None too: a buffer registered as None and set later
                watch.hold(entries, name, entry)
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):  # get_extra_state: not a tensor the plan can watch
            return False
        owner_path, _, name = key.rpartition(".")
        owner = model.get_submodule(owner_path)
        holder = owner._parameters if name in owner._parameters else owner._buffers
        if holder.get(name) is not value or not value.is_contiguous():
            return False
        watch.tensor(value)
        static[f"model.{key}"] = value.detach()
        if holder is owner._buffers:
            buffers.add(f"model.{key}")
    return True


def _watch_optimizer(optimizer: Any, watch: _Collector, static: dict[str, Any]) -> bool:
    """Rule 2's entries for the optimizer's per-parameter state, by its state-dict keys."""
    import torch

    index: dict[int, int] = {}  # the state dict's parameter numbers, as torch packs them
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        index.setdefault(id(p), i)
    watch.hold(optimizer.__dict__, "state", optimizer.state)
    watch.hold(optimizer.__dict__, "param_groups", optimizer.param_groups)
    watch.size(optimizer.state)
    watch.size(optimizer._optimizer_state_dict_pre_hooks)
    watch.size(optimizer._optimizer_state_dict_post_hooks)
    for param, entries in optimizer.state.items():
        if not isinstance(param, torch.Tensor) or id(param) not in index:
            return False
        watch.hold(optimizer.state, param, entries)
        watch.size(entries)
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) or not value.is_contiguous():
                return False  # rule 3: a value that changes where no tensor does
            watch.hold(entries, key, value)
            watch.tensor(value)
            static[f"optimizer.state.{index[id(param)]}.{key}"] = value
    return True
